"""``treeattn.ShardedAttention`` against single-process attention over the concatenated shards.

Reference: :func:`_attention`, written here from the definition (scores, softmax, weighted
values; GQA by repeating KV heads), independent of treeattn's kernels. Property (hypothesis):
for every algorithm, at worlds 2, 3 and 4 on gloo, with uneven and empty shards, GQA, batch
> 1, per-sequence valid lengths (``kv_len``), K/V given as two tensors or as the two halves of
one, the output and the natural-log LSE equal the reference's. The process group is started
once per world; rank 0 draws the examples and broadcasts each, so hypothesis (shrinking
included) runs in one process while every rank follows.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import treeattn
from treeattn.runtime.errors import RuntimeFailure
from treeattn.runtime.group import broadcast_object
from treeattn.runtime.launch import LaunchOptions, launch
from treeattn.schedule.algorithms import ALGORITHM_NAMES

pytestmark = pytest.mark.timeout(600)
ATOL = 2e-5
ALGORITHMS = (*ALGORITHM_NAMES, "auto")
HEADS = [(4, 4), (6, 3), (4, 1)]  # MHA, GQA with heads that do not divide 4, MQA


def _attention(q, ks, vs, lens=None):
    """Single-process attention of q (B, Hq, D) over the shards concatenated; ``lens[r][b]``
    valid tokens of shard r for sequence b. Returns o (B, Hq, D), natural lse (B, Hq), f64."""
    b, hq, d = q.shape
    outs, lses = [], []
    for i in range(b):
        k = torch.cat([kr[i, :, : (lens[r][i] if lens else kr.shape[2])]
                       for r, kr in enumerate(ks)], dim=1).double()  # (Hkv, T, D)
        v = torch.cat([vr[i, :, : (lens[r][i] if lens else vr.shape[2])]
                       for r, vr in enumerate(vs)], dim=1).double()
        rep = hq // k.shape[0]
        k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)  # (Hq, T, D)
        s = torch.einsum("hd,htd->ht", q[i].double(), k) / math.sqrt(d)  # (Hq, T)
        outs.append(torch.einsum("ht,htd->hd", torch.softmax(s, -1), v))
        lses.append(torch.logsumexp(s, -1))
    return torch.stack(outs), torch.stack(lses)


def _tensors(spec, world):
    """Every rank's shards (the same on every rank, from the seed) and the query."""
    g = torch.Generator().manual_seed(spec["seed"])
    b, (hq, hkv), d = spec["batch"], spec["heads"], spec["head_dim"]
    q = torch.randn(b, hq, d, generator=g)
    ks, vs, stacked = [], [], []
    for t in spec["lengths"]:
        kv = torch.randn(2, b, hkv, t, d, generator=g) * 2  # (2, B, Hkv, T, D)
        stacked.append(kv)
        ks.append(kv[0])
        vs.append(kv[1])
    if not spec["one_tensor"]:
        ks, vs = [k.clone() for k in ks], [v.clone() for v in vs]
    return q, ks, vs


def _check_example(ctx, attns, spec) -> float:
    """Run every algorithm on this rank's shard; the largest error against the reference."""
    q, ks, vs = _tensors(spec, ctx.world)
    lens = spec["kv_len"]
    want_o, want_lse = _attention(q, ks, vs, lens)
    worst = 0.0
    for name, attn in attns.items():
        kv_len = None
        if lens is not None and name not in ("ring", "ring-passq"):
            kv_len = torch.tensor([lens[ctx.rank][i] for i in range(spec["batch"])])
        elif lens is not None:  # these take whole shards only: check them on those
            want = _attention(q, ks, vs)
        o, lse = attn(q, ks[ctx.rank], vs[ctx.rank], kv_len=kv_len, return_lse=True)
        ref_o, ref_lse = (want_o, want_lse) if kv_len is not None or lens is None else want
        assert o.shape == q.shape and lse.shape == q.shape[:2]
        worst = max(worst, float((o.double() - ref_o).abs().max()),
                    float((lse.double() - ref_lse).abs().max()))
    return worst


def _property_job(ctx, examples: int):
    attns = {name: treeattn.ShardedAttention(algorithm=name) for name in ALGORITHMS}
    if ctx.rank != 0:
        while (spec := broadcast_object(ctx, None)) is not None:
            errors = [None] * ctx.world
            dist.all_gather_object(errors, _check_example(ctx, attns, spec))
        return None
    world = ctx.world
    shard = st.integers(0, 7)

    @st.composite
    def specs(draw):
        lengths = draw(st.lists(shard, min_size=world, max_size=world).filter(lambda x: sum(x)))
        batch = draw(st.integers(1, 2))
        kv_len = None
        if draw(st.booleans()):  # a valid prefix per sequence, at least one token overall
            kv_len = [[draw(st.integers(0, t)) for _ in range(batch)] for t in lengths]
            for i in range(batch):
                if not sum(row[i] for row in kv_len):
                    kv_len[max(range(world), key=lambda r: lengths[r])][i] = max(lengths)
        return {"seed": draw(st.integers(0, 2**31 - 1)), "lengths": lengths, "batch": batch,
                "heads": draw(st.sampled_from(HEADS)), "head_dim": 8,
                "one_tensor": draw(st.booleans()), "kv_len": kv_len}

    worst = [0.0]

    @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(specs())
    def prop(spec):
        broadcast_object(ctx, spec)
        errors = [None] * ctx.world
        dist.all_gather_object(errors, _check_example(ctx, attns, spec))
        worst[0] = max(worst[0], *errors)
        assert max(errors) < ATOL, (spec, errors)

    try:
        prop()
    finally:
        broadcast_object(ctx, None)
    return {"worst": worst[0], "algorithms": sorted(attns)}


@pytest.mark.parametrize("world,examples", [(2, 20), (3, 15), (4, 10)])
def test_sharded_attention_equals_one_process(world, examples):
    result = launch(functools.partial(_property_job, examples=examples), world,
                    LaunchOptions(timeout_s=120, threads=1))
    assert result["worst"] < ATOL
    assert set(result["algorithms"]) == set(ALGORITHMS)


def _lse_and_plan_job(ctx):
    """A caller's own partials in base 2 (FlashInfer's) reduce like natural ones; a Plan runs
    its schedule; the public merge_partials agrees with the reduction."""
    g = torch.Generator().manual_seed(7)
    b, hq, hkv, d = 2, 4, 2, 8
    q = torch.randn(b, hq, d, generator=g)
    ks = [torch.randn(b, hkv, 5 + r, d, generator=g) for r in range(ctx.world)]
    vs = [torch.randn(b, hkv, 5 + r, d, generator=g) for r in range(ctx.world)]
    want_o, want_lse = _attention(q, ks, vs)
    plan = treeattn.plan(f"local:ranks={ctx.world}", q_heads=hq, kv_heads=hkv, head_dim=d,
                         dtype="float32", seq_len=64)
    attn = treeattn.ShardedAttention(plan)
    o = attn(q, ks[ctx.rank], vs[ctx.rank])
    assert (o.double() - want_o).abs().max() < ATOL
    from treeattn.kernels import partial_attention

    mine = partial_attention(q, ks[ctx.rank], vs[ctx.rank])
    log2e = 1 / math.log(2)
    o2, lse2 = attn.reduce(mine[0], mine[1] * log2e, lse_base="2")
    assert (o2.double() - want_o).abs().max() < ATOL
    assert (lse2.double() - want_lse).abs().max() < ATOL
    parts = [partial_attention(q, k, v) for k, v in zip(ks, vs)]
    o3, lse3 = treeattn.merge_partials(torch.stack([p[0] for p in parts]),
                                       torch.stack([p[1] * log2e for p in parts]), lse_base="2")
    assert (lse3.double() - want_lse).abs().max() < ATOL
    try:
        attn.reduce(mine[0], mine[1], lse_base="10")
    except Exception as exc:
        assert "lse_base" in str(exc)
    else:
        raise AssertionError("lse_base 10 was accepted")
    return plan.algorithm


def test_base2_partials_and_a_plan():
    assert launch(_lse_and_plan_job, 2, LaunchOptions(timeout_s=60, threads=1))


def _disagree_job(ctx, what):
    if what == "plan":
        treeattn.ShardedAttention(algorithm="tree" if ctx.rank == 0 else "butterfly")
    elif what == "shape":
        attn = treeattn.ShardedAttention(algorithm="tree")
        hq = 4 if ctx.rank < 2 else 2
        attn(torch.randn(1, hq, 8), torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8))
    elif what == "world":
        plan = treeattn.plan("local:ranks=4", q_heads=4, kv_heads=2, head_dim=8, seq_len=64)
        treeattn.ShardedAttention(plan)
    elif what == "plan_shape":
        plan = treeattn.plan(f"local:ranks={ctx.world}", q_heads=4, kv_heads=2, head_dim=8,
                             seq_len=64)
        treeattn.ShardedAttention(plan)(torch.randn(1, 8, 8), torch.randn(1, 2, 3, 8),
                                        torch.randn(1, 2, 3, 8))


@pytest.mark.parametrize("what,world,message", [
    ("plan", 3, r"disagree on the plan: ranks 0 have \w+; ranks 1, 2 have"),
    ("shape", 3, r"disagree on the shapes .*ranks 0, 1 have \w+; ranks 2 have"),
    ("world", 2, "the plan is for 4 ranks, the group has 2"),
    ("plan_shape", 2, "do not match the plan's 4 query / 2 KV heads"),
])
def test_mismatches_are_one_error_not_a_hang(what, world, message):
    with pytest.raises(RuntimeFailure, match=message):
        launch(functools.partial(_disagree_job, what=what), world,
               LaunchOptions(timeout_s=30, threads=1))


def test_plan_needs_no_torch():
    import subprocess
    import sys

    code = ("import sys, treeattn; p = treeattn.plan('dgx-h100:nodes=1', q_heads=32, "
            "kv_heads=8, head_dim=128, seq_len=32768); "
            "assert 'torch' not in sys.modules, 'torch imported'; print(p.algorithm)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() in ALGORITHM_NAMES


def _subgroup_job(ctx):
    """Two context-parallel groups side by side, as beside tensor parallelism: ranks {0, 2}
    and {1, 3}, each decoding its own data over its own subgroup, every algorithm."""
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # every rank makes both
    mine, member = groups[ctx.rank % 2], ctx.rank // 2
    g = torch.Generator().manual_seed(50 + ctx.rank % 2)  # the same data within a group
    q = torch.randn(2, 6, 16, generator=g)
    kv = torch.randn(2, 2, 3, 37, 16, generator=g)  # (2, B, Hkv, T, D)
    cut = 21  # uneven shards: 21 and 16 tokens
    ks, vs = [kv[0, :, :, :cut], kv[0, :, :, cut:]], [kv[1, :, :, :cut], kv[1, :, :, cut:]]
    want_o, want_lse = _attention(q, ks, vs)
    worst = {}
    for algorithm in ALGORITHMS:
        attn = treeattn.ShardedAttention(group=mine, algorithm=algorithm)
        assert (attn.rank, attn.world) == (member, 2)
        o, lse = attn(q, ks[member], vs[member], return_lse=True)
        worst[algorithm] = max(float((o.double() - want_o).abs().max()),
                               float((lse.double() - want_lse).abs().max()))
    return worst


@pytest.mark.timeout(300)
def test_every_algorithm_runs_on_a_process_subgroup():
    worst = launch(_subgroup_job, 4, LaunchOptions(timeout_s=60.0, threads=1))
    assert set(worst) == set(ALGORITHMS)
    assert max(worst.values()) < ATOL, worst


def test_a_schedule_needing_a_strict_subgroup_of_a_subgroup_is_refused():
    """new_group is collective over the whole world, which other context-parallel groups are
    not running in step with: such a schedule is refused by name before any group is made."""
    from treeattn.runtime.collectives import Groups
    from treeattn.runtime.group import RankContext
    from treeattn.schedule.ir import Collective, Schedule
    from treeattn.schedule.payloads import CollectiveOp

    subgroup = object()  # any stand-in: Groups only asks whether there is one
    ctx = RankContext(0, 4, 0, torch.device("cpu"), "gloo", group_ref=lambda: subgroup,
                      ranks=(0, 2, 4, 6))
    pair = Collective(CollectiveOp.ALL_REDUCE_SUM, (0, 1), 64)
    schedule = Schedule("two-level", [[pair], [pair], [], []])
    with pytest.raises(RuntimeFailure, match=r"two-level: its collective over ranks \[0, 1\] "
                                             "needs a subgroup"):
        Groups(ctx, schedule)
