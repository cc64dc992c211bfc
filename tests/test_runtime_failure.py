"""A rank that dies mid-run stops the whole group with an error naming it; nothing hangs.

Two paths: our launcher (``treeattn run --nproc``), which watches its children, and a
torchrun-style start (``RANK``/``WORLD_SIZE`` set by hand, no launcher watching), where the
surviving rank must notice by itself through its timeouts and heartbeats.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from fault_cli import FAULT_ENV, SCRIPT

from treeattn.runtime.launch import free_port

# A run of 10^6 steps never ends by itself here: that it ends at all, with the right error,
# is what stopping the group means. This guard only turns a hang into a failure.
HARD_TIMEOUT_S = 120
RUN = [sys.executable, SCRIPT, "run", "--seq-len", "2048", "--heads", "4",
       "--kv-heads", "2", "--head-dim", "16", "--algorithm", "tree", "--steps", "1000000",
       "--warmup", "0", "--timeout", "10", "--no-reference"]


@pytest.mark.timeout(180)
def test_launcher_stops_group_and_names_killed_rank() -> None:
    env = dict(os.environ, **{FAULT_ENV: "1:3"})  # rank 1 SIGKILLs itself 3 s after joining
    proc = subprocess.run(RUN + ["--nproc", "2"], env=env, capture_output=True, text=True,
                          timeout=HARD_TIMEOUT_S)
    assert proc.returncode not in (0, 2), proc.stderr  # a failure, not bad input
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: rank 1 died"), proc.stderr


@pytest.mark.timeout(180)
def test_surviving_rank_stops_by_itself_without_the_launcher() -> None:
    port = free_port()
    base = dict(os.environ, WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                GLOO_SOCKET_IFNAME="lo")
    base.pop(FAULT_ENV, None)
    procs = []
    for rank in (0, 1):
        env = dict(base, RANK=str(rank), LOCAL_RANK=str(rank))
        if rank == 1:
            env[FAULT_ENV] = "1:3"
        procs.append(subprocess.Popen(RUN, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    try:
        procs[1].wait(timeout=HARD_TIMEOUT_S)
        _, err = procs[0].communicate(timeout=HARD_TIMEOUT_S)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert procs[1].returncode == -9
    assert procs[0].returncode == 1, err
    last = err.strip().splitlines()[-1]
    # noticed by a broken connection or by its own bounded wait (--timeout 10), never later
    assert last.startswith("error: rank 0:") and "rank 1" in last, err
    assert "timed out" not in last or "after 10s" in last, err
