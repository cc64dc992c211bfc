"""ring-passq (Meta's CP pass-Q decode): exact attention, padding skipped, closed form exact."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from treeattn.schedule.ir import Compute
from treeattn.schedule.reference import execute, full_attention
from treeattn.sim import DecodeWorkload, build_schedule
from treeattn.sim.closed_form import ring_passq
from treeattn.sim.engine import simulate
from treeattn.sim.network import CostModel
from treeattn.sim.planning.planner import plan_workload
from treeattn.topo import Topology


def local(p: int) -> Topology:
    return Topology.from_spec(f"local:ranks={p},latency=1e-6,bandwidth=1e9")


@settings(max_examples=40, deadline=None)
@given(p=st.integers(2, 11), lengths=st.lists(st.integers(0, 6), min_size=11, max_size=11),
       seed=st.integers(0, 99), layout=st.sampled_from(["replicated", "head_sharded"]))
def test_passq_is_exact_on_every_rank(p, lengths, seed, layout):
    lengths = list(lengths[:p])
    lengths[0] += 1
    w = DecodeWorkload("debug", sum(lengths), shard_lengths=tuple(lengths), layout=layout)
    schedule = build_schedule("ring-passq", local(p), w).validate()
    assert schedule.output_layout == "replicated"  # batch shards are gathered back
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((4, 16))  # (Hq, D)
    k, v = rng.standard_normal((2, w.seq_len, 4, 16))  # (T, H, D) each
    bounds = np.cumsum([0] + lengths)
    shards = [(k[a:b], v[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
    want_o, want_lse = full_attention(q, k, v)
    for o, lse in execute(schedule, q, shards):
        np.testing.assert_allclose(o, want_o, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(lse, want_lse, rtol=1e-10, atol=1e-12)


def _attend(schedule):
    return [s for s in schedule.steps[0] if isinstance(s, Compute)
            and s.label == "attention_qblock"]


@pytest.mark.parametrize("p", [2, 3, 4, 8])
@pytest.mark.parametrize("batch", [1, 3, 9])
def test_padding_slots_are_skipped(p, batch):
    """Each rank reads each sequence's shard once over the ring: the steps of a block with
    no real query read nothing, and a block of origin s attends its real slots only."""
    topo = local(p)
    w = DecodeWorkload("llama-3.1-8b", 8192 * p, batch=batch)
    schedule = build_schedule("ring-passq", topo, w)
    per_sequence = w.kv_bytes(8192) // batch  # one sequence's shard on one rank
    for k in range(p):
        attends = [s for s in schedule.steps[k] if isinstance(s, Compute)
                   and s.label == "attention_qblock"]
        assert len(attends) == p  # one per ring step
        for j, step in enumerate(attends):
            origin = (k - j) % p
            real = len(range(origin, batch, p))
            assert step.flops == w.attention_flops(8192, real)
            assert (step.nbytes == 0) == (real == 0)
        kv_read = sum(s.flops for s in attends) // w.attention_flops(8192, 1) * per_sequence
        assert kv_read == batch * per_sequence


def test_passq_cost_grows_with_real_queries_only():
    topo = local(4)

    def makespan(batch):
        w = DecodeWorkload("llama-3.1-8b", 8192 * 4, batch=batch)
        return simulate(build_schedule("ring-passq", topo, w), topo, w).makespan_s

    assert makespan(1) < makespan(2) < makespan(4)  # no longer flat below batch = world


@pytest.mark.parametrize("spec", ["local:ranks=5,latency=1e-6,bandwidth=1e9",
                                  "dgx-h100:nodes=1", "dgx-h100:nodes=2"])
@pytest.mark.parametrize("batch", [1, 9])
def test_closed_form_matches_the_simulator_without_contention(spec, batch):
    topo = Topology.from_spec(spec)
    w = DecodeWorkload("llama-3.1-8b", 65536, batch=batch)
    schedule = build_schedule("ring-passq", topo, w)
    simulated = simulate(schedule, topo, w).makespan_s
    bound = ring_passq(CostModel(topo, w), schedule)
    assert bound <= simulated * (1 + 1e-9)
    assert bound == pytest.approx(simulated, rel=1e-6)


def test_planner_scores_passq_and_the_pass_kv_alias_remains():
    topo = Topology.from_spec("dgx-h100:nodes=1")
    w = DecodeWorkload("llama-3.1-8b", 65536)
    chosen = plan_workload(topo, w, algorithms=("ring-passq",))
    assert chosen.algorithm == "ring-passq" and chosen.latency_s > 0
    assert build_schedule("ring-passkv", topo, w).algorithm == "ring"
