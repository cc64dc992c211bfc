"""Planner, workloads, models, memory and communication-volume conventions."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from treeattn.sim import (
    DecodeWorkload,
    ModelConfig,
    SimError,
    build_schedule,
    plan_workload,
    simulate,
)
from treeattn.sim.memory import peak_memory
from treeattn.topo import Topology


def local(p: int) -> Topology:
    return Topology.from_spec(f"local:ranks={p},latency=1e-6,bandwidth=1e9")


def test_model_registry_matches_published_configs():
    cases = {"smollm2-135m": (30, 9, 3, 64, 576), "llama-3.2-1b": (16, 32, 8, 64, 2048),
             "llama-3.1-8b": (32, 32, 8, 128, 4096), "llama-3.1-70b": (80, 64, 8, 128, 8192)}
    for name, shape in cases.items():
        m = ModelConfig.from_name(name)
        assert (m.n_layers, m.n_heads, m.n_kv_heads, m.head_dim, m.dim) == shape
        assert m.dtype_bytes == 2
    assert ModelConfig.debug().n_heads % ModelConfig.debug().n_kv_heads == 0
    with pytest.raises(SimError, match="unknown model"):
        ModelConfig.from_name("gpt-5")


def test_workload_split_rule_and_errors():
    assert DecodeWorkload("debug", 11).shards(4) == [3, 3, 3, 2]
    with pytest.raises(SimError, match="positive"):
        DecodeWorkload("debug", 0)
    with pytest.raises(SimError, match="sum to seq_len"):
        DecodeWorkload("debug", 5, shard_lengths=(1, 1))
    with pytest.raises(SimError, match="no reduction"):
        DecodeWorkload("debug", 5).shards(1)


@settings(max_examples=20, deadline=None)
@given(p=st.integers(2, 12), seq=st.integers(64, 10**6))
def test_communication_volume_conventions(p, seq):
    topo, w = local(p), DecodeWorkload("llama-3.1-8b", seq)
    tree = simulate(build_schedule("tree", topo, w, shape="binomial"), topo, w)
    ring = simulate(build_schedule("ring", topo, w), topo, w)
    # tree: one partial up and one down per edge, O(p·d), independent of seq_len
    assert tree.comm_bytes == 2 * (p - 1) * 4 * 32 * (128 + 1)
    # ring: every rank forwards p-1 KV blocks: (p-1) × the whole layer's K and V
    assert ring.comm_bytes == (p - 1) * 2 * seq * 8 * 128 * 2
    assert min(ring.peak_memory_bytes) > max(tree.peak_memory_bytes)


def test_ring_and_tree_peak_memory_by_hand():
    p, seq = 4, 4000
    w = DecodeWorkload("llama-3.1-8b", seq)
    shard = 2 * 1000 * 8 * 128 * 2
    pb = 4 * 32 * 129
    ring = peak_memory(build_schedule("ring", local(p), w), w)
    # own shard + the foreign block attended + the one received ahead + partial + block partial
    assert ring == [shard + 2 * shard + 2 * pb] * p
    chain = peak_memory(build_schedule("tree", local(p), w, shape="chain"), w)
    # a middle rank: shard + partial + the child's partial kept for its merge + one posted recv
    assert chain[1] == shard + pb + pb + pb


def test_plan_picks_the_fastest_simulated_candidate():
    topo, w = Topology.from_spec("pcie-4090:gpus=4"), DecodeWorkload("llama-3.1-8b", 32768)
    chosen = plan_workload(topo, w)
    exhaustive = plan_workload(topo, w, prune=False)
    assert chosen.latency_s == pytest.approx(exhaustive.latency_s, rel=1e-12)
    simulated = [c for c in exhaustive.candidates if c.method == "simulated"]
    assert len(simulated) >= 10
    assert chosen.latency_s <= min(c.latency_s for c in simulated) * (1 + 1e-12)
    # every candidate not simulated has a closed form no better than the winner
    assert all(c.bound_s >= chosen.latency_s * (1 - 1e-12) for c in chosen.candidates
               if c.method == "closed_form")


def test_plan_beats_ring_at_long_context_and_explains_itself():
    topo = Topology.from_spec("dgx-h100:nodes=2")
    chosen = plan_workload(topo, DecodeWorkload("llama-3.1-70b", 1 << 20))
    assert chosen.algorithm != "ring"
    assert chosen.best("ring").latency_s > 10 * chosen.latency_s
    d = chosen.to_json()
    assert {"algorithm", "tree", "latency_s", "candidates"} <= set(d)
    assert all({"name", "latency_s"} <= set(c) for c in d["candidates"])
    text = chosen.explain()
    assert chosen.name in text
    # sentences, each closed: the layout one once ran into the ring one ("back Ring ...")
    assert "back Ring" not in text and ".." not in text and text.endswith(".")
    assert chosen.schedule.validate().world == 16
    assert chosen.token_latency_s() == pytest.approx(80 * chosen.latency_s)


def test_plan_restricted_to_trees_returns_a_tree():
    topo = Topology.from_spec("dgx-h100:nodes=2")
    chosen = plan_workload(topo, DecodeWorkload("llama-3.1-8b", 65536), algorithms=("tree",))
    assert chosen.tree is not None
    tree = chosen.tree.to_dict()
    assert tree["parent"][tree["root"]] == -1
    assert sum(x == -1 for x in tree["parent"]) == 1


def test_plan_on_a_large_cluster_prunes():
    topo = Topology.from_spec("dgx-h100:nodes=64")
    chosen = plan_workload(topo, DecodeWorkload("llama-3.1-8b", 1 << 20))
    simulated = sum(c.method == "simulated" for c in chosen.candidates)
    assert 1 <= simulated <= 3
    assert math.isfinite(chosen.latency_s)


def test_tensor_parallel_plans_one_context_parallel_group():
    from treeattn.sim.parallel import cp_group, group_workload

    cluster = Topology.from_spec("dgx-h100:nodes=4")
    chosen = plan_workload(cluster, DecodeWorkload("llama-3.1-8b", 65536, tp=8))
    assert chosen.tp == 8 and chosen.cluster is cluster
    assert chosen.topology.num_gpus == 4  # GPU 0 of every node
    assert len(set(chosen.topology.hosts)) == 4
    assert (chosen.workload.model.n_heads, chosen.workload.model.n_kv_heads) == (4, 1)
    assert cp_group(32, 8, 1) == [1, 9, 17, 25]
    # 8 KV heads over TP 4: 2 each; over TP 16 (more than the KV heads): one, replicated
    assert group_workload(DecodeWorkload("llama-3.1-8b", 4096, tp=4)).model.n_kv_heads == 2
    assert group_workload(DecodeWorkload("llama-3.1-8b", 4096, tp=16)).model.n_kv_heads == 1


@pytest.mark.parametrize("tp, match", [(3, "divide"), (32, "one GPU per")])
def test_tensor_parallel_sizes_that_do_not_fit_are_refused(tp, match):
    with pytest.raises(SimError, match=match):
        plan_workload(Topology.from_spec("dgx-h100:nodes=4"),
                      DecodeWorkload("llama-3.1-8b", 4096, tp=tp))


def test_batch_scales_message_sizes_but_not_the_schedule_shape():
    topo = Topology.from_spec("dgx-h100:nodes=2")
    small, big = (plan_workload(topo, DecodeWorkload("llama-3.1-8b", 32768, batch=b),
                                algorithms=("helix",))
                  for b in (1, 64))
    assert big.prediction.comm_bytes == 64 * small.prediction.comm_bytes
    assert big.latency_s > small.latency_s


def test_plans_that_do_not_fit_in_gpu_memory_are_refused():
    from treeattn.sim import HardwareModel

    topo = Topology.from_spec("dgx-h100:nodes=2")
    w = DecodeWorkload("llama-3.1-8b", 1 << 20)  # 128 MiB of KV per layer per GPU (16 GPUs)
    shard = w.kv_bytes(max(w.shards(16)))
    tiny = HardwareModel("tiny", 3e12, 1e15, 4e-6, memory_bytes=shard / 2)
    with pytest.raises(SimError, match="does not fit: each GPU needs"):
        plan_workload(topo, w, hardware=tiny)
    # room for the shard and partials, not for ring's two extra KV blocks
    snug = HardwareModel("snug", 3e12, 1e15, 4e-6, memory_bytes=1.5 * shard)
    assert plan_workload(topo, w, hardware=snug).algorithm != "ring"
    with pytest.raises(SimError, match="no plan fits"):
        plan_workload(topo, w, hardware=snug, algorithms=("ring",))


@pytest.mark.parametrize("max_simulated", [1, 3, 8])
def test_a_lower_bound_never_beats_a_simulation(max_simulated):
    # Cold host steps make the p2p schedules cost far more than their closed forms, and at
    # world 2 every tree shape has the same bound: once the budget is spent on some of them,
    # the others must not win on their bound alone.
    from treeattn.sim import HardwareModel
    from treeattn.testbed.host.cold import ColdSteps
    from treeattn.testbed.host.model import CpuHost

    cold = ColdSteps(merge_s=2e-4, message_s=2e-4, world=2,
                     collective_s=(("all_gather", 2e-4),))
    hw = HardwareModel("cpu", 1e10, 1e12, 1e-5, host=CpuHost(cores=2, cold=cold))
    w = DecodeWorkload("smollm2-135m", 32768)
    chosen = plan_workload(local(2), w, hardware=hw, max_simulated=max_simulated)
    assert chosen.winner.result.method == "simulated"
    simulated = [c for c in chosen.candidates if c.result and c.result.method == "simulated"]
    assert chosen.latency_s == min(c.latency_s for c in simulated)
