"""The simulator against hand-derived and closed-form costs, and its monotonicity."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from treeattn.schedule.algorithms.tree import make_trees
from treeattn.sim import DecodeWorkload, HardwareModel, build_schedule, simulate
from treeattn.sim.closed_form import closed_form
from treeattn.sim.devices import BackendModel
from treeattn.sim.network import CostModel
from treeattn.testbed.host.model import CpuHost
from treeattn.topo import Topology

VARIANTS = [("tree", {"shape": s}) for s in
            ("chain", "flat", "binary", "kary", "binomial", "double_binary", "hierarchical")] + [
    ("butterfly", {}), ("allgather", {}), ("ring", {}),
    ("allreduce3", {"inner": "tree"}), ("allreduce3", {"inner": "ring"})]
TOPOLOGIES = ("mi300x", "dgx-h100:nodes=2", "pcie-4090:gpus=4",
              "local:ranks=6,latency=2e-6,bandwidth=5e9")


def fifo_slack(topo, w) -> float:
    """How much a FIFO link may reorder: every rank's partial serialised on the slowest link.

    Links serve messages in arrival order, so a message that arrives *earlier* can delay
    another that a parent waits for first (Graham's scheduling anomaly): a smaller input can
    be up to this much slower. Bandwidth monotonicity holds up to the same slack.
    """
    slowest = min(d["bandwidth"] for *_, d in topo.graph.edges(data=True))
    return topo.num_gpus * w.partial_bytes * w.batch / slowest


def predict(algorithm, params, topo, w, **kw):
    return simulate(build_schedule(algorithm, topo, w, **params), topo, w, **kw)


def bound(algorithm, params, topo, w, **kw):
    cm = CostModel(topo, w, **kw)
    trees = None
    if algorithm == "tree" or params.get("inner") == "tree":
        shape = params.get("shape", "binomial")
        trees = make_trees(topo, shape, message_bytes=w.partial_bytes)
    return closed_form(algorithm, cm, trees, params.get("inner", "tree"))


def test_chain_of_three_matches_hand_derivation():
    # Compute costs exactly `launch` (infinite bandwidth), messages S + wire + R.
    launch, send, recv, lat, bw = 3e-6, 2e-6, 5e-6, 1e-6, 1e9
    hw = HardwareModel("ideal", 1e30, 1e30, launch)
    backend = BackendModel("toy", send, recv)
    topo = Topology.from_spec(f"local:ranks=3,latency={2 * lat},bandwidth={bw}")
    w = DecodeWorkload("debug", 30)
    wire = 2 * lat + w.partial_bytes / bw  # two loopback hops of `lat`; cut-through pays β once
    r = predict("tree", {"shape": "chain"}, topo, w, hardware=hw, backend=backend)
    # attention, 2 × (message up + merge), 2 × message down
    want = launch + 2 * (send + wire + recv + launch) + 2 * (send + wire + recv)
    assert r.makespan_s == pytest.approx(want, rel=1e-12)
    assert r.critical_path["compute_s"] == pytest.approx(3 * launch, rel=1e-9)
    assert r.critical_path["wire_s"] == pytest.approx(4 * wire, rel=1e-9)


@settings(max_examples=40, deadline=None)
@given(variant=st.sampled_from(VARIANTS), spec=st.sampled_from(TOPOLOGIES),
       seq=st.integers(16, 200_000))
def test_simulation_never_beats_the_closed_form(variant, spec, seq):
    algorithm, params = variant
    topo = Topology.from_spec(spec)
    w = DecodeWorkload("llama-3.2-1b", seq)
    sim = predict(algorithm, params, topo, w).makespan_s
    assert sim >= bound(algorithm, params, topo, w) * (1 - 1e-12)


@settings(max_examples=30, deadline=None)
@given(variant=st.sampled_from(VARIANTS), seq=st.integers(16, 500_000),
       model=st.sampled_from(["debug", "llama-3.1-8b", "smollm2-135m"]))
def test_simulation_equals_closed_form_on_a_full_mesh(variant, seq, model):
    # MI300X: one xGMI link per GPU pair, so no two messages ever share a link except a
    # ring rank's own back-to-back sends, which the closed form queues too.
    algorithm, params = variant
    topo = Topology.from_spec("mi300x")
    w = DecodeWorkload(model, seq)
    sim = predict(algorithm, params, topo, w).makespan_s
    assert sim == pytest.approx(bound(algorithm, params, topo, w), rel=0.01)


@settings(max_examples=25, deadline=None)
@given(variant=st.sampled_from(VARIANTS), spec=st.sampled_from(TOPOLOGIES),
       a=st.integers(16, 100_000), b=st.integers(16, 100_000))
def test_latency_is_monotone_in_seq_len(variant, spec, a, b):
    algorithm, params = variant
    topo = Topology.from_spec(spec)
    lo, hi = sorted((a, b))
    t_lo = predict(algorithm, params, topo, DecodeWorkload("debug", lo)).makespan_s
    t_hi = predict(algorithm, params, topo, DecodeWorkload("debug", hi)).makespan_s
    assert t_lo <= t_hi * (1 + 1e-12) + fifo_slack(topo, DecodeWorkload("debug", hi))


@settings(max_examples=25, deadline=None)
@given(variant=st.sampled_from(VARIANTS), spec=st.sampled_from(TOPOLOGIES),
       a=st.integers(1, 64), b=st.integers(1, 64))
def test_latency_is_monotone_in_message_size(variant, spec, a, b):
    # The batch scales every message (partials and KV blocks) without changing the steps.
    algorithm, params = variant
    topo = Topology.from_spec(spec)
    lo, hi = sorted((a, b))
    t_lo = predict(algorithm, params, topo, DecodeWorkload("llama-3.1-8b", 4096, lo))
    t_hi = predict(algorithm, params, topo, DecodeWorkload("llama-3.1-8b", 4096, hi))
    slack = fifo_slack(topo, DecodeWorkload("llama-3.1-8b", 4096, hi))
    assert t_lo.makespan_s <= t_hi.makespan_s * (1 + 1e-12) + slack


@settings(max_examples=25, deadline=None)
@given(variant=st.sampled_from(VARIANTS), spec=st.sampled_from(TOPOLOGIES),
       pick=st.integers(0, 10**6), factor=st.floats(1.0, 100.0))
def test_raising_a_link_bandwidth_never_increases_latency(variant, spec, pick, factor):
    algorithm, params = variant
    w = DecodeWorkload("llama-3.1-8b", 65536)
    before = predict(algorithm, params, Topology.from_spec(spec), w).makespan_s
    faster = Topology.from_spec(spec)
    edges = sorted(faster.graph.edges)
    edge = edges[pick % len(edges)]
    faster.graph.edges[edge]["bandwidth"] *= factor
    after = predict(algorithm, params, faster, w).makespan_s
    assert after <= before * (1 + 1e-12) + fifo_slack(Topology.from_spec(spec), w)


def test_shared_cores_slow_compute_bound_ranks():
    topo = Topology.from_spec("local:ranks=4,latency=0,bandwidth=1e12")
    w = DecodeWorkload("llama-3.1-8b", 400_000)
    own = HardwareModel("cpu", 1e10, 1e12, 1e-6)
    shared = HardwareModel("cpu", 1e10, 1e12, 1e-6, host=CpuHost(cores=1))
    attn = own.compute_time(w.attention_bytes(100_000), w.attention_flops(100_000))
    t_own = predict("tree", {"shape": "binomial"}, topo, w, hardware=own).makespan_s
    t_shared = predict("tree", {"shape": "binomial"}, topo, w, hardware=shared).makespan_s
    assert t_own < 2 * attn  # the four partials run in parallel
    assert t_shared >= 4 * attn  # one core: they queue


def test_timeline_and_bytes_are_consistent():
    topo = Topology.from_spec("dgx-h100:nodes=2")
    w = DecodeWorkload("llama-3.1-8b", 8192)
    r = predict("tree", {"shape": "binomial"}, topo, w)
    steps = build_schedule("tree", topo, w, shape="binomial").steps
    assert len(r.timeline) == sum(len(s) for s in steps)
    assert max(end for *_, end in r.timeline) == r.makespan_s
    assert all(start <= end for *_, start, end in r.timeline)
    assert r.comm_bytes == sum(r.bytes_per_rank) == 2 * 15 * w.partial_bytes
    cp = r.critical_path
    assert cp["compute_s"] + cp["overhead_s"] + cp["wire_s"] == pytest.approx(r.makespan_s)
    hops = sum(len(topo.route(a, b)) for a in range(16) for b in range(16)
               if b != a and (b == r.params["parent"][a] or a == r.params["parent"][b]))
    assert sum(r.bytes_per_link.values()) == hops * w.partial_bytes
