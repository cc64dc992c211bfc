"""The collective cost model: NCCL's own formulas and its choices (fidelity against published
runs: test_sim_collectives_fidelity.py; RCCL: test_sim_collectives_rccl.py; `comm`:
test_sim_comm_cli.py).

Expected values here are worked by hand from NCCL 2.30.7's tuning tables (named in each
test), not printed by the code under test.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from treeattn.sim import SimError
from treeattn.sim.nccl import tables as T
from treeattn.sim.nccl.collectives import (
    OPS,
    GroupShape,
    candidates,
    collective_cost,
    p2p_cost,
)
from treeattn.topo import Topology


@pytest.fixture(scope="module")
def dgx2():
    return GroupShape.of(Topology.from_spec("dgx-h100:nodes=2"), range(16))


def test_dgx_h100_shape_is_what_nccl_reports(dgx):
    # 18 NVLinks x 20.6 GB/s = 370.8 GB/s; 12 search channels at 30 GB/s (NCCL's logs).
    assert (dgx.nnodes, dgx.ppn, dgx.intra, dgx.nvswitch) == (1, 8, "nvlink", True)
    assert (dgx.channels, dgx.intra_speed) == (12, 30)
    assert dgx.p2p_intra_GBps == pytest.approx(370.8)


def test_small_all_reduce_on_one_dgx_is_ring_ll(dgx):
    # ring LL: baseLat 6.6 + 2*(8-1) hops * 0.6 us = 15.0 us; tree LL: 6.8 + 2*7*0.6 = 15.2.
    best = collective_cost("all_reduce", 8, dgx)
    assert (best.algorithm, best.protocol) == ("ring", "LL")
    assert best.latency_s == pytest.approx(15.0e-6)
    tree = collective_cost("all_reduce", 8, dgx, algorithm="tree", protocol="LL")
    assert tree.latency_s == pytest.approx(15.2e-6)


def test_large_all_reduce_on_one_dgx_is_nvls(dgx):
    # NVLS: 8 channels x (40 GB/s x 0.85 x 7/8 x 2) = 476 GB/s bus; algbw = bus x 8/14.
    best = collective_cost("all_reduce", 4 << 30, dgx)
    assert best.algorithm == "nvls" and best.protocol == "Simple"
    assert best.bandwidth_Bps == pytest.approx(476e9 * 8 / 14)


def test_two_nodes_small_all_reduce_is_tree_ll(dgx2):
    # tree LL: 6.8 + 2 * ((8-1) * 0.6 + log2(2) * 5.0) = 25.2 us.
    best = collective_cost("all_reduce", 16, dgx2)
    assert (best.algorithm, best.protocol) == ("tree", "LL")
    assert best.latency_s == pytest.approx(25.2e-6)


def test_ring_only_ops_and_simple_only_algorithms(dgx, dgx2):
    assert {c.algorithm for c in candidates("broadcast", 1024, dgx)} == {"ring"}
    assert {c.algorithm for c in candidates("all_gather", 1024, dgx)} == {"ring", "nvls"}
    for cost in candidates("all_reduce", 1 << 20, dgx2):
        if cost.algorithm in ("nvls", "nvls_tree"):
            assert cost.protocol == "Simple"
    assert "pat" not in {c.algorithm for c in candidates("all_gather", 1024, dgx2)}


def test_pcie_box_has_no_ll128_and_no_nvls():
    shape = GroupShape.of(Topology.from_spec("pcie-4090:gpus=4"), range(4))
    assert shape.intra == "pci"
    kinds = {(c.algorithm, c.protocol) for c in candidates("all_reduce", 4096, shape)}
    assert not any(p == "LL128" for _, p in kinds) and ("nvls", "Simple") not in kinds


def test_p2p_is_not_priced_as_a_collective(dgx):
    # one ring hop, LL: 6.6 + 0.6 = 7.2 us (not the 15 us of an 8-rank all-reduce).
    assert p2p_cost(8, dgx).latency_s == pytest.approx(7.2e-6)
    assert collective_cost("sendrecv", 8, dgx).time_s < collective_cost("all_reduce", 8,
                                                                         dgx).time_s


@pytest.mark.parametrize("op,size", [("gather", 8), ("all_reduce", 0), ("all_reduce", -4)])
def test_bad_input_is_a_sim_error(dgx, op, size):
    with pytest.raises(SimError):
        collective_cost(op, size, dgx)


# Log-uniform sizes, 1 B to 16 GiB: the bugs live at the few-channel sizes (kilobytes to a
# megabyte), which a uniform draw up to 16 GiB almost never reaches.
_SIZES = st.floats(0, 34).map(lambda e: max(1, round(2 ** e)))


@settings(max_examples=80, deadline=None)
@given(op=st.sampled_from(OPS), a=_SIZES, b=_SIZES,
       spec=st.sampled_from(["dgx-h100", "dgx-b200:nodes=2", "mi300x", "pcie-4090:gpus=8",
                             "dgx-h100:nodes=4/rail0", "dgx-b200:nodes=4/rail0",
                             "dgx-a100:nodes=4/rail0"]))
# a message just below the size where its channels fill and one just above: the time must
# not fall there, llMaxBws being one cap for the whole GPU, not shared among the channels
@example(op="all_reduce", a=503_504, b=513_568, spec="dgx-b200:nodes=2")
@example(op="broadcast", a=381_584, b=389_216, spec="dgx-h100:nodes=2")
@example(op="all_gather", a=987_216, b=1_006_960, spec="dgx-a100:nodes=2")
# an all-to-all peer's channel count as an integer: a second channel from 64 KiB a peer
@example(op="all_to_all", a=524_288, b=526_594, spec="dgx-h100")
def test_time_is_monotone_in_size_among_the_same_variants(op, a, b, spec):
    """Every priced variant's time, and the pick's, never falls as the message grows.
    Not drawn: groups where the pick does (from 64 KiB to a few hundred on 2-4 full DGX
    nodes, and a 72-GPU broadcast), below; their falsifying examples are pinned here."""
    topo = _topology(spec.split("/")[0])
    # ".../rail0": one GPU per node (a context-parallel group under TP8), all on the network
    ranks = range(0, topo.num_gpus, 8) if spec.endswith("/rail0") else range(topo.num_gpus)
    shape = GroupShape.of(topo, ranks)
    small, large = sorted((a, b))
    offered = {(c.algorithm, c.protocol): c.time_s for c in candidates(op, small, shape)}
    for c in candidates(op, large, shape):  # every priced variant alone
        if (c.algorithm, c.protocol) in offered:
            assert 0 < offered[(c.algorithm, c.protocol)] <= c.time_s * (1 + 1e-9)
        assert math.isfinite(c.time_s)
    # the pick, on NCCL's own latency tables (a generation priced off them, gen_lat_scale,
    # can see a larger message's pick cost less at a switch: test below)
    tuned = replace(shape, gen_lat_scale=1.0)
    if set(offered) == {(c.algorithm, c.protocol) for c in candidates(op, large, shape)}:
        t_small = collective_cost(op, small, tuned).time_s
        assert t_small <= collective_cost(op, large, tuned).time_s * (1 + 1e-9)


@pytest.mark.parametrize("spec, op, below, above", [
    ("dgx-a100:nodes=2", "broadcast", 65_536, 292_922),
    ("dgx-h100:nodes=4", "broadcast", 131_072, 189_940),
    ("gb200-nvl72", "broadcast", 295_541, 2_784_240)])
def test_a_ring_ll_ranked_on_every_channel_and_run_on_few_can_cost_more(spec, op, below,
                                                                       above):
    """NCCL ranks by its estimate on every channel, then runs a ring message on the channels
    its size fills (enqueue.cc ``topoGetAlgoInfo``; the ring's LL threshold is 8 B × ranks a
    thread, so 64 KiB to 288 KiB a channel on 16 to 72 ranks). Where ring LL wins the
    ranking on few channels, a larger message that another variant wins finishes sooner.
    The model keeps that, so these groups are not drawn above."""
    topo = _topology(spec)
    shape = GroupShape.of(topo, range(topo.num_gpus))
    small, large = (collective_cost(op, n, shape) for n in (below, above))
    assert (small.algorithm, small.protocol) == ("ring", "LL")
    assert small.tuner_s < small.time_s  # ranked on every channel, run on fewer
    assert large.protocol != "LL" and large.time_s < small.time_s


def test_a_pick_ranked_on_nccls_own_latencies_can_cost_less_above_a_switch():
    """NCCL ranks on its latency tables as they are, with its tree correction as a step; the
    model prices the pick with the generation's factor (A100: 1980/1410 on the node-local
    latencies) and the correction on a line. On 2 DGX A100 nodes, just below 4 MiB NCCL's
    ranking takes ring LL128 (the tree's LL128 correction still 0.6 there), at 4 MiB tree
    LL128 (0.8): the step alone makes the larger message's pick faster (0.87 of the smaller
    one's on NCCL's own latencies), the factor deepens it (0.82). Each variant alone still
    grows with the size."""
    from treeattn.sim.nccl.collectives import tree_correction

    shape = GroupShape.of(_topology("dgx-a100:nodes=2"), range(16))
    below, at = 4_175_512, 4 << 20
    small, large = (collective_cost("all_reduce", n, shape) for n in (below, at))
    assert (small.algorithm, small.protocol) == ("ring", "LL128")
    assert (large.algorithm, large.protocol) == ("tree", "LL128")
    assert tree_correction(1, below, stepped=True) == 0.6
    assert tree_correction(1, at, stepped=True) == 0.8
    assert large.time_s < small.time_s
    tree = {n: collective_cost("all_reduce", n, shape, algorithm="tree", protocol="LL128")
            for n in (below, at)}
    assert tree[below].time_s <= tree[at].time_s


def test_tree_correction_is_nccls_at_powers_of_two_and_a_line_between():
    """tuning.cc treeCorrectionFactor, LL128: 0.6 at 2 MiB (entry 15), 0.8 at 4 MiB (16);
    3 MiB lies log2(1.5) = 0.585 of the way: 0.6 + 0.2 × 0.585 = 0.717. Below 64 B and from
    512 MiB NCCL has no entry."""
    from treeattn.sim.nccl.collectives import tree_correction

    assert (tree_correction(1, 2 << 20), tree_correction(1, 4 << 20)) == (0.6, 0.8)
    assert tree_correction(1, 3 << 20) == pytest.approx(0.6 + 0.2 * math.log2(1.5))
    assert tree_correction(0, 32) == tree_correction(2, 1 << 29) == 1.0
    assert tree_correction(2, 64) == 0.9  # Simple's first entry


def test_tree_is_ranked_by_nccls_stepped_correction():
    """2 DGX H100 nodes, all-reduce of 220,436 B: log2i(220436 / 64) = 11, so NCCL's tuner
    takes LL's entry 11, 0.5. Tree LL on hand: latency baseLat 6.8 + 2 × (7 NVLink hops ×
    0.6 + 1 network hop × 5.0) = 25.2 µs; bus min(0.92 × 12 × 30, 12 × 41.4) = 331.2 GB/s,
    LL: min(331.2 / 3.8, llMaxBws 39.0) = 39.0, × 0.5 (tree) × 0.5 (correction) = 9.75 GB/s
    of algorithm bandwidth. NCCL picks that tree; the price keeps the line between entries
    11 and 12 (0.5 to 0.4), so it is slower than the estimate."""
    shape = GroupShape.of(_topology("dgx-h100:nodes=2"), range(16))
    best = collective_cost("all_reduce", 220436, shape)
    assert (best.algorithm, best.protocol) == ("tree", "LL")
    assert best.choice_s * 1e6 == pytest.approx(25.2 + 220436 / (1000 * 9.75))
    assert best.time_s > best.choice_s


_TOPOLOGIES: dict[str, Topology] = {}


def _topology(spec: str) -> Topology:
    if spec not in _TOPOLOGIES:
        _TOPOLOGIES[spec] = Topology.from_spec(spec)
    return _TOPOLOGIES[spec]


@pytest.mark.parametrize("spec, links, channels, speed", [
    # NVLink total = links × NCCL's per-link figure (topo.h); the first search speed that
    # fits, as many channels as fit at it, doubled at half the speed (ncclTopoDupChannels)
    ("dgx-h100", 18, 12, 30.0),  # 18 × 20.6 = 370.8: 6 × 60 -> 12 × 30 (NCCL's logs)
    ("dgx-b200", 18, 16, 45.0),  # 18 × 40.1 = 721.8: sm100 speeds, 8 × 90 -> 16 × 45
    ("dgx-a100", 12, 12, 20.0),  # 12 × 20 = 240: 6 × 40 -> 12 × 20
])
def test_a_2_gpu_ring_has_the_channels_of_nccls_search(spec, links, channels, speed):
    topo = Topology.from_spec(spec)
    for n in (2, 4, 8):  # behind an NVSwitch every GPU's ring sees the same links
        shape = GroupShape.of(topo, range(n))
        assert (shape.channels, shape.intra_speed) == (channels, speed)
    big = 1 << 30
    two = GroupShape.of(topo, range(2))
    ring = collective_cost("all_reduce", big, two, algorithm="ring", protocol="Simple")
    # ring Simple bus bandwidth = channels × speed; a 2-rank all-reduce's busbw = algbw
    assert ring.bandwidth_Bps == pytest.approx(channels * speed * 1e9 * 2 / (2 * 1))


# NCCL 2.29.2's own tuning table (NCCL_DEBUG=TUNING) on 2, 4 and 6 H100s of one HGX node,
# ring columns: (latency µs, algorithm GB/s) for LL, LL128, Simple, as the library printed
# them (github.com/waynehacking8/nccl-collectives-bench @ ec97f062,
# results/scaling_attributed/g{2,4,6}_Ring.log; 24 coll channels in each).
NCCL_LOGGED_RING = {
    2: {"all_gather": ((7.2, 282.0), (15.9, 662.4), (11.8, 720.0)),
        "all_reduce": ((7.8, 141.0), (17.8, 331.2), (15.2, 360.0))},
    4: {"all_gather": ((8.4, 188.0), (19.7, 441.6), (18.6, 480.0)),
        "all_reduce": ((10.2, 94.0), (25.4, 220.8), (28.8, 240.0))},
    6: {"all_gather": ((9.6, 169.2), (23.5, 397.4), (25.4, 432.0)),
        "all_reduce": ((12.6, 84.6), (33.0, 198.7), (42.4, 216.0))},
}


@pytest.mark.parametrize("n", sorted(NCCL_LOGGED_RING))
def test_small_groups_are_priced_as_nccls_logged_tuning_table(n):
    """The model's ring on n GPUs of a DGX H100 is what NCCL's tuner printed for that group:
    the same channels and bus bandwidth whatever n (the tuner has no group-size term), the
    latency growing by one hop per ring step, reduce-scatter priced as all-gather."""
    shape = GroupShape.of(Topology.from_spec("dgx-h100"), range(n))
    assert T.NCCL_COMPUTE_CHANNELS_PER_SEARCH * shape.channels == 24
    rows = dict(NCCL_LOGGED_RING[n], reduce_scatter=NCCL_LOGGED_RING[n]["all_gather"])
    for op, logged in rows.items():
        for protocol, (latency_us, algbw) in zip(T.PROTOCOLS, logged, strict=True):
            cost = collective_cost(op, 1 << 30, shape, algorithm="ring", protocol=protocol)
            assert cost.latency_s * 1e6 == pytest.approx(latency_us, abs=0.05), (op, protocol)
            assert cost.bandwidth_Bps / 1e9 == pytest.approx(algbw, abs=0.05), (op, protocol)


def test_nvls_runs_one_channel_per_gpu_so_small_groups_take_the_ring():
    topo = Topology.from_spec("dgx-h100")
    busbw = {}
    for n in (2, 4, 8):
        shape = GroupShape.of(topo, range(n))
        nvls = collective_cost("all_reduce", 1 << 30, shape, algorithm="nvls")
        busbw[n] = nvls.bandwidth_Bps / 1e9 * 2 * (n - 1) / n
    # one channel per GPU; a GPU carries (n + 1) × speed on its 370.8 GB/s: n=8 -> 40, else
    # 60 (the largest Hopper speed); busBw = n × min(speed·0.85·(n−1)/n·2, bwInter)
    assert busbw[8] == pytest.approx(8 * min(40 * 0.85 * 7 / 8 * 2, 60))  # 476
    assert busbw[4] == pytest.approx(4 * min(60 * 0.85 * 3 / 4 * 2, 60))  # 240
    assert busbw[2] == pytest.approx(2 * min(60 * 0.85 * 1 / 2 * 2, 60))  # 102
    # the ring's 12 × 30 = 360 beats NVLS on 2 and 4 GPUs, not on 8
    for n, algorithm in ((2, "ring"), (4, "ring"), (8, "nvls")):
        shape = GroupShape.of(topo, range(n))
        assert collective_cost("all_reduce", 1 << 30, shape).algorithm == algorithm


@pytest.mark.parametrize("dtype, reduction, allowed", [
    ("bfloat16", "sum", True), ("float32", "sum", True), ("bfloat16", "max", True),
    ("float32", "max", False), ("float8_e4m3", "sum", False), ("int8", "sum", False),
])
def test_nvls_runs_only_the_dtypes_and_ops_nccl_builds_it_for(dgx, dtype, reduction, allowed):
    """``ncclNvlsSupported`` (device.h): fp16/bf16/int32/int64 sum and min/max, fp32/fp64
    sum only, no 8-bit type."""
    algos = {c.algorithm for c in candidates("all_reduce", 1 << 30, dgx, dtype, reduction)}
    assert ("nvls" in algos) is allowed
    if not allowed:
        assert collective_cost("all_reduce", 1 << 30, dgx, dtype=dtype,
                               reduction=reduction).algorithm != "nvls"
    # an all-gather moves bytes: NVLS is offered whatever the dtype
    assert "nvls" in {c.algorithm for c in candidates("all_gather", 1 << 30, dgx, dtype)}


def test_fp8_reductions_need_hopper_and_avoid_deep_rings(dgx2):
    a100 = GroupShape.of(Topology.from_spec("dgx-a100"), range(8))
    with pytest.raises(SimError, match="Hopper"):
        collective_cost("all_reduce", 1 << 20, a100, dtype="float8_e4m3")
    assert collective_cost("all_gather", 1 << 20, a100, dtype="float8_e4m3").time_s > 0
    with pytest.raises(SimError, match="no dtype"):
        collective_cost("all_reduce", 1 << 20, a100, dtype="complex64")
    # enqueue.cc: an fp8 ring of more than 8 ranks is ranked × 1024 (priced as it runs);
    # bf16, and fp8 on 8 ranks, keep the ring's own estimate
    def ring(shape, dtype):
        return next(c for c in candidates("all_reduce", 1 << 30, shape, dtype)
                    if c.algorithm == "ring" and c.protocol == "Simple")

    deep = ring(dgx2, "float8_e4m3")
    assert deep.choice_s == pytest.approx(1024 * deep.time_s)
    assert ring(dgx2, "bfloat16").choice_s == ring(dgx2, "bfloat16").time_s
    one_node = GroupShape.of(Topology.from_spec("dgx-h100"), range(8))
    assert ring(one_node, "float8_e4m3").choice_s == ring(one_node, "float8_e4m3").time_s


def test_all_to_all_latency_grows_with_the_peers():
    """Our analogy (NCCL has no all-to-all entry): a ring all-gather's latency over the same
    ranks, ring LL base 6.6 µs + (n − 1) NVLink LL hops of 0.6 µs."""
    topo = Topology.from_spec("dgx-h100")
    latency = {n: collective_cost("all_to_all", 8 * n, GroupShape.of(topo, range(n))).latency_s
               for n in (2, 8)}
    assert latency[2] * 1e6 == pytest.approx(6.6 + 1 * 0.6)  # one send/recv
    assert latency[8] * 1e6 == pytest.approx(6.6 + 7 * 0.6)


def test_all_to_all_gives_one_peer_its_channels_not_the_whole_nvlink():
    """2 H100s, 256 MiB: 128 MiB to the peer over p2p channels (paths.cc, enqueue.cc): 24
    compute channels -> 32 p2p channels, 2 × 18 NVLinks = 36 -> 32 a peer, halved to 16 so 2
    ranks fit (nChannelsMin); each at the ring's 30 GB/s search speed over 2 compute
    channels: 240 GB/s, not the GPU's 370.8. A part of 128 MiB / 16 = 8 MiB is under
    addP2pToPlan's maximum (the 512 KiB NVLink chunk × 32 = 16 MiB), so no doubling. At 1 GiB
    the part is 32 MiB: NCCL doubles to 32 channels (nChannelsMax), 480 GB/s, and the NVLink
    binds."""
    shape = GroupShape.of(Topology.from_spec("dgx-h100"), range(2))
    cost = collective_cost("all_to_all", 1 << 28, shape)
    assert cost.time_s - cost.latency_s == pytest.approx((1 << 27) / (16 * 15e9))
    cost = collective_cost("all_to_all", 1 << 30, shape)
    assert cost.time_s - cost.latency_s == pytest.approx((1 << 29) / 370.8e9)
    # 8 ranks: 4 channels a peer (4 × 8 = 32), 7 peers × 60 GB/s > 370.8: the NVLink binds
    eight = GroupShape.of(Topology.from_spec("dgx-h100"), range(8))
    cost = collective_cost("all_to_all", 1 << 30, eight)
    assert cost.time_s - cost.latency_s == pytest.approx(7 * (1 << 27) / 370.8e9)


def test_all_to_all_doubles_a_peers_channels_past_the_net_chunk():
    """2 DGX H100 nodes, 16 ranks: 4 channels a peer (a 50 GB/s rail / 14 GB/s, paths.cc),
    halved to nChannelsMin = 2 so 16 ranks fit 32 p2p channels. A node-local peer's part
    is at least 64 KiB (the 128 KiB network chunk / 2) and at most 128 KiB: 512 KiB to a
    peer starts on 2 channels, 256 KiB parts, and NCCL doubles to 4 (nChannelsMax); each
    channel moves 12 × 30 / 24 = 15 GB/s of NVLink."""
    from treeattn.sim.nccl.sendrecv import _peer_channels

    shape = GroupShape.of(Topology.from_spec("dgx-h100:nodes=2"), range(16))
    assert (shape.p2p_channels, shape.p2p_peer_channels) == (32, 4)
    assert _peer_channels(128 * 1024, shape) == 2.0
    assert _peer_channels(512 * 1024, shape) == 4.0
    assert _peer_channels(4 << 20, shape) == 4.0  # nChannelsMax caps it


def test_p2p_channels_per_peer_shrink_with_the_rank_groups_across_nodes():
    """paths.cc: on several nodes the per-peer channels halve while they times
    ceil(ranks / 8) exceed the p2p channels: 4 a peer on a DGX H100 rail up to 64 ranks
    (4 × 8 = 32), 2 at 128 ranks (2 × 16), 1 at 256 (1 × 32)."""
    from treeattn.sim.nccl.group_shape import p2p_channel_counts

    counts = {n: p2p_channel_counts(24, 8, n // 8, 18, "nvlink", 50.0, nranks=n)[1]
              for n in (16, 64, 128, 256)}
    assert counts == {16: 4, 64: 4, 128: 2, 256: 1}
