"""Outputs are atomic: a failed write leaves the previous output whole and says why in one line.

The file-size limit (RLIMIT_FSIZE) is how these tests make a real write fail part-way, the way
a full disk does; it is set in a child process so the test runner itself is unaffected.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from treeattn import atomic
from treeattn.atomic import OutputError

pytestmark = pytest.mark.timeout(120)

FIXTURES = Path(__file__).parent / "fixtures"


def test_write_replaces_whole_file_and_leaves_no_temporaries(tmp_path):
    target = tmp_path / "out.json"
    target.write_text("old")
    atomic.write_text(target, "new content")
    assert target.read_text() == "new content"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]


def test_exception_while_producing_keeps_previous_file(tmp_path):
    target = tmp_path / "plot.png"
    target.write_bytes(b"previous picture")
    with pytest.raises(RuntimeError, match="boom"):
        with atomic.atomic_path(target) as tmp:
            tmp.write_bytes(b"half a pic")
            raise RuntimeError("boom")
    assert target.read_bytes() == b"previous picture"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plot.png"]


def test_missing_folder_and_directory_target_are_one_line_errors(tmp_path):
    with pytest.raises(OutputError, match="no such directory"):
        atomic.write_text(tmp_path / "nope" / "x.json", "{}")
    with pytest.raises(OutputError, match="is a directory"):
        atomic.write_text(tmp_path, "{}")
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputError, match="a file of that name exists"):
        atomic.check_output_path(tmp_path / "file", folder=True)


def test_folder_swap_replaces_all_or_nothing(tmp_path):
    out = tmp_path / "sweep"
    out.mkdir()
    (out / "results.csv").write_text("old table")
    (out / "plot.png").write_text("old plot")
    with pytest.raises(KeyboardInterrupt):
        with atomic.atomic_folder(out) as staging:
            (staging / "results.csv").write_text("new table")
            raise KeyboardInterrupt  # interrupted before the plots
    assert {p.name: p.read_text() for p in out.iterdir()} == {
        "results.csv": "old table", "plot.png": "old plot"}
    with atomic.atomic_folder(out) as staging:
        (staging / "results.csv").write_text("new table")
    assert {p.name: p.read_text() for p in out.iterdir()} == {"results.csv": "new table"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sweep"]


def _run_limited(code: str, limit_bytes: int, cwd: Path) -> subprocess.CompletedProcess:
    """Run ``code`` in a child whose files may not grow past ``limit_bytes``."""
    prologue = textwrap.dedent(f"""
        import resource, sys
        resource.setrlimit(resource.RLIMIT_FSIZE, ({limit_bytes}, {limit_bytes}))
    """)
    return subprocess.run([sys.executable, "-c", prologue + textwrap.dedent(code)], cwd=cwd,
                          capture_output=True, text=True, timeout=100)


def test_file_size_limit_keeps_previous_file(tmp_path):
    target = tmp_path / "big.bin"
    target.write_bytes(b"x" * 100)
    result = _run_limited(f"""
        from treeattn import atomic
        from treeattn.atomic import OutputError
        try:
            atomic.write_bytes({str(target)!r}, b"y" * 100_000)
        except OutputError as exc:
            print("ERR", exc)
    """, 4096, tmp_path)
    assert "ERR cannot write" in result.stdout, result.stderr
    assert target.read_bytes() == b"x" * 100
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.bin"]


def test_topo_import_under_file_size_limit_keeps_old_output(tmp_path):
    """`topo import -o` that cannot finish its write: one error line, old file untouched."""
    old = tmp_path / "box.json"
    old.write_text('{"previous": true}')
    sample = FIXTURES / "nvsmi-8xa100-sxm40g-10nic.txt"
    result = _run_limited(f"""
        from treeattn.cli import main
        sys.exit(main(["topo", "import", {str(sample)!r}, "-o", {str(old)!r}]))
    """, 2048, tmp_path)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: cannot write"), result.stderr
    assert json.loads(old.read_text()) == {"previous": True}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["box.json"]


def test_sweep_output_checked_before_work(tmp_path, capsys):
    from treeattn.cli import main

    code = main(["sweep", "--topology", "mi300x", "--seq-len", "32k",
                 "-o", str(tmp_path / "missing" / "out")])
    assert code == 2
    assert "no such directory" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "missing")
