"""Outputs are atomic: a failed write leaves the previous output whole and says why in one line.

The file-size limit (RLIMIT_FSIZE) is how these tests make a real write fail part-way, the way
a full disk does; it is set in a child process so the test runner itself is unaffected.
"""

from __future__ import annotations

import json
import os
import stat
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


# -- nothing already at the path is destroyed ---------------------------------------------

def test_fifo_target_is_written_in_place_or_refused_never_replaced(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(OutputError, match="FIFO with no reader"):
        atomic.write_text(fifo, "x")  # nobody reads: refused, not waited on
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        atomic.write_text(fifo, "through the pipe")
        assert os.read(reader, 100) == b"through the pipe"
    finally:
        os.close(reader)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pipe"]


def _device_like(tmp_path: Path, name: str, major: int, minor: int) -> Path:
    node = tmp_path / name
    try:
        os.mknod(node, 0o666 | stat.S_IFCHR, os.makedev(major, minor))
    except (PermissionError, OSError) as exc:
        pytest.skip(f"cannot make a device node here: {exc}")
    return node


def test_a_device_node_is_written_through_and_stays_a_device(tmp_path):
    null = _device_like(tmp_path, "null", 1, 3)  # the numbers of /dev/null
    atomic.write_text(null, "discarded")
    with atomic.atomic_path(null) as tmp:
        assert tmp == null  # a writer that wants a name gets the device itself
    assert stat.S_ISCHR(os.stat(null).st_mode)
    full = _device_like(tmp_path, "full", 1, 7)  # /dev/full: every write fails ENOSPC
    with pytest.raises(OutputError, match="cannot write"):
        atomic.write_text(full, "no room")
    assert stat.S_ISCHR(os.stat(full).st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full", "null"]


def test_plan_to_a_device_like_target_keeps_the_device(tmp_path, capsys):
    from treeattn.cli import main

    full = _device_like(tmp_path, "full", 1, 7)
    code = main(["plan", "--topology", "local:ranks=2", "--model", "debug", "--seq-len", "64",
                 "-o", str(full)])
    assert code == 2 and "cannot write" in capsys.readouterr().err
    assert stat.S_ISCHR(os.stat(full).st_mode)


def test_read_only_target_is_refused_even_as_root(tmp_path):
    kept = tmp_path / "kept.json"
    kept.write_text("precious")
    kept.chmod(0o444)
    with pytest.raises(OutputError, match="read-only"):
        atomic.write_text(kept, "new")
    with pytest.raises(OutputError, match="read-only"):
        atomic.check_output_path(kept)
    assert kept.read_text() == "precious"


def _links(tmp_path: Path) -> dict[str, Path]:
    """A link to a file, a dangling link, and one link of a two-link loop."""
    real = tmp_path / "real.json"
    real.write_text("old")
    (tmp_path / "link.json").symlink_to(real)
    (tmp_path / "dangling.json").symlink_to(tmp_path / "nowhere.json")
    (tmp_path / "loop_a").symlink_to(tmp_path / "loop_b")
    (tmp_path / "loop_b").symlink_to(tmp_path / "loop_a")
    return {"to a file": tmp_path / "link.json", "dangling": tmp_path / "dangling.json",
            "loop": tmp_path / "loop_a"}


@pytest.mark.parametrize("kind", ["to a file", "dangling", "loop"])
def test_a_symbolic_link_is_refused_and_left_as_it_was(tmp_path, kind):
    link = _links(tmp_path)[kind]
    before = os.readlink(link)
    for write in (lambda: atomic.write_text(link, "new"),
                  lambda: atomic.check_output_path(link, folder=True)):
        with pytest.raises(OutputError, match="symbolic link"):
            write()
    assert link.is_symlink() and os.readlink(link) == before
    assert (tmp_path / "real.json").read_text() == "old"


@pytest.mark.parametrize("path", ["", " "])
def test_an_empty_path_is_refused(path):
    with pytest.raises(OutputError, match="an empty path"):
        atomic.write_text(path, "new")
    with pytest.raises(OutputError, match="an empty path"):
        atomic.check_output_path(path, folder=True)


@pytest.mark.parametrize("output", ["loop", ""])
def test_plan_refuses_a_link_loop_or_an_empty_output_in_one_line(tmp_path, capsys, output):
    from treeattn.cli import main

    loop = _links(tmp_path)["loop"]
    path = str(loop) if output else ""
    code = main(["plan", "--topology", "local:ranks=2", "--model", "debug", "--seq-len", "64",
                 "-o", path])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: cannot write"), err
    assert os.path.islink(loop) and os.readlink(loop) == str(tmp_path / "loop_b")


def test_two_hard_links_of_one_file_are_one_output(tmp_path):
    first = tmp_path / "first.json"
    first.write_text("kept")
    os.link(first, tmp_path / "second.json")
    with pytest.raises(OutputError, match="two outputs name the same file"):
        atomic.check_distinct(first, tmp_path / "second.json")


def test_two_outputs_naming_one_file_are_refused_before_work(tmp_path, capsys):
    from treeattn.cli import main

    same = tmp_path / "same.json"
    code = main(["plan", "--topology", "local:ranks=2", "--model", "debug", "--seq-len", "64",
                 "-o", str(same), "--trace", str(tmp_path / "." / "same.json")])
    err = capsys.readouterr().err
    assert code == 2 and "two outputs name the same file" in err, err
    assert not same.exists()
    atomic.check_distinct(tmp_path / "a", None, tmp_path / "b")


@pytest.mark.parametrize("argv", [
    ["predict", "--topology", "local:ranks=2", "--model", "debug", "--seq-len", "64",
     "--trace", ""],
    ["run", "--nproc", "2", "--seq-len", "64", "--trace", ""],
    ["calibrate", "--nproc", "2", "-o", ""],
])
def test_an_empty_output_flag_is_refused_not_dropped(argv, capsys):
    from treeattn.cli import main

    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == ["error: cannot write '': an empty path"], err
