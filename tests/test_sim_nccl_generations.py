"""Small messages as NCCL runs them: latencies by GPU generation (nccl_tables: NCCL-gen)
and the channels a small message runs on (enqueue.cc).

NCCL's ``baseLat``/``hwLat`` describe Hopper; the node-local part is scaled per generation:
by the SM clock ratio on Volta and Ampere (1980 MHz H100 SXM5 over 1410 MHz A100 SXM4,
1530 MHz V100 SXM2, 1480 MHz P100 SXM2); on Blackwell by 3.0 / 2.3, the ratio of 8 B
symmetric all-reduce floors on 8 B200s and 8 H200s (NVIDIA/nccl issue #1940). Every
expected value below is
worked by hand from those figures and NCCL 2.30.7's tables.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from treeattn.sim.nccl.collectives import OPS, GroupShape, candidates, collective_cost, p2p_cost
from treeattn.topo import Topology

AMPERE = 1980 / 1410
BLACKWELL = 3.0 / 2.3  # issue #1940: ~3 µs on 8 B200s over ~2.3 µs on 8 H200s
RING_LL_BASE, NVLINK_LL_HOP = 6.6, 0.6  # tuning.cc baseLat[ring][LL], hwLat[NVLink][ring][LL]


@cache
def shape(spec: str, n: int) -> GroupShape:
    return GroupShape.of(Topology.from_spec(spec), range(n))


def test_a100_8_gpu_ring_ll_all_reduce_at_8_bytes_by_hand():
    # 2 (n - 1) = 14 NVLink LL hops after the base, × the clock ratio; the wire: 8 B on one
    # of the 24 channels (2 × 12 search channels at 20 GB/s), half a search channel: 10
    # GB/s, halved for LL = 5 GB/s of bus (llMaxBws[ampere] = 87.7 caps the whole GPU, not
    # a channel), times n / (2 (n - 1)) = 8 / 14
    cost = collective_cost("all_reduce", 8, shape("dgx-a100", 8))
    latency = (RING_LL_BASE + 14 * NVLINK_LL_HOP) * AMPERE
    assert (cost.algorithm, cost.protocol) == ("ring", "LL")
    assert cost.latency_s * 1e6 == pytest.approx(latency, rel=1e-9)
    wire = 8 / (1000 * 5.0 * 8 / 14)
    assert cost.time_s * 1e6 == pytest.approx(latency + wire, rel=1e-9)
    assert cost.time_s * 1e6 == pytest.approx(21.067, abs=1e-3)


def test_a100_per_ring_step_grows_by_the_clock_ratio():
    # 2 GPUs: 2 hops; 8 GPUs: 14 hops. The 12 extra hops cost 12 × 0.6 × 1980/1410 µs
    two = collective_cost("all_reduce", 8, shape("dgx-a100", 2), algorithm="ring")
    eight = collective_cost("all_reduce", 8, shape("dgx-a100", 8), algorithm="ring")
    assert (eight.latency_s - two.latency_s) * 1e6 == pytest.approx(12 * 0.6 * AMPERE)
    assert two.latency_s * 1e6 == pytest.approx((6.6 + 2 * 0.6) * AMPERE)


def test_hopper_keeps_nccls_figures():
    for spec in ("dgx-h100", "hgx-h200"):
        cost = collective_cost("all_reduce", 8, shape(spec, 8))
        assert cost.latency_s * 1e6 == pytest.approx(6.6 + 14 * 0.6)


def test_blackwell_scales_nccls_figures_by_the_measured_floor_ratio():
    # 4 GB200s: (ring LL base 6.6 + 2 × 3 NVLink hops × 0.6) × 3.0 / 2.3 = 13.3 µs, under
    # the Azure -g 4 run's 16 µs floor (one host thread launching 4 kernels: an upper bound)
    for spec in ("gb200-nvl72", "dgx-b200"):
        cost = collective_cost("all_reduce", 8, shape(spec, 4))
        assert (cost.algorithm, cost.protocol) == ("ring", "LL")
        assert cost.latency_s * 1e6 == pytest.approx(10.2 * BLACKWELL)
        assert cost.latency_s * 1e6 == pytest.approx(13.304, abs=1e-3)


@pytest.mark.parametrize("spec", ["dgx-b200", "gb200-nvl72"])
@pytest.mark.parametrize(("n", "ring", "tree"), [(2, 7.8, 8.0), (4, 10.2, 10.4),
                                                 (8, 15.0, 15.2)])
def test_blackwell_8_byte_all_reduce_is_nccls_ring_ll_by_hand(spec, n, ring, tree):
    """NCCL 2.30.7 tuning.cc on one NVLink domain: ring LL = baseLat 6.6 + 2 (n - 1) hops ×
    0.6; tree LL = 6.8 + 2 (n - 1) × 0.6 (one node: no network hop); NVLS = its hop latency
    alone, 25 µs. No latency term of NCCL's has an sm100 index, so the ring wins by 0.2 µs
    at every group size, as on Hopper; the model prices all three × 3.0 / 2.3, so each
    added rank costs 2 × 0.6 × 1.30 = 1.57 µs."""
    group = shape(spec, n)
    cost = collective_cost("all_reduce", 8, group)
    assert (cost.algorithm, cost.protocol) == ("ring", "LL")
    assert cost.latency_s * 1e6 == pytest.approx(ring * BLACKWELL)
    assert ring == pytest.approx(RING_LL_BASE + 2 * (n - 1) * NVLINK_LL_HOP)
    by_algorithm = {a: collective_cost("all_reduce", 8, group, algorithm=a).latency_s * 1e6
                    for a in ("tree", "nvls")}
    assert by_algorithm == pytest.approx({"tree": tree * BLACKWELL, "nvls": 25.0 * BLACKWELL})
    assert tree == pytest.approx(6.8 + 2 * (n - 1) * NVLINK_LL_HOP)


def test_blackwell_per_ring_step_grows_by_the_floor_ratio():
    # 2 B200s: 2 hops; 8: 14. The 12 extra hops cost 12 × 0.6 × 3.0 / 2.3 = 9.39 µs (7.2
    # on a DGX H100)
    two = collective_cost("all_reduce", 8, shape("dgx-b200", 2), algorithm="ring")
    eight = collective_cost("all_reduce", 8, shape("dgx-b200", 8), algorithm="ring")
    assert (eight.latency_s - two.latency_s) * 1e6 == pytest.approx(9.391, abs=1e-3)
    h100 = [collective_cost("all_reduce", 8, shape("dgx-h100", n), algorithm="ring")
            for n in (2, 8)]
    assert (h100[1].latency_s - h100[0].latency_s) * 1e6 == pytest.approx(7.2)


def test_p100_runs_voltas_rows_at_its_own_clock():
    # 2 GPUs on PCIe: ring LL base 6.6 + 2 PCIe LL hops × 1.0, × 1980 / 1480 (P100 SXM2
    # boost) for the P100, × 1980 / 1530 for the V100 on the same board
    sample = Path(__file__).parent / "fixtures" / "nvsmi-4xrtx3090-nv4-pairs-aikitoria-pr18.txt"
    for gpu, clock in (("P100", 1480), ("V100", 1530)):
        group = GroupShape.of(Topology.load(sample, gpu=gpu), range(2))
        assert (group.arch, group.intra) == ("volta", "pci")
        cost = collective_cost("all_reduce", 8, group, algorithm="ring", protocol="LL")
        assert cost.latency_s * 1e6 == pytest.approx((6.6 + 2 * 1.0) * 1980 / clock)


def test_network_hop_keeps_nccls_figure_off_hopper():
    # across hosts a p2p message is Simple (no LL buffers on net connections): the ring
    # Simple base 8.4 µs scales with the generation, the tree's network Simple hop 14 µs
    # (a NIC's cost) does not, nor does the proxy's slot post on the shared p2p buffers
    # (getNetOverhead: one post, 2 µs on the DGX A100's AMD hosts)
    cost = p2p_cost(1024, shape("dgx-a100:nodes=2", 16), across_nodes=True)
    assert cost.protocol == "Simple"
    assert cost.latency_s * 1e6 == pytest.approx(8.4 * AMPERE + 14.0 + 2.0)


def test_rccl_is_not_scaled():
    # RCCL keeps its own per-arch tables (tuning_model_5 on gfx942)
    assert shape("mi300x", 8).gen_lat_scale == 1.0


SPECS = {"dgx-a100": 8, "dgx-h100": 8, "hgx-h200": 8, "dgx-b200": 8, "gb200-nvl72": 16,
         "mi300x": 8, "dgx-h100:nodes=2": 16}


@settings(max_examples=80, deadline=None)
@given(spec=st.sampled_from(sorted(SPECS)), op=st.sampled_from(OPS),
       nbytes=st.integers(8, 8192), data=st.data())
def test_latency_never_falls_when_the_group_grows(spec, op, nbytes, data):
    """In the LL regime (a few KiB), a bigger group of the same machine never has a lower
    latency floor: every algorithm adds hops (or keeps them) as ranks are added."""
    top = SPECS[spec]
    small = data.draw(st.integers(2, top - 1))
    big = data.draw(st.integers(small + 1, top))

    def floor(n):
        return min(c.latency_s for c in candidates(op, nbytes, shape(spec, n)))

    assert floor(big) >= floor(small) - 1e-12


def test_small_messages_run_on_fewer_channels_as_nccl_sizes_them():
    """enqueue.cc: a channel is dropped while bytes < channels × threads × threshold; the
    ring's LL threshold is 8 B × ranks per thread (512 threads), the tree's 8 B, LL128's 8 B
    (640 threads), Simple's 64 B (512 threads). A DGX H100 runs 2 × 12 = 24 channels."""
    from treeattn.sim.nccl.collectives import run_channels

    h100 = shape("dgx-h100", 8)
    assert run_channels("ring", 0, 65536, h100) == (65536 / (512 * 8 * 8), 24)  # 2 channels
    assert run_channels("tree", 0, 65536, h100) == (65536 / (512 * 8), 24)  # 16
    assert run_channels("ring", 1, 65536, h100) == (65536 / (640 * 8), 24)  # 12.8
    assert run_channels("ring", 2, 65536, h100) == (2.0, 24)
    assert run_channels("ring", 0, 8, h100) == (1.0, 24)  # never below one channel
    assert run_channels("ring", 0, 1 << 30, h100) == (24, 24)
    assert run_channels("nvls", 2, 8, h100) == (24, 24)  # NVLS sizes its channels otherwise


def rail(spec: str) -> GroupShape:
    """One GPU of each node (a context-parallel group under TP8)."""
    topo = Topology.from_spec(spec)
    return GroupShape.of(topo, range(0, topo.num_gpus, 8))


@pytest.mark.parametrize("spec", ["dgx-h100:nodes=4", "dgx-b200:nodes=4"])
def test_rail_groups_on_sm90_and_newer_run_four_compute_channels(spec):
    """connect.cc: 1 search channel at 48 GB/s -> 2 compute channels, doubled again because
    the GPU is sm90+, the group spans nodes, 48 > 45 GB/s and 2 < 16: 4 channels. A ring
    Simple message drops to bytes / (512 threads × 64 B) = 2 of them at 64 KiB; the p2p
    channels are 4 (a power of two)."""
    from treeattn.sim.nccl.collectives import run_channels

    group = rail(spec)
    assert (group.channels, group.intra_speed, group.compute_channels) == (1, 48, 4)
    assert run_channels("ring", 2, 1 << 30, group) == (4, 4)
    assert run_channels("ring", 2, 65536, group) == (2.0, 4)
    assert group.p2p_channels == 4
    # the plateau (tuning.cc) starts where bytes / (4 channels × 4 ranks) reaches 64: 1 KiB
    def ring_simple_latency(nbytes):
        return collective_cost("all_reduce", nbytes, group, algorithm="ring",
                               protocol="Simple").latency_s

    assert ring_simple_latency(1023) == ring_simple_latency(64)
    assert ring_simple_latency(1024) == pytest.approx(1.4 * ring_simple_latency(64))


def test_compute_channels_are_doubled_once_where_the_rule_does_not_hold():
    # A100 (sm80) rail: 2; DGX H100 on 4 nodes: 12 search channels -> 24, not under 16; one
    # DGX H100 node: 24
    assert rail("dgx-a100:nodes=4").compute_channels == 2
    assert shape("dgx-h100:nodes=4", 32).compute_channels == 24
    assert shape("dgx-h100", 8).compute_channels == 24


def test_nvls_tree_is_corrected_on_blackwell_x86_hosts_only():
    """tuning.cc: NVLS_TREE all-reduce bandwidth × treeCorrectionFactor where minCompCap >=
    100 and the CPUs are x86. At 1 MiB, log2(2^20 / 64) = 14: Simple's entry 14 is 0.5, so
    the wire time doubles on a DGX B200 pair (Intel hosts); not on ARM hosts, nor on H100
    (sm90)."""
    from dataclasses import replace

    def nvls_tree(group, nbytes=1 << 20):
        return collective_cost("all_reduce", nbytes, group, algorithm="nvls_tree")

    b200 = shape("dgx-b200:nodes=2", 16)
    assert b200.cpu_x86 and not shape("gb200-nvl72:racks=2", 144).cpu_x86
    x86, arm = nvls_tree(b200), nvls_tree(replace(b200, cpu_x86=False))
    assert x86.latency_s == arm.latency_s
    assert x86.time_s - x86.latency_s == pytest.approx(2 * (arm.time_s - arm.latency_s))
    h100 = shape("dgx-h100:nodes=2", 16)
    assert nvls_tree(h100).time_s == nvls_tree(replace(h100, cpu_x86=False)).time_s
    # 1.5 MiB: NCCL ranks with entry 14 as a step (0.5), the price is on the line to 0.6
    mid = nvls_tree(b200, 3 << 19)
    mid_arm = nvls_tree(replace(b200, cpu_x86=False), 3 << 19)
    # (NCCL ranks on its own, unscaled latencies: the generation factor prices the pick)
    tuned_latency = nvls_tree(replace(b200, gen_lat_scale=1.0), 3 << 19).latency_s
    assert mid.choice_s - tuned_latency == pytest.approx(2 * (mid_arm.time_s - arm.latency_s))
    assert mid.time_s - mid.latency_s < mid.choice_s - tuned_latency


def test_ring_simple_plateau_is_1_9_below_sm80_and_1_4_from_it():
    """tuning.cc: a multi-node ring Simple all-reduce's latency × (minCompCap < 80 ? 1.9 :
    1.4) once bytes / (channels × ranks) >= 64: on 2 DGX A100s (24 compute channels, 16
    ranks) from 24,576 B. The same group read as Volta (sm70) takes 1.9."""
    from dataclasses import replace

    a100 = shape("dgx-a100:nodes=2", 16)

    def ratio(group):
        def latency(nbytes):
            return collective_cost("all_reduce", nbytes, group, algorithm="ring",
                                   protocol="Simple").latency_s
        assert latency(24575) == latency(64)
        return latency(24576) / latency(64)

    assert ratio(a100) == pytest.approx(1.4)
    assert ratio(replace(a100, arch="volta")) == pytest.approx(1.9)


def test_a100_ring_ll_at_64_kib_moves_on_two_channels():
    # 8 GPUs, 64 KiB: the ring's LL threshold is 8 B × 8 ranks per thread × 512 threads =
    # 32 KiB a channel, so 2 of the 24 compute channels run: one search channel's worth, 20
    # GB/s (NCCL's A100 ring: 12 search channels at 20 GB/s), halved for LL's flags = 10
    # GB/s of bus, under llMaxBws' 87.7 GB/s (one cap for the whole GPU, which does not bind
    # here); × 8/14 for the algorithm bandwidth, after the clock-scaled 15.0 µs latency
    # (ABCI's 8 A100s measured 39.3 µs)
    cost = collective_cost("all_reduce", 65536, shape("dgx-a100", 8), algorithm="ring",
                           protocol="LL")
    wire = 65536 / (1000 * 10.0 * 8 / 14)
    assert cost.time_s * 1e6 == pytest.approx(15.0 * AMPERE + wire, rel=1e-9)
    # NCCL picks by its own estimate: every channel, and its own (unscaled) latency
    assert cost.tuner_s * 1e6 == pytest.approx(15.0 + 65536 / (1000 * 87.7 * 8 / 14))


def test_a100_mid_size_all_reduce_is_ring_ll128_on_nccls_ampere_figures():
    # 8 GPUs, 4-16 MiB: NCCL's tuner takes ring LL128 at min(0.92 × 12 × 20, 12 ×
    # perChMaxRingLL128Bws[ampere] = 20) = 220.8 GB/s of bus bandwidth on every channel,
    # × 8/14 for the algorithm bandwidth; the latency is ring LL128's base 14 µs + 14 NVLink
    # hops × 1.9 µs (40.6 µs as NCCL ranks it), priced clock-scaled. Ring bandwidth has no
    # size correction in NCCL (treeCorrectionFactor is the tree's), so none here either.
    # From 32 MiB ring Simple wins NCCL's ranking: 8.4 + 14 × 3.4 = 56.0 µs at 12 × 20 =
    # 240 GB/s of bus: 56.0 + 244.7 = 300.7 µs against LL128's 40.6 + 265.9 = 306.5.
    latency = (14.0 + 14 * 1.9) * AMPERE
    for nbytes in (4 << 20, 8 << 20, 16 << 20):
        cost = collective_cost("all_reduce", nbytes, shape("dgx-a100", 8))
        assert (cost.algorithm, cost.protocol) == ("ring", "LL128")
        wire = nbytes / (1000 * 220.8 * 8 / 14)
        assert cost.time_s * 1e6 == pytest.approx(latency + wire, rel=1e-9)
    assert collective_cost("all_reduce", 2 << 20, shape("dgx-a100", 8)).protocol == "LL"
    big = collective_cost("all_reduce", 32 << 20, shape("dgx-a100", 8))
    assert big.protocol == "Simple"
    assert big.choice_s * 1e6 == pytest.approx(56.0 + (32 << 20) / (1000 * 240 * 8 / 14))
