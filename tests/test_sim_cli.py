"""`treeattn predict` / `treeattn plan`: the JSON contract and one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rich.console import Console

from treeattn.cli import main
from treeattn.schedule.algorithms import ALGORITHM_NAMES


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_predict_json_contract(capsys):
    code, out, _ = run(capsys, "predict", "--topology", "mi300x", "--model", "llama-3.1-8b",
                       "--seq-len", "32768", "--seq-len", "131072", "--json")
    assert code == 0
    rows = json.loads(out)["rows"]
    one_host = {"hier"}  # oneshot on one host: not a candidate there
    assert {(r["seq_len"], r["algorithm"]) for r in rows} == {
        (s, a) for s in (32768, 131072) for a in (*ALGORITHM_NAMES, "pick")
        if a not in one_host}
    for r in rows:
        assert {"topology", "gpus", "model", "seq_len", "algorithm", "system", "layout",
                "latency_s", "token_latency_s", "comm_bytes", "peak_memory_bytes",
                "speedup_vs_best_baseline", "best_baseline", "speedup_vs_ring"} <= set(r)
        assert r["gpus"] == 8 and r["token_latency_s"] == pytest.approx(32 * r["latency_s"])
    by = {(r["seq_len"], r["algorithm"]): r for r in rows}
    assert by[(131072, "ring")]["speedup_vs_ring"] == pytest.approx(1.0)
    assert by[(131072, "tree")]["speedup_vs_ring"] > 1
    pick = by[(131072, "pick")]
    assert pick["latency_s"] == min(r["latency_s"] for r in rows if r["seq_len"] == 131072)
    assert pick["speedup_vs_best_baseline"] >= 1.0  # the planner never picks a slower plan
    # ring moves KV, the tree partials: ring's volume grows 4x with the context, the tree's not
    assert by[(131072, "ring")]["comm_bytes"] == 4 * by[(32768, "ring")]["comm_bytes"]
    assert by[(131072, "tree")]["comm_bytes"] == by[(32768, "tree")]["comm_bytes"]


def test_predict_table(capsys):
    code, out, _ = run(capsys, "predict", "--topology", "pcie-4090:gpus=2", "--model", "debug",
                       "--seq-len", "64")
    assert code == 0 and "ring" in out


def test_plan_json_and_art(capsys):
    code, out, _ = run(capsys, "plan", "--topology", "dgx-h100:nodes=2", "--model",
                       "llama-3.1-8b", "--seq-len", "65536", "--json")
    assert code == 0
    d = json.loads(out)
    assert {"algorithm", "tree", "latency_s", "candidates"} <= set(d)
    assert d["latency_s"] == min(c["latency_s"] for c in d["candidates"])
    if d["tree"] is not None:
        assert d["tree"]["parent"][d["tree"]["root"]] == -1
    code, out, _ = run(capsys, "plan", "--topology", "dgx-h100:nodes=2", "--model",
                       "llama-3.1-8b", "--seq-len", "65536")
    assert code == 0 and "└── " in out


@pytest.mark.parametrize("argv, message", [
    (("--model", "gpt-9", "--seq-len", "100"), "unknown model"),
    (("--model", "debug", "--seq-len", "0"), "seq_len must be positive"),
    (("--model", "debug", "--seq-len", "-5"), "seq_len must be positive"),
    (("--model", "debug", "--seq-len", "4"), "smaller than the number of GPUs"),
])
@pytest.mark.parametrize("command", ["predict", "plan"])
def test_bad_input_is_one_line_exit_2(capsys, command, argv, message):
    code, out, err = run(capsys, command, "--topology", "mi300x", *argv)
    assert code == 2
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


def test_single_gpu_topology_is_refused(capsys):
    code, _, err = run(capsys, "plan", "--topology", "local:ranks=1", "--model", "debug",
                       "--seq-len", "64")
    assert code == 2 and "one GPU" in err and err.count("\n") == 1


def test_demo_section_prints_speedups(monkeypatch):
    from treeattn.commands import predict

    rows = predict.demo_speedups()  # every demo point simulated: computed once, printed below
    assert len(rows) == 4 * 3
    # the pick is never slower than the strongest baseline, and always beats pass-KV ring
    assert all(r["vs_baseline"] >= 1.0 and r["vs_ring"] > 1 for r in rows)
    # where a baseline is the pick, the row says so (same name, 1.00x)
    assert all(r["pick"] == r["baseline"] for r in rows if r["vs_baseline"] == 1.0)
    monkeypatch.setattr(predict, "demo_speedups", lambda: rows)
    console = Console(record=True, width=160)
    assert predict.demo_section(console) == 0
    text = console.export_text()
    assert "1,048,576" in text and all(r["pick"] in text for r in rows)


@pytest.mark.parametrize("gpu", ["A6000", "RTX3090"])
def test_plan_on_an_imported_box_of_any_named_gpu(capsys, tmp_path, gpu):
    """Every GPU model the topology can name has a hardware model (the one GPU table)."""
    fixture = Path(__file__).parent / "fixtures" / "nvsmi-4xrtx3090-nv4-pairs-aikitoria-pr18.txt"
    out = tmp_path / "box.json"
    assert run(capsys, "topo", "import", str(fixture), "--gpu", gpu, "-o", str(out))[0] == 0
    code, stdout, _ = run(capsys, "plan", "--topology", str(out), "--model", "llama-3.1-8b",
                          "--seq-len", "8192", "--json")
    assert code == 0, stdout
    assert json.loads(stdout)["latency_s"] > 0


def test_every_topology_gpu_model_has_a_hardware_model():
    from treeattn.sim.devices import hardware_for
    from treeattn.topo.hardware import GPU_SPECS

    for name in GPU_SPECS:
        assert hardware_for(name).name == name
