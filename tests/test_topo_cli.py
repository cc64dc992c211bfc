"""`treeattn topo show|import|draw`: outputs, and one-line errors with exit status 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from treeattn.cli import main
from treeattn.commands.topo import demo_section
from treeattn.topo import Topology

FIX = Path(__file__).parent / "fixtures"


def run(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse usage errors exit from inside the parser
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def test_show_json_contract(capsys):
    code, out, err = run(capsys, "topo", "show", "dgx-h100:nodes=2", "--json")
    assert code == 0 and err == ""
    data = json.loads(out)
    assert data["gpus"] == 16 and data["hosts"] == 2
    assert data["links"]["nvlink"] == 2 * 8 * 18 and data["links"]["ib"] == 16
    bw, lat = data["bandwidth"], data["latency"]
    assert len(bw) == len(lat) == 16 and all(len(row) == 16 for row in bw + lat)
    assert all(bw[i][i] == 0 and lat[i][i] == 0 for i in range(16))
    assert bw[0][1] == pytest.approx(450e9) and bw[0][9] == pytest.approx(50e9)
    assert 0 < lat[0][1] < lat[0][9]


def test_show_table(capsys):
    code, out, _ = run(capsys, "topo", "show", "pcie-4090:gpus=4")
    assert code == 0 and "RTX4090" in out and "pcie" in out


def test_import_then_show(capsys, tmp_path):
    out_json = tmp_path / "a100.json"
    code, out, _ = run(capsys, "topo", "import", str(FIX / "nvsmi-8xa100-sxm40g-10nic.txt"),
                       "-o", str(out_json))
    assert code == 0 and out_json.exists()
    t = Topology.load(out_json)
    assert t == Topology.load(FIX / "nvsmi-8xa100-sxm40g-10nic.txt")
    code, out, _ = run(capsys, "topo", "show", str(out_json), "--json")
    assert code == 0 and json.loads(out)["gpus"] == 8


def test_import_with_format_and_gpu(capsys, tmp_path):
    out_json = tmp_path / "mi300a.json"
    code, _, _ = run(capsys, "topo", "import", str(FIX / "rocmsmi-4xmi300a-apu-xgmi.txt"),
                     "--format", "rocm-smi", "--gpu", "MI300A", "-o", str(out_json))
    assert code == 0 and Topology.load(out_json).gpu_model(0) == "MI300A"


def test_draw_writes_png(capsys, tmp_path):
    png = tmp_path / "dgx.png"
    code, _, _ = run(capsys, "topo", "draw", "dgx-h100:nodes=2", "-o", str(png))
    assert code == 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _bad_inputs(tmp: Path) -> list[list[str]]:
    (tmp / "empty.txt").write_text("")
    (tmp / "trunc.txt").write_text((FIX / "nvsmi-8xa100-sxm40g-10nic.txt").read_text()[:300])
    (tmp / "garbled.xml").write_text("<system><cpu><pci busid=")
    (tmp / "junk.bin").write_bytes(b"\xff\xfe\x00garbage")
    t = Topology.from_spec("local:ranks=2")
    data = json.loads(t.to_json())
    data["links"] = []
    (tmp / "disconnected.json").write_text(json.dumps(data))
    return [
        ["topo", "show", str(tmp / "missing.txt")],
        ["topo", "show", str(tmp / "empty.txt")],
        ["topo", "show", str(tmp / "trunc.txt")],
        ["topo", "show", str(tmp / "garbled.xml")],
        ["topo", "show", str(tmp / "junk.bin")],
        ["topo", "show", str(tmp / "disconnected.json")],
        ["topo", "show", "nope"],
        ["topo", "show", "dgx-h100:nodes=0", "--json"],
        ["topo", "show", "pcie-4090:gpus=3"],
        ["topo", "show", "mi300x", "--format", "yaml"],
        ["topo", "import", "dgx-h100", "-o", str(tmp / "x.json")],
        ["topo", "import", str(tmp / "empty.txt"), "-o", str(tmp / "x.json")],
        ["topo", "import", str(FIX / "nvsmi-8xa100-sxm40g-10nic.txt"), "--gpu", "Voodoo2",
         "-o", str(tmp / "x.json")],
        ["topo", "import", str(FIX / "nvsmi-8xa100-sxm40g-10nic.txt"),
         "-o", str(tmp / "no" / "dir" / "x.json")],
        ["topo", "draw", "nope", "-o", str(tmp / "x.png")],
        ["topo", "draw", "mi300x", "-o", str(tmp / "no" / "x.png")],
        ["topo", "import", str(FIX / "nvsmi-8xa100-sxm40g-10nic.txt")],
    ]


def test_bad_input_is_one_line_and_exit_2(capsys, tmp_path):
    for argv in _bad_inputs(tmp_path):
        code, out, err = run(capsys, *argv)
        assert code == 2, argv
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error:"), (argv, err)
        assert "Traceback" not in err


def test_show_json_refuses_huge_matrices(capsys, monkeypatch):
    import treeattn.commands.topo as topo_cmd

    monkeypatch.setattr(topo_cmd, "MAX_JSON_GPUS", 8)
    code, out, err = run(capsys, "topo", "show", "dgx-h100:nodes=2", "--json")
    assert code == 2 and out == "" and err.startswith("error:") and "16 GPUs" in err


def test_bad_input_through_a_real_process(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "treeattn.cli", "topo", "show", "dgx-h100:nodes=0"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("error:") and len(proc.stderr.strip().splitlines()) == 1


def test_demo_section_prints_builtins():
    console = Console(record=True, width=120)
    assert demo_section(console) == 0
    text = console.export_text()
    for spec in ("dgx-h100:nodes=16", "mi300x", "pcie-4090:gpus=8"):
        assert spec in text
    assert "450" in text and "64" in text
