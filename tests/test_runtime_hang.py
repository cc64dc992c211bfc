"""A hung (SIGSTOPped) or dead rank is named, exit status 1: a hung one by the launcher's
watchdog after ``--timeout`` seconds of silence, which the error states, a dead one as died.

Both commands that launch local ranks are covered: ``run`` and ``generate`` (which used to
exit 2, "bad input", for a dead rank and to wait a fixed 180 s for a hung one). The fault is
seen firing by watching the launcher's descendants in ``/proc``. Nothing reads the clock:
the bound is the mechanism (the watchdog's timeout, named in the message); a command that
hangs instead fails on the guard's 60 s.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fault_cli import FAULT_ENV, FAULT_STOP_ENV, SCRIPT

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")

TIMEOUT_S = 10
HANG_GUARD_S = 60  # turns a hang into a failure; nothing asserts how long it took
CLI = [sys.executable, SCRIPT]  # the CLI with a fault armed in one rank
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


def _run_until_fault(argv: list[str], env: dict, fault: str) -> subprocess.Popen:
    """Start ``argv``; return it once a descendant stopped (or one vanished)."""
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    end = time.monotonic() + 120
    seen: set[int] = set()
    while time.monotonic() < end and proc.poll() is None:
        kids = _descendants(proc.pid)
        if fault == "stop" and any(_state(k) == "T" for k in kids):
            return proc
        gone = seen - set(kids) or any(_state(k) == "Z" for k in kids)
        if fault == "kill" and gone:
            return proc
        seen |= set(kids)
        time.sleep(0.05)
    proc.kill()
    raise AssertionError(f"the fault never fired: {proc.communicate()[1]}")


def _assert_named(proc: subprocess.Popen, prefix: str) -> None:
    """The command ends with exit 1 and one ``error:`` line starting with ``prefix``."""
    try:
        _, err = proc.communicate(timeout=HANG_GUARD_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(prefix), err


def _env(var: str, spec: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in (FAULT_ENV, FAULT_STOP_ENV)}
    return dict(env, **{var: spec})


@pytest.mark.timeout(180)
@pytest.mark.parametrize("argv", [RUN, GENERATE], ids=["run", "generate"])
def test_stopped_rank_is_named_within_the_timeout(argv) -> None:
    proc = _run_until_fault(argv, _env(FAULT_STOP_ENV, "1:2"), "stop")
    _assert_named(proc, f"error: rank 1 stopped answering for {TIMEOUT_S}s")


@pytest.mark.timeout(180)
def test_generate_dead_rank_is_exit_1_not_bad_input() -> None:
    proc = _run_until_fault(GENERATE, _env(FAULT_ENV, "1:2"), "kill")
    _assert_named(proc, "error: rank 1 died")


@pytest.mark.parametrize("value", ["nan", "inf", "1e-9", "0", "-3", "1e300"])
def test_insane_timeouts_are_refused(value, capsys) -> None:
    from treeattn.cli import main

    for argv in (["run", "--nproc", "2", "--seq-len", "64"],
                 ["generate", "--model", "debug", "--prompt", "hi"]):
        assert main(argv + ["--timeout", value]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: --timeout must be a finite number"), err
