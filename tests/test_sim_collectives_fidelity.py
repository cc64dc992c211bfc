"""The collective model against published nccl-tests runs (benchmarks/fidelity.py): each
family's bounds and why, and the bytes nccl-tests' bus bandwidth implies.
"""

from __future__ import annotations

import pytest
from benchmark_module import load_benchmark

from treeattn.schedule.payloads import busbw_factor
from treeattn.topo import Topology


def test_busbw_factors_match_nccl_tests():
    assert busbw_factor("all_reduce", 8) == pytest.approx(14 / 8)
    assert busbw_factor("all_gather", 8) == pytest.approx(7 / 8)
    assert busbw_factor("broadcast", 8) == 1.0


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
    # A100 across 2 and 4 hosts (ABCI, NCCL 2.8.4, one process per GPU): scored up to 64 KiB
    # (its nodes have half the builder's NICs), 4 B to 64 KiB on each: 15 rows, 14 of them
    # in the 8 B-64 KiB small range; the ±30% small-message target, measured 13%
    hosts = summary["A100 2-4 nodes (MPI)"]
    assert (hosts["points"], hosts["small_points"], hosts["large_points"]) == (30, 28, 0)
    assert hosts["small_geo_error"] <= 0.30


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
