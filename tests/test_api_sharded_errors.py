"""``ShardedAttention``'s argument checks and its bound on every wait, on 2 gloo ranks.

One group runs every check in turn (bad arguments are refused on each rank before any
exchange, so the ranks stay in step); then rank 1 skips a call, and rank 0's error must name
it, within the object's short timeout, instead of waiting forever. A wait that timed out
leaves gloo's connection to that peer closed, so each skipped call has a group of its own,
and rank 1 stays alive (outside the group) until rank 0 has given up.
"""

from __future__ import annotations

import functools
import math
import time
from pathlib import Path

import pytest
import torch

import treeattn
from treeattn.runtime.errors import RankLost, RankTimeout
from treeattn.runtime.group import RankContext
from treeattn.runtime.launch import LaunchOptions, launch
from treeattn.runtime.sharded_attention import ShardedAttention, ShardedAttentionError

# A timed-out wait leaves gloo's pair to the silent rank closed, so these ranks are never
# reused by another test (fresh_ranks: no warm group, see tests/rank_pool.py).
pytestmark = [pytest.mark.timeout(300), pytest.mark.fresh_ranks]
TIMEOUT_S = 3.0  # the objects' timeout: short, so that the skipped calls end quickly
# the object's algorithm and the (batch, tokens) of the call rank 1 skips
SKIPS = {"skipped call": ("tree", (1, 5)), "skipped collective": ("oneshot", (1, 5)),
         "skipped first call": ("tree", (2, 5))}


def _refused(make) -> str:
    """The message of the ShardedAttentionError ``make()`` raises ("" if none)."""
    try:
        make()
    except ShardedAttentionError as exc:
        return str(exc)
    return ""


def _shapes(batch: int = 1, tokens: int = 5):
    g = torch.Generator().manual_seed(batch)
    q = torch.randn(batch, 4, 8, generator=g)  # (B, Hq, D)
    kv = torch.randn(2, batch, 2, tokens, 8, generator=g)  # (2, B, Hkv, T, D)
    return q, kv[0], kv[1]


def _job(ctx: RankContext, skip: str, done: Path) -> dict:
    """Every refusal, then ``skip``: a call rank 1 does not make. ``done`` is the file rank 0
    writes when it has given up waiting."""
    torch.set_num_threads(1)
    plan = treeattn.plan(f"local:ranks={ctx.world}", q_heads=4, kv_heads=2, head_dim=8,
                         seq_len=64)
    got = {
        "name as plan": _refused(lambda: ShardedAttention("tree")),
        "number as plan": _refused(lambda: ShardedAttention(3)),
        "number as algorithm": _refused(lambda: ShardedAttention(algorithm=3)),
        "plan and algorithm": _refused(lambda: ShardedAttention(plan, algorithm="tree")),
        "timeout nan": _refused(lambda: ShardedAttention(timeout_s=math.nan)),
        "timeout 0": _refused(lambda: ShardedAttention(timeout_s=0)),
        "timeout 1e300": _refused(lambda: ShardedAttention(timeout_s=1e300)),
        "scale inf": _refused(lambda: ShardedAttention(scale=math.inf)),
        "topology of 8": _refused(lambda: ShardedAttention(topology="dgx-h100:nodes=1")),
        "topology of a name": _refused(lambda: ShardedAttention(algorithm="tree",
                                                                topology="local:ranks=2")),
    }
    algorithm, shape = SKIPS[skip]
    attn = ShardedAttention(algorithm=algorithm, timeout_s=TIMEOUT_S)
    auto = ShardedAttention(topology=f"local:ranks={ctx.world}", timeout_s=TIMEOUT_S)
    q, k, v = _shapes()
    for name, kv_len in (("kv_len past the shard", torch.tensor([6])),
                         ("kv_len negative", torch.tensor([-1])),
                         ("kv_len float", torch.tensor([2.0])),
                         ("kv_len list", [2])):
        got[name] = _refused(lambda kv_len=kv_len: attn(q, k, v, kv_len=kv_len))
    want = attn(q, k, v)  # both ranks: the shape is now known to the object
    assert torch.allclose(auto(q, k, v), want, atol=1e-5)
    assert torch.allclose(attn(q, k, v, kv_len=torch.tensor([5])), want, atol=1e-6)
    if ctx.rank == 1:  # skips the call, alive until rank 0 gives up (bounded: no hang)
        for _ in range(600):
            if done.exists():
                break
            time.sleep(0.1)
        return got
    try:
        attn(*_shapes(*shape))
        got[skip] = "no error"
    except (RankTimeout, RankLost) as exc:
        got[skip] = f"{type(exc).__name__}: {exc}"
    done.write_text("given up")
    return got


def _run(skip: str, folder: Path) -> dict:
    job = functools.partial(_job, skip=skip, done=folder / f"{skip}.done")
    return launch(job, 2, LaunchOptions(timeout_s=60, threads=1))


@pytest.fixture(scope="module")
def refusals(tmp_path_factory) -> dict:
    return _run("skipped call", tmp_path_factory.mktemp("skips"))


@pytest.mark.parametrize("case, match", [
    ("name as plan", "pass algorithm='tree'"),
    ("number as plan", "plan must be a Plan"),
    ("number as algorithm", "unknown algorithm 3"),
    ("plan and algorithm", "not plan and algorithm"),
    ("timeout nan", "timeout_s must be"),
    ("timeout 0", "timeout_s must be"),
    ("timeout 1e300", "timeout_s must be"),
    ("scale inf", "scale must be"),
    ("topology of 8", "the topology has 8 GPUs, the group 2 ranks"),
    ("topology of a name", "takes none"),
    ("kv_len past the shard", "within this rank's shard of 5 tokens"),
    ("kv_len negative", "within this rank's shard"),
    ("kv_len float", "integer tensor"),
    ("kv_len list", "integer tensor"),
])
def test_bad_arguments_are_refused_by_name(refusals, case, match):
    assert match in refusals[case]


@pytest.mark.parametrize("case, match", [
    # a shape already seen: the reduction's own wait names the peer it waited on
    ("skipped call", "waiting for rank 1 (receive"),
    ("skipped collective", "waiting for rank 1 (all_gather"),
    # a new shape: the shapes' exchange names the rank that did not come
    ("skipped first call", "rank 1 did not reach the first call of this shape within 3s"),
])
def test_a_rank_that_skips_a_call_is_named_not_waited_for(refusals, tmp_path, case, match):
    got = refusals[case] if case in refusals else _run(case, tmp_path)[case]
    assert got.startswith("RankTimeout: rank 0:") and match in got, got


def test_auto_on_a_cuda_group_needs_the_gpus_topology():
    attn = ShardedAttention.__new__(ShardedAttention)  # the check alone, without a group
    attn.ctx = RankContext(0, 2, 0, torch.device("cuda", 0), "nccl")
    with pytest.raises(ShardedAttentionError, match="pass topology="):
        attn._topology(None)
    assert attn._topology("local:ranks=2").num_gpus == 2
