"""``hier`` on gloo ranks laid out as hosts: the executor,
``ShardedAttention(algorithm="hier")`` and a process subgroup, against single-process
attention in float64 written here (scores, softmax, weighted values; GQA by repeating KV
heads), with every rank's output bit-identical (the gathers fold in group order). One
process group of 4 ranks serves every case."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
import torch.distributed as dist

import treeattn
from treeattn.runtime.collectives import make_subgroups_everywhere
from treeattn.runtime.executor import Executor
from treeattn.runtime.group import HOST_ENV
from treeattn.runtime.launch import LaunchOptions, launch
from treeattn.runtime.plans import workload_for
from treeattn.runtime.sharded_attention import group_context
from treeattn.runtime.wire import AttnDims
from treeattn.sim import build_schedule
from treeattn.topo import Topology

pytestmark = pytest.mark.timeout(120)
TOL = 1e-6
# (shard lengths, batch, query heads, KV heads): uneven, empty, GQA, batch 2
CASES = [((5, 3, 0, 4), 1, 4, 2), ((1, 0, 0, 6), 2, 4, 1), ((2, 2, 2, 2), 2, 2, 2)]


def _attention(q, kv):
    """q (B, Hq, D), kv (2, B, Hkv, T, D) -> o (B, Hq, D), lse (B, Hq), float64."""
    k, v = kv.double()
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)  # (B, Hq, T, D)
    s = torch.einsum("bhd,bhtd->bht", q.double(), k) / math.sqrt(q.shape[2])  # (B, Hq, T)
    return torch.einsum("bht,bhtd->bhd", torch.softmax(s, -1), v), torch.logsumexp(s, -1)


def _data(case, seed):
    lengths, batch, hq, hkv = case
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, hq, 8, generator=g)  # (B, Hq, D)
    kv = torch.randn(2, batch, hkv, sum(lengths), 8, generator=g)  # (2, B, Hkv, T, D)
    bounds = [sum(lengths[:r]) for r in range(len(lengths) + 1)]
    shards = [kv[:, :, :, a:b].contiguous() for a, b in zip(bounds, bounds[1:])]
    return q, kv, shards


def _error(o, lse, q, kv) -> float:
    want_o, want_lse = _attention(q, kv)
    return max(float(((o.double() - want_o).abs() / (1 + want_o.abs())).max()),
               float(((lse.double() - want_lse).abs() / (1 + want_lse.abs())).max()))


def _replicas_differ(o, lse) -> float:
    """How many ranks' (o, lse) differ in any bit from rank 0's (default group)."""
    mine = torch.cat([o.reshape(-1).float(), lse.reshape(-1).float()])
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return float(sum(not torch.equal(x, everyone[0]) for x in everyone))


def _job(ctx):
    worst = {}
    # 1. the executor on the default group, 4 ranks as 2 hosts: node then rail
    topo = Topology.from_spec("local:ranks=4,hosts=2")
    for i, (case, rail) in enumerate(zip(CASES, ("all_gather", "all_reduce", "all_gather"))):
        q, kv, shards = _data(case, i)
        dims = AttnDims(q.shape[0], q.shape[1], kv.shape[2], 8)
        schedule = build_schedule("hier", topo, workload_for(dims, list(case[0])), rail=rail)
        (o, lse), _ = Executor(ctx, schedule, list(case[0]), dims).run(q, shards[ctx.rank])
        worst[f"executor {case} {rail}"] = _error(o, lse, q, kv)
        worst[f"replicas differ {case} {rail}"] = _replicas_differ(o, lse)
    # oneshot's gather folds in group order too: every rank holds the same bits
    q, kv, shards = _data(CASES[0], 3)
    dims = AttnDims(q.shape[0], q.shape[1], kv.shape[2], 8)
    schedule = build_schedule("oneshot", Topology.from_spec("local:ranks=4"),
                              workload_for(dims, list(CASES[0][0])))
    (o, lse), _ = Executor(ctx, schedule, list(CASES[0][0]), dims).run(q, shards[ctx.rank])
    worst["oneshot"] = _error(o, lse, q, kv)
    worst["replicas differ oneshot"] = _replicas_differ(o, lse)
    # 2. ShardedAttention(algorithm="hier"): the hosts from $TREEATTN_HOST, ranks {0, 1} and {2, 3}
    os.environ[HOST_ENV] = f"host{ctx.rank // 2}"
    attn = treeattn.ShardedAttention(algorithm="hier")
    q, kv, shards = _data(CASES[0], 7)
    o, lse = attn(q, shards[ctx.rank][0], shards[ctx.rank][1], return_lse=True)
    worst["ShardedAttention"] = _error(o, lse, q, kv)
    built = next(iter(attn._executors.values()))[0].schedule
    worst["hosts"] = built.params["hosts"]
    # 3. a context-parallel group {1, 2, 3} on hosts a, a, b (uneven: a rail missing a GPU);
    # rank 0 stands for another group that needs no subgroup, yet makes them with everyone
    groups = [dist.new_group([1, 2, 3])]
    os.environ[HOST_ENV] = "a" if ctx.rank < 3 else "b"
    if ctx.rank == 0:
        make_subgroups_everywhere(group_context(), [])
        return worst
    attn = treeattn.ShardedAttention(algorithm="hier", group=groups[0])
    lengths = (4, 0, 3)
    q, kv, shards = _data((lengths, 2, 4, 2), 11)
    member = ctx.rank - 1
    o, lse = attn(q, shards[member][0], shards[member][1], return_lse=True)
    err = _error(o, lse, q, kv)
    errors = [None] * 3
    dist.all_gather_object(errors, err, group=groups[0])
    if ctx.rank == 1:
        built = next(iter(attn._executors.values()))[0].schedule
        dist.send_object_list([max(errors), built.params], dst=0)
    return worst


def _collect(ctx):
    """Rank 0 also receives the subgroup case's result from rank 1."""
    worst = _job(ctx)
    if ctx.rank == 0:
        box = [None, None]
        dist.recv_object_list(box, src=1)
        worst["subgroup"], worst["subgroup params"] = box
    return worst


def test_hier_on_gloo_ranks_laid_out_as_hosts():
    worst = launch(_collect, 4, LaunchOptions(timeout_s=60.0, threads=1))
    assert worst.pop("hosts") == 2  # ShardedAttention saw two hosts, not one
    params = worst.pop("subgroup params")
    assert params["hosts"] == 2 and params["broadcast_to"] == 1  # uneven: two levels
    assert max(worst.values()) < TOL, {k: v for k, v in worst.items() if v >= TOL}


PROFILE = {  # a CPU calibration, as `treeattn calibrate` writes one (the fields read here)
    "version": 1, "backend": "gloo", "world": 4, "cores": 2,
    "p2p": {"latency_s": 40e-6, "bandwidth_Bps": 2e9, "sizes": [8, 1 << 20],
            "times_s": [40e-6, 564e-6]},
    "allreduce": {"latency_s": 90e-6, "sizes": [8], "times_s": [90e-6]},
    "attention": {"bandwidth_Bps": 8e9, "launch_s": 15e-6, "threads_per_rank": 1},
    "machine": {"cpu": "test"},
}


def test_check_on_cpu_ranks_as_hosts_calibrates_and_keeps_the_layout():
    from treeattn.runtime.measure.check import RunRequest, calibrates, predictor

    topo, hardware, backend = predictor(PROFILE, 4, "local:ranks=4,hosts=2")
    assert [topo.host_of(r) for r in range(4)] == ["host0", "host0", "host1", "host1"]
    assert hardware is not None and backend is not None  # the calibration prices it
    assert topo.path_bandwidth(0, 3) == 2e9  # the profile's bandwidth, across hosts too
    assert calibrates(RunRequest((64,), ("hier",), check=True, topology="local:ranks=4,hosts=2"))
    assert not calibrates(RunRequest((64,), check=True, topology="dgx-h100"))


def test_run_refuses_a_host_layout_that_does_not_divide_the_ranks(capsys):
    from treeattn.cli import main

    argv = ["run", "--nproc", "4", "--seq-len", "64", "--algorithm", "hier", "--check",
            "--topology", "local:ranks=4,hosts=3"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: local: hosts=3 does not divide ranks=4 into equal hosts"]


def test_forcing_hier_on_one_host_runs_oneshot_and_says_so(capsys):
    from treeattn.cli import main

    argv = ["run", "--nproc", "2", "--seq-len", "64", "--algorithm", "hier", "--steps", "1",
            "--warmup", "0", "--min-time", "0", "--heads", "4", "--kv-heads", "2",
            "--head-dim", "16", "--json"]
    assert main(argv) == 0
    out = capsys.readouterr()
    assert "note: hier at 64 tokens: one host: no rail step, hier is oneshot" in out.err
    (row,) = json.loads(out.out)["rows"]
    assert row["max_abs_diff"] < 1e-5


def _hf_job(ctx):
    """transformers' generate through ``treeattn.hf`` with ``hier`` on ranks 0, 1 of host a
    and rank 2 of host b, against transformers' single-process generate (4 new tokens)."""
    from test_hf import LOGIT_ATOL, tiny_model

    import treeattn.hf

    def generate(model, ids, **kw):
        out = model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, **kw)
        return out.sequences, torch.stack(out.logits)

    os.environ[HOST_ENV] = "a" if ctx.rank < 2 else "b"
    model = tiny_model("llama")
    ids = torch.randint(0, model.config.vocab_size, (2, 13),
                        generator=torch.Generator().manual_seed(99))
    want_ids, want_logits = generate(model, ids)
    model.set_attn_implementation("treeattn")
    cache = treeattn.hf.ShardedCache(model.config, "hier", reserve=4)
    got_ids, got_logits = generate(model, ids, cache=cache)
    assert torch.equal(got_ids, want_ids)
    err = float((got_logits - want_logits).abs().max())
    assert err < LOGIT_ATOL, err
    built = next(iter(cache.attention._executors.values()))[0].schedule
    return err, built.params


@pytest.mark.timeout(300)
def test_hf_generate_with_hier_on_two_hosts():
    pytest.importorskip("transformers")
    err, params = launch(_hf_job, 3, LaunchOptions(timeout_s=120, threads=1))
    assert params["hosts"] == 2 and params["broadcast_to"] == 1 and err < 1e-4


def test_ranks_laid_out_as_hosts_still_share_one_machines_cores():
    """Hosts of a local layout are the schedules' view; the cores stay one machine's: a
    schedule over all ranks is predicted alike on one host and on two."""
    from treeattn.sim import DecodeWorkload, simulate
    from treeattn.testbed.host.profiles import (
        backend_from_profile,
        hardware_from_profile,
        topology_from_profile,
    )

    w = DecodeWorkload("debug", 16384)
    hw, be = hardware_from_profile(PROFILE), backend_from_profile(PROFILE)
    one, two = (topology_from_profile(PROFILE, 4, hosts) for hosts in (None, [0, 0, 1, 1]))
    assert two.machine_of(3) == one.machine_of(0) == "localhost"
    for algorithm in ("oneshot", "tree"):
        a, b = (simulate(build_schedule(algorithm, t, w), t, w, hw, be).makespan_s
                for t in (one, two))
        assert a == pytest.approx(b, rel=1e-12), algorithm
