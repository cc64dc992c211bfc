"""Two runs on one host at the same moment, and what a killed run leaves behind.

Two ``treeattn run --nproc 2`` and two ``treeattn generate --nproc 2`` started together by the
same user must not collide (store ports, shared-memory segments, temporary folders, the
compiled-kernel cache), and both must give the right answer: the run's partials against the
exact reference, the generation against one process (``--verify``). Twenty tries of each
are ``benchmarks/concurrent_runs.py``; the suite runs one. A shared-memory segment left by
a SIGKILLed run (its creator dead) is removed by the next run; segments of live processes
and files of other names are left alone.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import pytest

from treeattn.testbed.transport import shm

pytestmark = pytest.mark.timeout(240)
CLI = [sys.executable, "-m", "treeattn.cli"]
RUN = [*CLI, "run", "--nproc", "2", "--seq-len", "2048", "--heads", "4", "--kv-heads", "2",
       "--head-dim", "16", "--steps", "3", "--warmup", "1", "--timeout", "60", "--json"]
GENERATE = [*CLI, "generate", "--nproc", "2", "--model", "debug", "--prompt", "hello world",
            "--max-new-tokens", "4", "--verify", "--timeout", "60", "--json"]


def _together(argv: list[str], env: dict | None = None) -> list[tuple[int, str, str]]:
    """Start two copies of ``argv`` at once; their (exit code, stdout, stderr)."""
    procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env) for _ in range(2)]
    outputs = [p.communicate(timeout=200) for p in procs]
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, outputs, strict=True)]


def _rows_ok(out: str) -> bool:
    rows = json.loads(out)["rows"]
    return bool(rows) and all(r["max_abs_diff"] is not None and r["max_abs_diff"] < 1e-4
                              for r in rows)


def test_two_runs_started_together_both_succeed():
    results = _together(RUN)
    for code, out, err in results:
        assert code == 0, err[-2000:]
        assert _rows_ok(out), out[-2000:]


def test_two_generates_started_together_both_succeed():
    for code, out, err in _together(GENERATE):
        assert code == 0, err[-2000:]
        record = json.loads(out)
        assert record["identical_to_single_process"] is True and len(record["tokens"]) == 4


def _dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


@pytest.mark.skipif(not os.access(shm.SHM_DIR, os.W_OK)
                    or platform.machine().lower() not in ("x86_64", "amd64"),
                    reason="shared memory is used on x86-64 with a writable /dev/shm only")
def test_a_killed_runs_segment_is_removed_by_the_next_run():
    old = time.time() - 2 * shm.STALE_AFTER_S
    folder = Path(shm.SHM_DIR)
    stale = folder / f"treeattn-{_dead_pid()}-{'a' * 32}"  # a SIGKILLed run's: removed
    kept = [folder / f"treeattn-{os.getpid()}-{'b' * 32}",  # a live creator's
            folder / f"treeattn-{_dead_pid()}-{'c' * 31}",  # not our name
            folder / f"treeattn-{_dead_pid()}-{'d' * 32}"]  # a dead creator's, but new
    try:
        for path in (stale, *kept):
            path.write_bytes(b"\0" * 4096)
        for path in (stale, *kept[:2]):
            os.utime(path, (old, old))
        result = subprocess.run(RUN, capture_output=True, text=True, timeout=200, check=False)
        assert result.returncode == 0, result.stderr[-2000:]
        assert _rows_ok(result.stdout)
        assert not stale.exists()
        assert all(path.exists() for path in kept)
    finally:
        for path in (stale, *kept):
            path.unlink(missing_ok=True)
