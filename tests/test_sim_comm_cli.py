"""``treeattn comm``: the model printed as an nccl-tests run on any group, transport and
dtype, and its bad input; NCCL's symmetric kernels as NCCL prices them.
"""

from __future__ import annotations

import pytest

from treeattn.sim.nccl.collectives import (
    GroupShape,
    collective_cost,
)
from treeattn.topo import Topology


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


def test_comm_prices_a_2_gpu_group_of_a_dgx_b200(capsys):
    import json

    from treeattn.cli import main

    assert main(["comm", "--topology", "dgx-b200", "--gpus", "2", "--op", "all_reduce",
                 "--min-bytes", "8", "--max-bytes", "8", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)["rows"][0]
    # a 2-rank ring all-reduce: 2 (n − 1) = 2 NVLink LL hops after the 6.6 µs base (NCCL's
    # figures, × 3.0 / 2.3 on Blackwell: nccl_tables NCCL-gen); 8 B on one of
    # 32 channels (2 × 16 search channels at 45 GB/s): 720 / 32 = 22.5 GB/s, halved for LL
    # (llMaxBws' 282 GB/s caps the whole GPU); a 2-rank all-reduce's bus is its algbw
    assert (row["ranks"], row["algorithm"], row["protocol"]) == (2, "ring", "LL")
    assert row["time_us"] == pytest.approx((6.6 + 2 * 0.6) * 3.0 / 2.3 + 8 / (1e3 * 11.25),
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
