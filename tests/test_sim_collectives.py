"""The collective cost model: NCCL's own formulas, its choices, and its fidelity.

Expected values here are worked by hand from NCCL 2.30.7's tuning tables (named in each
test), not printed by the code under test.
"""

from __future__ import annotations

import math

import pytest
from benchmark_module import load_benchmark
from hypothesis import example, given, settings
from hypothesis import strategies as st

from treeattn.schedule.payloads import busbw_factor
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
def dgx():
    return GroupShape.of(Topology.from_spec("dgx-h100"), range(8))


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


def test_rccl_on_mi300x_uses_its_own_tables():
    shape = GroupShape.of(Topology.from_spec("mi300x"), range(8))
    # RCCL: base 12.0 + 14 xGMI hops * 0.8 us = 23.2 us; LL128 off.
    best = collective_cost("all_reduce", 8, shape)
    assert best.latency_s == pytest.approx(23.2e-6)
    assert all(c.protocol != "LL128" for c in candidates("all_reduce", 1 << 20, shape))


def test_rccl_correction_factors_choose_but_do_not_price():
    """RCCL's per-size factors (tuning_model_5) rank variants; the time is the model's own.

    On 2 MI300X nodes a 128 MiB all-reduce: ring Simple's factor there is 0.1 and tree
    Simple's 0.7, so the tuner ranks ring at 10x its bandwidth time and tree at 1/0.7x. By
    hand: 16 ranks, 30 ring steps, 2 across the network; 16 channels at the 2-node per-channel
    speed, bwRatio 1.0; latency 17 + 28 * max(2.1, 3 * 2 us AMD net overhead) + 2 * 320 us.
    """
    shape = GroupShape.of(Topology.from_spec("mi300x:nodes=2"), range(16))
    nbytes = 128 << 20
    ring = collective_cost("all_reduce", nbytes, shape, algorithm="ring")
    latency_us = 17.0 + 28 * 6.0 + 2 * 320.0
    alg_bw = shape.channels * shape.intra_speed * 1.0 * 16 / 30  # GB/s
    assert ring.latency_s == pytest.approx(latency_us * 1e-6)
    assert ring.time_s == pytest.approx((latency_us + nbytes / (1000 * alg_bw)) * 1e-6)
    assert ring.choice_s == pytest.approx((latency_us + nbytes / (100 * alg_bw)) * 1e-6)
    # 32 MiB: ring Simple's factor is 0.1 and tree Simple's 1.0, so RCCL picks the tree, whose
    # own time (2-node tree Simple bwRatio 0.11) is the slower of the two
    pick = collective_cost("all_reduce", 32 << 20, shape)
    ring = collective_cost("all_reduce", 32 << 20, shape, algorithm="ring")
    assert (pick.algorithm, pick.protocol) == ("tree", "Simple")
    assert ring.time_s < pick.time_s and pick.choice_s < ring.choice_s


def test_p2p_is_not_priced_as_a_collective(dgx):
    # one ring hop, LL: 6.6 + 0.6 = 7.2 us (not the 15 us of an 8-rank all-reduce).
    assert p2p_cost(8, dgx).latency_s == pytest.approx(7.2e-6)
    assert collective_cost("sendrecv", 8, dgx).time_s < collective_cost("all_reduce", 8,
                                                                         dgx).time_s


def test_busbw_factors_match_nccl_tests():
    assert busbw_factor("all_reduce", 8) == pytest.approx(14 / 8)
    assert busbw_factor("all_gather", 8) == pytest.approx(7 / 8)
    assert busbw_factor("broadcast", 8) == 1.0


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
# treeCorrectionFactor as a step: tree LL128 from 0.6 to 0.8 at 4 MiB, 13% cheaper there
@example(op="all_reduce", a=4_175_512, b=4_194_304, spec="dgx-a100:nodes=2")
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
    if set(offered) == {(c.algorithm, c.protocol) for c in candidates(op, large, shape)}:
        t_small = collective_cost(op, small, shape).time_s
        assert t_small <= collective_cost(op, large, shape).time_s * (1 + 1e-9)


@pytest.mark.parametrize("spec, op, below, above", [
    ("dgx-a100:nodes=2", "broadcast", 65_536, 292_922),
    ("dgx-h100:nodes=4", "broadcast", 131_072, 189_940),
    ("gb200-nvl72", "broadcast", 295_541, 2_137_016)])
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


def test_rccl_forced_ll_makes_reduce_scatter_slower_just_below_its_limit():
    """RCCL forces LL for a one-node reduce-scatter up to a per-rank size, after its model
    chose; past that size Simple runs, and a larger message finishes sooner. The model
    keeps that, so the best time is monotone only among the same variants (above)."""
    shape = GroupShape.of(_topology("mi300x"), range(8))
    limit = 8 * T.RCCL_LL_MAX_PER_RANK_RS_ONE_NODE
    below, above = (collective_cost("reduce_scatter", n, shape) for n in (limit, 4 * limit))
    assert (below.protocol, above.protocol) == ("LL", "Simple")
    assert above.time_s < below.time_s


_TOPOLOGIES: dict[str, Topology] = {}


def _topology(spec: str) -> Topology:
    if spec not in _TOPOLOGIES:
        _TOPOLOGIES[spec] = Topology.from_spec(spec)
    return _TOPOLOGIES[spec]


def _fidelity():
    return load_benchmark("fidelity")


def test_fidelity_against_published_measurements():
    """Bounds, and why:

    * H100 on 1 and on 2-4 nodes: the issue's targets (±30% small-message time, ±25% large
      bus bandwidth), met with constants read from NCCL's source, nothing fitted.
    * MI300X on one node: the issue's ±30% small-message target. RCCL's tables price
      8-512 B within 42%; from 1 KiB RCCL of that release runs MSCCL's all-pairs schedule
      (rule and constants from RCCL's source, see ``test_rccl_msccl_*``), and the
      small-message error is 10%. Large sizes within 7%.
    * MI300X on two nodes: large sizes within 25% (RCCL's correction factors rank the
      variants, see ``test_rccl_correction_factors_choose_but_do_not_price``).
    """
    fidelity = _fidelity()
    summary = {s["family"]: s for s in fidelity.summarise(fidelity.score_points())}
    assert summary["H100 2-4 nodes"]["small_geo_error"] <= 0.30
    assert summary["H100 2-4 nodes"]["large_busbw_geo_error"] <= 0.25
    assert summary["H100 1 node"]["large_busbw_geo_error"] <= 0.25
    assert summary["MI300X 1 node"]["small_geo_error"] <= 0.30
    assert summary["MI300X 1 node"]["large_busbw_geo_error"] <= 0.25
    # Two MI300X nodes: large sizes only (the run's RoCE small-message latency is ~5x RCCL's
    # InfiniBand constants); 14% with RCCL's factors used to choose, 74% if they priced.
    assert summary["MI300X 2 nodes"]["large_busbw_geo_error"] <= 0.25
    # one-process (-g 8) runs off the H100: scored from 128 MiB on, where the launch is a few
    # percent of the time (small sizes are the host's launch rate, listed unscored)
    assert summary["H200 1 node, 8 GPUs (NVLS, -g 8)"]["large_busbw_geo_error"] <= 0.25
    assert summary["A100 1 node, 8 GPUs (-g 8)"]["large_busbw_geo_error"] <= 0.25
    assert summary["A100 1 node, 8 GPUs (-g 8)"]["small_points"] == 0
    # A100, one process per GPU (NCCL 2.8.4): the issue's ±20% small-message target, with the
    # clock-scaled latency and the channels NCCL sizes a small message to
    assert summary["A100 1 node, 4 and 8 GPUs (MPI)"]["small_geo_error"] <= 0.20
    # 2 and 4 H100s of a node (-g runs, from 128 MiB): the 20% target; the model
    # prices these groups as NCCL's tuner does (test_small_groups_are_priced_as_nccls_...)
    small_groups = summary["H100 1 node, 2 and 4 GPUs (-g)"]
    assert small_groups["small_points"] == 0 and small_groups["large_points"] == 27
    assert small_groups["large_busbw_geo_error"] <= 0.20
    # one GB200 NVL72 rack, one process per GPU, 512 MB-8 GB on NVLS: the issue's ±25% large
    # bus-bandwidth target (measured 22%: the run ramps to 0.92 of the model by 4 GB)
    rack = summary["GB200 NVL72 rack, 72 GPUs (one process per GPU)"]
    assert rack["small_points"] == 0 and rack["large_points"] == 5
    assert rack["large_busbw_geo_error"] <= 0.25


def test_busbw_table_reads_times_back_from_bus_bandwidth():
    """A vendor's busbw table: time = bytes / (busbw / bus factor); 4 GPUs' all-reduce bus
    factor is 2 (n - 1) / n = 1.5, so 4096 B at 0.38 GB/s took 4096 × 1.5 / 0.38 ns."""
    from pathlib import Path

    fidelity = _fidelity()
    path = (Path(__file__).parent / "fixtures" / "nccl-tests"
            / "gb200-4gpu-1node-all-reduce-busbw-ring-g4-azure.md")
    table = fidelity.read_busbw_table(path, "all_reduce", 4)
    sizes = [r.size for r in table.rows]
    assert sizes[:8] == [1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072]
    assert sizes[-1] == 8 << 30 and len(sizes) == 24
    row = table.rows[2]
    assert row.time_us == pytest.approx(4096 * 1.5 / 0.38 / 1e3)


@pytest.fixture(scope="module")
def mi300x_msccl():
    from dataclasses import replace

    from treeattn.topo import Topology

    shape = GroupShape.of(Topology.from_spec("mi300x"), range(8))
    return shape, replace(shape, rccl_msccl=True)


def test_rccl_msccl_takes_small_all_reduces_where_its_rule_allows(mi300x_msccl):
    tuner, msccl = mi300x_msccl
    for nbytes in (1024, 4096, 65536):  # 256-float multiples up to the XML's 64 KiB
        got = collective_cost("all_reduce", nbytes, msccl)
        assert (got.algorithm, got.protocol) == ("msccl_allpairs", "LL")
        # RCCL's ring LL base (12 us) and two xGMI hops (0.8 us each), by hand
        assert got.latency_s == pytest.approx(13.6e-6)
        assert got.time_s < collective_cost("all_reduce", nbytes, tuner).time_s
    for nbytes in (8, 512, 1536, 65536 + 1024):  # below 256 floats, not a multiple, too big
        assert collective_cost("all_reduce", nbytes, msccl) == collective_cost(
            "all_reduce", nbytes, tuner)
    assert collective_cost("all_gather", 4096, msccl).algorithm != "msccl_allpairs"


def test_rccl_msccl_needs_exactly_one_8_gpu_gfx942_node():
    from dataclasses import replace

    from treeattn.topo import Topology

    for spec, ranks in (("mi300x:nodes=2", 16), ("mi300x", 4), ("dgx-h100", 8)):
        shape = replace(GroupShape.of(Topology.from_spec(spec), range(ranks)), rccl_msccl=True)
        assert collective_cost("all_reduce", 4096, shape).algorithm != "msccl_allpairs"


def test_comm_cli_prints_nccl_tests_rows(capsys):
    import json

    from treeattn.cli import main

    assert main(["comm", "--topology", "dgx-h100", "--op", "all_reduce", "--min-bytes", "1M",
                 "--max-bytes", "4M", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [r["bytes"] for r in rows] == [1 << 20, 2 << 20, 4 << 20]
    assert set(rows[0]) == {"op", "bytes", "time_us", "algbw_gbps", "busbw_gbps", "algorithm",
                            "protocol", "transport", "ranks", "dtype"}
    assert rows[0]["transport"] == "nccl"
    assert rows[0]["busbw_gbps"] == pytest.approx(rows[0]["algbw_gbps"] * 14 / 8, rel=1e-2)


@pytest.mark.parametrize("argv,needle", [
    (["--op", "gather"], "invalid choice"),
    (["--op", "all_reduce", "--min-bytes", "0"], "at least 1"),
    (["--op", "all_reduce", "--min-bytes", "1G", "--max-bytes", "8"], "above --max-bytes"),
    (["--op", "all_reduce", "--max-bytes", "-5"], "not a size"),
])
def test_comm_cli_bad_input(capsys, argv, needle):
    from treeattn.cli import main

    try:
        code = main(["comm", "--topology", "dgx-h100", *argv])
    except SystemExit as exc:  # argparse's own usage errors leave through SystemExit
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1


def test_comm_cli_refuses_cpu_ranks_and_single_gpus(capsys):
    from treeattn.cli import main

    assert main(["comm", "--topology", "local:ranks=2", "--op", "all_reduce"]) == 2
    err = capsys.readouterr().err
    assert "no NCCL/RCCL model" in err and len(err.strip().splitlines()) == 1
    assert main(["comm", "--topology", "local:ranks=1", "--op", "all_reduce"]) == 2
    assert "needs at least 2" in capsys.readouterr().err


def test_collectives_count_the_bytes_nccl_tests_busbw_implies():
    """Each member of an all-reduce sends 2(p−1)/p of the buffer; of an all-gather (p−1)/p."""
    from treeattn.sim import DecodeWorkload, build_schedule, simulate

    topo = Topology.from_spec("dgx-h100")
    w = DecodeWorkload("llama-3.1-8b", 65536, partial_dtype="fp32")  # one partial format
    two = simulate(build_schedule("allreduce2", topo, w), topo, w)
    buffers = w.max_bytes + w.buffer_bytes("numden")
    assert two.comm_bytes == 8 * int(2 * 7 / 8 * w.max_bytes) + 8 * int(
        2 * 7 / 8 * w.buffer_bytes("numden"))
    assert two.comm_bytes == pytest.approx(8 * 2 * 7 / 8 * buffers, abs=16)
    gather = simulate(build_schedule("oneshot", topo, w), topo, w)
    assert gather.comm_bytes == 8 * int(7 / 8 * 8 * w.partial_bytes)


def test_comm_cli_prices_the_older_rccl_on_request(capsys):
    import json

    from treeattn.cli import main

    args = ["comm", "--topology", "mi300x", "--op", "all_reduce", "--min-bytes", "4K",
            "--max-bytes", "4K", "--json"]
    assert main(args) == 0
    (today,) = json.loads(capsys.readouterr().out)["rows"]
    assert main(args + ["--rccl-msccl"]) == 0
    (older,) = json.loads(capsys.readouterr().out)["rows"]
    assert today["algorithm"] == "ring" and older["algorithm"] == "msccl_allpairs"
    assert older["time_us"] < today["time_us"]


def test_nccl_symmetric_kernels_as_nccl_prices_them():
    """NCCL 2.30.7 ``sym_kernels.cc`` by hand, on one DGX H100 (Hopper, NVLS multicast): a
    256 MiB all-reduce on 8 ranks runs the multimem kernel, whose bus bytes are
    ``n/8 + n``, its bandwidth the 480 GB/s ceiling (2 blocks x 65 GB/s x 8 ranks is far
    above it, so softmin sits at the ceiling), plus the 7.8 us base: ``7.8 + busBytes/bw - 1``
    (softplus of a large argument is the argument). A 4 KiB one runs an LL kernel: base
    4.5 us plus at most a few us for ``8 x 4 KiB x 9`` LL bus bytes."""
    from treeattn.sim.nccl.symmetric import symmetric_candidates, symmetric_cost, unavailable

    shape = GroupShape.of(Topology.from_spec("dgx-h100"), range(8))
    gbps = (1 << 30) / 1e6
    n = 256 << 20
    big = symmetric_cost("all_reduce", n, shape)
    assert big.algorithm == "symk_RSxLDMC_AGxSTMC"
    assert big.time_s * 1e6 == pytest.approx(7.8 + (n / 8 + n) / (480 * gbps) - 1, rel=1e-3)
    small = symmetric_cost("all_reduce", 4096, shape)
    assert small.protocol == "LL" and 4.5e-6 < small.time_s < 8e-6
    assert small.time_s < collective_cost("all_reduce", 4096, shape).time_s / 2
    assert {c.algorithm for c in symmetric_candidates("all_gather", 1 << 20, shape)} == {
        "symk_LL", "symk_LLMC", "symk_ST", "symk_STMC"}
    assert "sum only" in unavailable("all_reduce", shape, "max")
    two = GroupShape.of(Topology.from_spec("dgx-h100:nodes=2"), range(16))
    assert "directly on NVLink" in unavailable("all_gather", two)
    assert symmetric_candidates("all_reduce", 4096, two) == []
    pair = GroupShape.of(Topology.from_spec("dgx-h100"), range(2))  # no multicast at 2 ranks
    assert not any("MC" in c.algorithm for c in symmetric_candidates("all_reduce", 1 << 20,
                                                                      pair))


def test_comm_cli_prices_the_symmetric_transport_or_refuses_it(capsys):
    import json

    from treeattn.cli import main

    args = ["comm", "--topology", "dgx-h100", "--op", "all_gather", "--min-bytes", "1K",
            "--max-bytes", "4K", "--transport", "nccl-symm", "--json"]
    assert main(args) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [r["bytes"] for r in rows] == [1024, 2048, 4096]
    assert all(r["transport"] == "nccl-symm" and r["algorithm"].startswith("symk_")
               for r in rows)
    assert main(["comm", "--topology", "dgx-h100:nodes=2", "--op", "all_reduce",
                 "--transport", "nccl-symm"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "directly on NVLink" in err[0]


# --- groups of 2, 4 and 8 GPUs of a node, by GPU generation (search.cc, tuning.cc) -------

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
    """2 H100s, 1 GiB: 512 MiB to the peer over p2p channels (paths.cc, enqueue.cc): 24
    compute channels -> 32 p2p channels, 2 × 18 NVLinks = 36 -> 32 a peer, halved to 16 so 2
    ranks fit; each at the ring's 30 GB/s search speed over 2 compute channels: 240 GB/s,
    not the GPU's 370.8."""
    shape = GroupShape.of(Topology.from_spec("dgx-h100"), range(2))
    cost = collective_cost("all_to_all", 1 << 30, shape)
    wire = cost.time_s - cost.latency_s
    assert wire == pytest.approx((1 << 29) / (16 * 15e9))
    # 8 ranks: 4 channels a peer (4 × 8 = 32), 7 peers × 60 GB/s > 370.8: the NVLink binds
    eight = GroupShape.of(Topology.from_spec("dgx-h100"), range(8))
    cost = collective_cost("all_to_all", 1 << 30, eight)
    assert cost.time_s - cost.latency_s == pytest.approx(7 * (1 << 27) / 370.8e9)


def test_comm_prices_a_2_gpu_group_of_a_dgx_b200(capsys):
    import json

    from treeattn.cli import main

    assert main(["comm", "--topology", "dgx-b200", "--gpus", "2", "--op", "all_reduce",
                 "--min-bytes", "8", "--max-bytes", "8", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)["rows"][0]
    # a 2-rank ring all-reduce: 2 (n − 1) = 2 NVLink LL hops after the 6.6 µs base (NCCL's
    # figures, unscaled on Blackwell); 8 B on one of
    # 32 channels (2 × 16 search channels at 45 GB/s): 720 / 32 = 22.5 GB/s, halved for LL
    # (llMaxBws' 282 GB/s caps the whole GPU); a 2-rank all-reduce's bus is its algbw
    assert (row["ranks"], row["algorithm"], row["protocol"]) == (2, "ring", "LL")
    assert row["time_us"] == pytest.approx((6.6 + 2 * 0.6) + 8 / (1e3 * 11.25),
                                           abs=1e-3)
    assert main(["comm", "--topology", "dgx-b200", "--ranks", "1,5", "--op", "all_to_all",
                 "--max-bytes", "8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["rows"][0]["ranks"] == 2


@pytest.mark.parametrize("argv, needle", [
    (["--gpus", "9"], "has 8 GPU(s)"),
    (["--ranks", "0,8"], "out of range"),
    (["--ranks", "0,0"], "twice"),
    (["--ranks", "0,,1"], "empty item"),
    (["--ranks", "0,1,"], "empty item"),
    (["--ranks", " ,0,1"], "empty item"),
    (["--gpus", "2", "--dtype", "complex64"], "no dtype"),
])
def test_comm_group_and_dtype_bad_input(capsys, argv, needle):
    from treeattn.cli import main

    assert main(["comm", "--topology", "dgx-b200", "--op", "all_reduce", *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1
    assert main(["comm", "--topology", "dgx-a100", "--op", "all_reduce", "--dtype", "fp8"]) == 2
    assert "Hopper" in capsys.readouterr().err
