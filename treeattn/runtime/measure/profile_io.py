"""Calibration profiles on disk, and where one was measured (host, CPU, versions).

Split from :mod:`~treeattn.testbed.calibration.calibrate` (which re-exports these names) so
that reading a profile does not need the microbenchmarks.
"""

from __future__ import annotations

import json
import os
import platform
import socket
from pathlib import Path

import torch

from treeattn import atomic
from treeattn.runtime.errors import RuntimeFailure

PROFILE_VERSION = 1


def machine_info() -> dict:
    """Where the profile was measured: host, CPU, versions."""
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "host": socket.gethostname(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def read_profile(path: str | os.PathLike) -> dict:
    """Load a profile written by :func:`write_profile`, checked by the simulator's
    :func:`~treeattn.sim.files.profiles.load_profile`; a one-line error if unreadable or
    invalid."""
    from treeattn.sim import SimError
    from treeattn.sim.files.profiles import load_profile

    try:
        return load_profile(Path(path))
    except SimError as exc:
        raise RuntimeFailure(str(exc)) from exc


def write_profile(profile: dict, path: str | os.PathLike) -> None:
    """Write ``profile`` as JSON atomically (strict JSON: no NaN or Infinity)."""
    atomic.write_text(path, json.dumps(profile, indent=2, allow_nan=False) + "\n")
