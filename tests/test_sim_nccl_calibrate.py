"""Calibrating a GPU cluster from nccl-tests output: parse, fit, profile, reproduce, refuse.

Fixtures are real published outputs (tests/fixtures/nccl-tests, sources in SOURCES.md).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from treeattn.cli import main
from treeattn.sim import SimError
from treeattn.sim.nccl.collectives import GroupShape
from treeattn.sim.nccl.fit import _loss, _rows, fit
from treeattn.sim.nccl.nccltests import op_from_name, parse_nccl_tests, read_nccl_tests
from treeattn.topo import Topology

FIXTURES = Path(__file__).parent / "fixtures" / "nccl-tests"
H100_2NODE = FIXTURES / "h100-2node-all-reduce-perf-8B-16G-issue309.txt"
MI300X = FIXTURES / "mi300x-1node-rccl-all-reduce-perf-8B-8G.txt"
RING = FIXTURES / "h100-2node-all-reduce-perf-ring-issue290.txt"

pytestmark = pytest.mark.timeout(120)


def _run(capsys, *argv):
    try:
        code = main(list(argv))
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


# published without its header lines (the author kept only the rows): no ranks to count
HEADERLESS = {"h100-2gpu-1node-all-reduce-perf-g2-waynehacking8.txt",
              "gb200-72gpu-1rack-all-reduce-perf-coreweave-pr43.txt"}


def test_every_fixture_parses_with_its_world_and_rows():
    for path in sorted(FIXTURES.glob("*.txt")):
        table = read_nccl_tests(path)
        assert table.op == op_from_name(path.name) and table.rows, path.name
        assert table.world in ((1,) if path.name in HEADERLESS else (4, 8, 16, 32)), path.name
        assert all(row.size > 0 for row in table.rows), path.name
    assert read_nccl_tests(RING).rows[0].in_place_time_us == pytest.approx(405.5)  # 0: prefixes
    assert read_nccl_tests(MI300X).library == "rccl"


@pytest.mark.parametrize("fixture, topology", [(H100_2NODE, "dgx-h100:nodes=2"),
                                                (MI300X, "mi300x")])
def test_calibrated_comm_reproduces_the_table_within_10_percent(tmp_path, capsys, fixture,
                                                               topology):
    profile = tmp_path / "profile.json"
    code, _, err = _run(capsys, "calibrate", "--nccl-tests", str(fixture), "--topology",
                        topology, "-o", str(profile))
    assert code == 0, err
    saved = json.loads(profile.read_text())
    assert saved["kind"] == "nccl-tests" and saved["nccl_tests"]["residuals"]
    table = read_nccl_tests(fixture)
    code, out, _ = _run(capsys, "comm", "--topology", topology, "--op", "all_reduce",
                        "--min-bytes", str(table.rows[0].size), "--max-bytes",
                        str(table.rows[-1].size), "--profile", str(profile), "--json")
    rows = {r["bytes"]: r for r in json.loads(out)["rows"]}
    for row in table.rows:
        measured = min(row.time_us, row.in_place_time_us or row.time_us)
        assert rows[row.size]["time_us"] == pytest.approx(measured, rel=0.10), row.size


def test_the_fit_never_makes_the_model_worse():
    table = read_nccl_tests(H100_2NODE)
    shape = GroupShape.of(Topology.from_spec("dgx-h100:nodes=2"), range(16))
    calibration = fit([table], shape)
    rows = _rows([table])
    assert _loss(shape, rows, calibration.scales) <= _loss(shape, rows, {
        "lat": 1.0, "net_lat": 1.0, "bw": 1.0, "net_bw": 1.0})


def test_profile_is_accepted_by_predict_and_plan(tmp_path, capsys):
    profile = tmp_path / "p.json"
    assert _run(capsys, "calibrate", "--nccl-tests", str(H100_2NODE), "--topology",
                "dgx-h100:nodes=2", "-o", str(profile))[0] == 0
    code, out, err = _run(capsys, "plan", "--topology", "dgx-h100:nodes=2", "--model",
                          "llama-3.1-8b", "--seq-len", "32k", "--profile", str(profile), "--json")
    assert code == 0, err
    assert json.loads(out)["latency_s"] > 0
    code, _, err = _run(capsys, "plan", "--topology", "dgx-h100", "--model", "llama-3.1-8b",
                        "--seq-len", "32k", "--profile", str(profile))
    assert code == 2 and "calibrated on 16 GPUs" in err


HEADER = "#  Rank  0 Group  0 Pid 1 on a device  0 [0x18] NVIDIA H100\n" \
         "#  Rank  1 Group  0 Pid 2 on a device  1 [0x19] NVIDIA H100\n"


@pytest.mark.parametrize("body, needle", [
    ("           8     2  float  sum  -1   12.5  0.00  0.00   3   12.4  0.00  0.00  0\n",
     "#wrong is 3"),
    ("# only comments here\n", "no data rows"),
    ("           8     2  float  sum  -1   12.5  0.00\n", "columns"),
    ("           8     2  float  sum  -1   nan  0.00  0.00   0\n", "not a number"),
    # before the root column: the 4th column of a group is the largest difference, and a
    # float sum on 2 ranks may differ by DeltaMaxValue(float) × (2 − 1) = 1e-5 at most
    ("           8     2  float  sum   12.5  0.00  0.00  2e-05   12.4  0.00  0.00  0e+00\n",
     "above nccl-tests' tolerance for float on 2 ranks"),
])
def test_damaged_tables_are_refused(body, needle):
    with pytest.raises(SimError, match=needle):
        parse_nccl_tests(HEADER + body, op="all_reduce")


def test_zero_byte_rows_are_skipped_and_nothing_else_at_zero():
    """An all-gather sweep from 8 B on 4 GPUs prints 0 B / 0 elements rows (nccl-tests'
    output for sizes below one element per rank): skipped. A 0-byte size with elements is
    no nccl-tests row: refused."""
    header = "# nThread 1 nGpus 4 minBytes 8 maxBytes 64 step: 2(factor)\n"
    zero = "           0             0     float    none      -1     0.42    0.00    0.00      0\n"
    row = "          64             4     float    none      -1    16.98    0.00    0.00      0\n"
    table = parse_nccl_tests(header + zero * 3 + row, op="all_gather")
    assert (table.world, [r.size for r in table.rows]) == (4, [64])
    with pytest.raises(SimError, match="out of range"):
        parse_nccl_tests(header + zero.replace("  0     float", "  4     float"), op="all_gather")
    with pytest.raises(SimError, match="no data rows"):
        parse_nccl_tests(header + zero, op="all_gather")


def test_releases_before_the_root_column_parse():
    """nccl-tests before 2021 printed no root column, and the largest difference from the
    expected result where #wrong is now (fixture: ABCI's 8x A100, NCCL 2.8.4)."""
    table = read_nccl_tests(FIXTURES / "a100-8gpu-1node-all-reduce-perf-mpi-abci.txt")
    assert (table.op, table.world, len(table.rows)) == ("all_reduce", 8, 24)
    row = table.rows[1]
    assert (row.size, row.time_us, row.in_place_time_us, row.max_error) == (8, 17.03, 17.03,
                                                                              1e-07)
    one = parse_nccl_tests(HEADER + "   8   2  float  sum   12.5  0.00  0.00  1e-05\n",
                           op="all_reduce")
    assert one.rows[0].time_us == 12.5 and one.rows[0].in_place_time_us is None


def test_cli_refuses_world_mismatch_and_unknown_op(tmp_path, capsys):
    code, _, err = _run(capsys, "calibrate", "--nccl-tests", str(H100_2NODE), "--topology",
                        "dgx-h100")
    assert code == 2 and "measured on 16 ranks" in err and len(err.strip().splitlines()) == 1
    anonymous = tmp_path / "run.txt"
    anonymous.write_text(HEADER + "   8   2  float  sum  -1   12.5  0.00  0.00   0\n")
    code, _, err = _run(capsys, "calibrate", "--nccl-tests", str(anonymous), "--topology",
                        "pcie-4090:gpus=2")
    assert code == 2 and "OP:FILE" in err  # the text and its name do not say which op
    code, _, err = _run(capsys, "calibrate", "--nccl-tests", f"all_reduce:{anonymous}",
                        "--topology", "pcie-4090:gpus=2")
    assert code == 0, err
    code, _, err = _run(capsys, "calibrate", "--nccl-tests", str(anonymous))
    assert code == 2 and "--topology" in err


def test_sweep_and_run_check_take_a_gpu_profile(tmp_path, capsys):
    profile = tmp_path / "h100.json"
    assert _run(capsys, "calibrate", "--nccl-tests", str(H100_2NODE), "--topology",
                "dgx-h100:nodes=2", "-o", str(profile))[0] == 0
    out = tmp_path / "sweep"
    code, _, err = _run(capsys, "sweep", "--topology", "dgx-h100:nodes=2", "--seq-len", "32k",
                        "--profile", str(profile), "-o", str(out))
    assert code == 0, err
    rows = json.loads((out / "results.json").read_text())["rows"]
    plain = tmp_path / "plain"
    assert _run(capsys, "sweep", "--topology", "dgx-h100:nodes=2", "--seq-len", "32k",
                "-o", str(plain))[0] == 0
    unprofiled = json.loads((plain / "results.json").read_text())["rows"]
    by = {r["algorithm"]: r["latency_s"] for r in unprofiled}
    # collective-based plans are priced from the measured tables now, so they move
    assert any(r["latency_s"] != pytest.approx(by[r["algorithm"]], rel=1e-6) for r in rows
               if r["algorithm"] in ("oneshot", "helix", "allreduce2"))
    code, _, err = _run(capsys, "sweep", "--topology", "dgx-h100", "--seq-len", "32k",
                        "--profile", str(profile), "-o", str(tmp_path / "bad"))
    assert code == 2 and "calibrated on 16 GPUs" in err


def test_run_check_predicts_a_gpu_cluster_from_its_profile():
    from treeattn.commands.nccl_calibrate import calibration_profile
    from treeattn.runtime.measure.check import predictor
    from treeattn.sim.files.profiles import load_profile

    profile = load_profile(calibration_profile([str(H100_2NODE)], "dgx-h100:nodes=2"))
    topology, hardware, backend = predictor(profile, 16, "dgx-h100:nodes=2")
    assert topology.num_gpus == 16 and backend.calibration is not None
    from treeattn.runtime.errors import RuntimeFailure

    with pytest.raises(RuntimeFailure, match="give --topology"):
        predictor(profile, 16)


@pytest.mark.parametrize("op", ["all_gather", "reduce_scatter", "all_to_all", "sendrecv",
                                "broadcast"])
def test_every_nccl_tests_op_parses_and_calibrates(tmp_path, capsys, op):
    """Synthetic tables (the model's own times, ×1.3) in nccl-tests' layout for each op."""
    from treeattn.sim.nccl.collectives import collective_cost
    from treeattn.sim.nccl.nccltests import NCCL_TESTS_OPS

    shape = GroupShape.of(Topology.from_spec("dgx-h100"), range(8))
    rows = []
    for size in (1024, 65536, 1 << 22):
        t = 1.3 * collective_cost(op, size, shape).time_s * 1e6
        rows.append(f"{size:>12} {size // 4:>12}  float  none  -1  {t:9.2f}  0.00  0.00  0"
                    f"  {t:9.2f}  0.00  0.00  0")
    ranks = "".join(f"#  Rank {r} Group 0 Pid {r} on h device {r} [0x1] NVIDIA H100\n"
                    for r in range(8))
    path = tmp_path / f"{NCCL_TESTS_OPS[op]}.txt"
    path.write_text("# nThread 1 nGpus 1 minBytes 1024 maxBytes 4194304\n" + ranks
                    + "\n".join(rows) + "\n")
    assert read_nccl_tests(path).op == op
    profile = tmp_path / "p.json"
    assert _run(capsys, "calibrate", "--nccl-tests", str(path), "--topology", "dgx-h100",
                "-o", str(profile))[0] == 0
    saved = json.loads(profile.read_text())["nccl_tests"]
    assert op in saved["tables"] and len(saved["residuals"]) == 3
