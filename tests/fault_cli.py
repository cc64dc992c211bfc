"""``python tests/fault_cli.py ARGS``: the treeattn CLI with a fault armed in one rank.

For the tests of lost and hung ranks. ``TREEATTN_FAULT_KILL=RANK:SECONDS`` makes that rank
SIGKILL itself that long after its job starts, ``TREEATTN_FAULT_STOP=RANK:SECONDS`` freezes
it by SIGSTOP (a hung rank). The hook wraps the launcher's ``run_in_group`` when this file is
run: the launcher starts its ranks by ``spawn``, which runs this file again (as
``__mp_main__``) in every rank before the rank's job, and a rank started torchrun-style
(``RANK`` set) runs the CLI in this very process. Importing the file (the tests take its
names) changes nothing.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's treeattn

from treeattn.runtime import launch  # noqa: E402

FAULT_ENV = "TREEATTN_FAULT_KILL"
FAULT_STOP_ENV = "TREEATTN_FAULT_STOP"
SCRIPT = str(Path(__file__).resolve())


def arm_fault(rank: int) -> None:
    """Start the timer of each fault the environment names for ``rank``."""
    for env, sig in ((FAULT_ENV, signal.SIGKILL), (FAULT_STOP_ENV, signal.SIGSTOP)):
        victim, _, delay = os.environ.get(env, "").partition(":")
        if victim and int(victim) == rank:
            timer = threading.Timer(float(delay or 0), os.kill, args=(os.getpid(), sig))
            timer.daemon = True
            timer.start()


def _with_fault(run_in_group):
    def run(job, options):
        def armed(ctx):
            arm_fault(ctx.rank)
            return job(ctx)

        return run_in_group(armed, options)

    return run


if __name__ in ("__main__", "__mp_main__"):  # run as the CLI, or as a rank it spawned;
    launch.run_in_group = _with_fault(launch.run_in_group)  # never when merely imported

if __name__ == "__main__":
    from treeattn.cli import main

    sys.exit(main())
