"""A hung (SIGSTOPped) or dead rank is named within ``--timeout`` + about 2 s, exit status 1.

Both commands that launch local ranks are covered: ``run`` and ``generate`` (which used to
exit 2, "bad input", for a dead rank and to wait a fixed 180 s for a hung one). The clock
starts when the fault fires, found by watching the launcher's descendants in ``/proc``, so
the process start-up and the model load do not count. The bounds carry generous slack: a
test must not assert tight wall-clock values on a shared machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from treeattn.runtime.launch import FAULT_ENV, FAULT_STOP_ENV

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")

TIMEOUT_S = 10
SLACK_S = 8  # over the promised timeout + 2 s: scheduling on a loaded 2-core machine
CLI = [sys.executable, "-m", "treeattn.cli"]
RUN = CLI + ["run", "--nproc", "2", "--seq-len", "2048", "--heads", "4", "--kv-heads", "2",
             "--head-dim", "16", "--algorithm", "tree", "--steps", "1000000", "--warmup", "0",
             "--no-reference", "--timeout", str(TIMEOUT_S)]
GENERATE = CLI + ["generate", "--nproc", "2", "--model", "debug", "--prompt", "hello",
                  "--max-new-tokens", "4000", "--timeout", str(TIMEOUT_S)]


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        parent = todo.pop()
        try:
            text = Path(f"/proc/{parent}/task/{parent}/children").read_text()
        except OSError:
            continue
        kids = [int(x) for x in text.split()]
        out += kids
        todo += kids
    return out


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def _run_until_fault(argv: list[str], env: dict, fault: str) -> tuple[subprocess.Popen, float]:
    """Start ``argv``; return it and the moment a descendant stopped (or one vanished)."""
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    end = time.monotonic() + 120
    seen: set[int] = set()
    while time.monotonic() < end and proc.poll() is None:
        kids = _descendants(proc.pid)
        if fault == "stop" and any(_state(k) == "T" for k in kids):
            return proc, time.monotonic()
        gone = seen - set(kids) or any(_state(k) == "Z" for k in kids)
        if fault == "kill" and gone:
            return proc, time.monotonic()
        seen |= set(kids)
        time.sleep(0.05)
    proc.kill()
    raise AssertionError(f"the fault never fired: {proc.communicate()[1]}")


def _assert_named(proc: subprocess.Popen, fired: float, prefix: str) -> None:
    """The command ends with exit 1 and one ``error:`` line starting with ``prefix``, within
    the timeout + 2 s (+ slack) of the fault."""
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    took = time.monotonic() - fired
    assert proc.returncode == 1, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(prefix), err
    assert took < TIMEOUT_S + 2 + SLACK_S, (took, err)


def _env(var: str, spec: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in (FAULT_ENV, FAULT_STOP_ENV)}
    return dict(env, **{var: spec})


@pytest.mark.timeout(180)
@pytest.mark.parametrize("argv", [RUN, GENERATE], ids=["run", "generate"])
def test_stopped_rank_is_named_within_the_timeout(argv) -> None:
    proc, fired = _run_until_fault(argv, _env(FAULT_STOP_ENV, "1:2"), "stop")
    _assert_named(proc, fired, "error: rank 1 stopped answering")


@pytest.mark.timeout(180)
def test_generate_dead_rank_is_exit_1_not_bad_input() -> None:
    proc, fired = _run_until_fault(GENERATE, _env(FAULT_ENV, "1:2"), "kill")
    _assert_named(proc, fired, "error: rank 1 died")


@pytest.mark.parametrize("value", ["nan", "inf", "1e-9", "0", "-3", "1e300"])
def test_insane_timeouts_are_refused(value, capsys) -> None:
    from treeattn.cli import main

    for argv in (["run", "--nproc", "2", "--seq-len", "64"],
                 ["generate", "--model", "debug", "--prompt", "hi"]):
        assert main(argv + ["--timeout", value]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: --timeout must be a finite number"), err
