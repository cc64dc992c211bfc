"""The sweep layer: grid expansion, per-point rows, the CLI's files and plots, bad input."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from matplotlib.image import imread

from treeattn.cli import main
from treeattn.schedule.algorithms import ALGORITHM_NAMES, BASELINES
from treeattn.sweep import plots
from treeattn.sweep.grid import SweepPoint, expand_grid, memory_rows, predict_point, with_nodes
from treeattn.topo import Topology


def _png_shape(path):
    return imread(str(path)).shape


def test_with_nodes_adds():
    assert with_nodes("mi300x", 2) == "mi300x:nodes=2"
    assert with_nodes("pcie-4090:gpus=4", 3) == "pcie-4090:gpus=4,nodes=3"


def test_expand_grid_is_the_full_product():
    points = expand_grid(["dgx-h100", "mi300x"], ["llama-3.1-8b"], [1024, 2048], [1, 2])
    assert len(points) == 2 * 2 * 2
    assert SweepPoint("mi300x:nodes=2", "llama-3.1-8b", 2048) in points


def test_point_rows_are_consistent():
    rows = predict_point(SweepPoint("dgx-h100:nodes=2", "llama-3.1-8b", 262144))
    by_algo = {r["algorithm"]: r for r in rows}
    assert set(by_algo) == {*ALGORITHM_NAMES, "pick"}
    assert by_algo["ring"]["speedup_vs_ring"] == pytest.approx(1.0)
    # Each row is its own algorithm; the pick is the fastest of them all.
    assert by_algo["tree"]["name"].startswith("tree/")
    assert by_algo["pick"]["latency_s"] == min(r["latency_s"] for r in rows)
    baselines = [by_algo[a] for a in BASELINES]
    fastest = min(baselines, key=lambda r: r["latency_s"])
    for row in rows:
        assert row["speedup_vs_best_baseline"] == pytest.approx(
            fastest["latency_s"] / row["latency_s"])
        assert row["best_baseline"] == fastest["name"]
        assert row["speedup_vs_ring"] == pytest.approx(
            by_algo["ring"]["latency_s"] / row["latency_s"])
        assert row["gpus"] == 16 and row["hosts"] == 2
        assert row["token_latency_s"] >= 32 * row["latency_s"] * (1 - 1e-12)  # 32 layers
    # Ring moves whole KV blocks, the tree moves partials: a long context separates them.
    assert by_algo["ring"]["comm_bytes"] > 100 * by_algo["tree"]["comm_bytes"]
    assert by_algo["ring"]["peak_memory_bytes"] > by_algo["tree"]["peak_memory_bytes"]


def test_memory_rows_grow_with_hidden_size():
    rows = memory_rows("mi300x", 65536, hidden_sizes=(1024, 4096))
    for algo in ("tree", "ring"):
        small, large = sorted((r["model_dim"], r["peak_memory_bytes"]) for r in rows
                              if r["algorithm"] == algo)
        # MHA: KV bytes are proportional to the hidden size, and they dominate memory.
        assert large[1] == pytest.approx(4 * small[1], rel=0.05)


def test_sweep_cli_writes_tables_and_plots(tmp_path, capsys):
    out = tmp_path / "sweep"
    status = main(["sweep", "--topology", "mi300x", "--topology", "dgx-h100", "--nodes", "1",
                   "--nodes", "2", "--seq-len", "32k", "--seq-len", "256k", "-o", str(out)])
    assert status == 0
    rows = json.loads((out / "results.json").read_text())["rows"]
    # topologies × nodes × lengths × (algorithms + the pick), but hier on the 2 × 2 points of
    # one host, where it is oneshot and not a candidate
    assert len(rows) == 2 * 2 * 2 * (len(ALGORITHM_NAMES) + 1) - 2 * 2
    with open(out / "results.csv") as handle:
        assert len(list(csv.DictReader(handle))) == len(rows)
    for name in ("latency_vs_seq_len", "speedup_vs_gpus", "memory_vs_hidden", "chosen_tree"):
        height, width, _ = _png_shape(out / f"{name}.png")
        assert height > 300 and width > 300


@pytest.mark.parametrize("argv, needle", [
    (["--model", "gpt-17"], "gpt-17"),
    (["--seq-len", "4"], "smaller"),
    (["--nodes", "0"], "nodes"),
    (["--topology", "nonsense-box"], "nonsense"),
])
def test_sweep_bad_input_is_one_line_exit_2(tmp_path, capsys, argv, needle):
    status = main(["sweep", "-o", str(tmp_path / "o"), "--seq-len", "64k", *argv])
    err = capsys.readouterr().err.strip()
    assert status == 2
    assert err.startswith("error:") and len(err.splitlines()) == 1
    assert needle in err


def test_sweep_refuses_a_file_as_output(tmp_path, capsys):
    target = tmp_path / "file"
    target.write_text("keep me")
    assert main(["sweep", "-o", str(target)]) == 2
    assert target.read_text() == "keep me"


def test_measured_plot_and_tree_plot(tmp_path):
    rows = [{"algorithm": a, "predicted_s": p, "measured_s": m}
            for a, p, m in (("tree", 1e-3, 1.1e-3), ("ring", 5e-3, 4e-3))]
    assert _png_shape(plots.measured_vs_predicted(rows, tmp_path / "m.png"))[0] > 300
    topology = Topology.from_spec("pcie-4090:gpus=4")
    path = plots.tree_over_topology(topology, [-1, 0, 0, 2], tmp_path / "t.png")
    assert _png_shape(path)[1] > 300


def test_geometric_mean():
    assert plots.geometric_mean([2.0, 8.0]) == pytest.approx(4.0)


@pytest.mark.timeout(300)
def test_sweep_measure_runs_for_real_and_plots(tmp_path):
    out = tmp_path / "measured"
    status = main(["sweep", "--measure", "--nproc", "2", "--seq-len", "4k",
                   "--algorithms", "tree", "ring", "--steps", "2", "-o", str(out)])
    assert status == 0
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert {r["algorithm"] for r in rows} == {"tree", "ring"}
    for row in rows:
        assert row["world"] == 2 and row["seq_len"] == 4096
        assert row["measured_s"] > 0 and row["predicted_s"] > 0
        assert row["max_abs_diff"] < 1e-4  # against single-process attention, fp32
    assert _png_shape(out / "measured_vs_predicted.png")[0] > 300


def test_predict_plan_and_sweep_take_topology_files(tmp_path, capsys):
    fixture = Path(__file__).parent / "fixtures" / "nvsmi-8xa100-sxm40g-10nic.txt"
    imported = tmp_path / "a100.json"
    assert main(["topo", "import", str(fixture), "-o", str(imported)]) == 0
    capsys.readouterr()
    for source in (str(imported), str(fixture)):
        assert main(["predict", "--topology", source, "--model", "llama-3.1-8b",
                     "--seq-len", "32k", "--json"]) == 0
        rows = json.loads(capsys.readouterr().out)["rows"]
        assert {r["gpus"] for r in rows} == {8}
    assert main(["plan", "--topology", str(imported), "--model", "llama-3.1-8b",
                 "--seq-len", "32k", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["latency_s"] > 0
    out = tmp_path / "sweep"
    assert main(["sweep", "--topology", str(imported), "--seq-len", "64k", "-o", str(out)]) == 0
    assert json.loads((out / "results.json").read_text())["rows"][0]["topology"] == "a100"
    assert main(["sweep", "--topology", str(imported), "--nodes", "2", "-o", str(out)]) == 2


def test_sweep_measure_needs_two_ranks_and_leaves_no_directory(tmp_path, capsys):
    out = tmp_path / "never"
    assert main(["sweep", "--measure", "--nproc", "1", "-o", str(out)]) == 2
    assert "--nproc" in capsys.readouterr().err
    assert not out.exists()


def test_nodes_that_contradict_the_spec_are_refused():
    from treeattn.sim import SimError
    from treeattn.sweep.grid import with_nodes

    assert with_nodes("dgx-h100:nodes=2", 2) == "dgx-h100:nodes=2"
    with pytest.raises(SimError, match="already sets nodes=2"):
        with_nodes("dgx-h100:nodes=2", 3)


def test_grid_has_batch_and_tp_dimensions():
    points = expand_grid(["dgx-h100"], ["llama-3.1-8b"], [4096], [2], batches=[1, 8], tp=8)
    assert [(p.batch, p.tp) for p in points] == [(1, 8), (8, 8)]
    rows = predict_point(points[1])
    assert {r["batch"] for r in rows} == {8} and {r["tp"] for r in rows} == {8}
    assert {r["gpus"] for r in rows} == {16}  # the whole cluster, though one CP group is planned
