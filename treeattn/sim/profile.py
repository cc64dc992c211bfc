"""Calibration profiles: measured gloo costs on this machine, turned into sim models.

``treeattn calibrate`` (the runtime) writes a JSON profile, schema version 1::

    {"version": 1, "backend": "gloo", "world": N, "cores": C,
     "p2p": {"latency_s": α, "bandwidth_Bps": β, "sizes": [...], "times_s": [...]},
     "allreduce": {"latency_s": ..., "sizes": [...], "times_s": [...]},
     "attention": {"bandwidth_Bps": ..., "launch_s": ..., "threads_per_rank": 1},
     "machine": {...}}

How α is split (so that latency is counted once): the one-way small-message time α of the
ping-pong fit ``t(n) = α + n/β`` is all software on loopback, so it goes to the backend as
``send_s = recv_s = α/2``, and the ``local`` topology gets link latency 0 and bandwidth β.
A message then costs ``α/2 + 0 + n/β + α/2 = α + n/β`` on its 2-hop loopback route
(cut-through: the bottleneck bandwidth is paid once, see :mod:`treeattn.sim.network`).

Which bandwidth the links get: on loopback every byte of a message is copied by a CPU core,
so when every rank sends at once (a ring step) each message gets less than a lone ping-pong
message does. When the profile has an ``exchange`` section (all ranks send to ``r+1`` and
receive from ``r−1`` at once, a microbenchmark like the others), its per-message bandwidth is
the link bandwidth; otherwise the ping-pong β is. Small messages (tree partials) are priced
by α and hardly notice the difference.

Core sharing: compute runs on ``cores // threads_per_rank`` servers shared by all ranks of the
host (:class:`~treeattn.sim.hardware.HardwareModel` ``cores``), so with more ranks than
cores the simulated compute queues, as the real processes do.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from treeattn.sim.backend import BackendModel
from treeattn.sim.errors import SimError
from treeattn.sim.hardware import HardwareModel

VERSION = 1
# Decode attention on a CPU is memory-bound; when the profile has no FLOP rate we take one
# that never binds (1 FLOP per byte of bandwidth ×1000).
FLOPS_PER_BYTE_UNBOUND = 1000.0


def _positive(profile: dict, section: str, key: str, allow_zero: bool = False) -> float:
    try:
        value = float(profile[section][key])
    except (KeyError, TypeError, ValueError):
        raise SimError(f"calibration profile: missing or non-numeric {section}.{key}") from None
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise SimError(f"calibration profile: {section}.{key} = {value} is not positive")
    return value


def load_profile(source: str | Path | dict) -> dict:
    """Read and check a calibration profile (a path or an already-parsed dict).

    >>> p = load_profile({"version": 1, "backend": "gloo", "world": 2, "cores": 4,
    ...                   "p2p": {"latency_s": 3e-5, "bandwidth_Bps": 2e9},
    ...                   "attention": {"bandwidth_Bps": 1e10, "launch_s": 1e-5}})
    >>> p["world"]
    2
    """
    if isinstance(source, dict):
        profile = source
    else:
        try:
            profile = json.loads(Path(source).read_text())
        except (OSError, ValueError) as exc:
            raise SimError(f"cannot read calibration profile {source}: {exc}") from None
    if not isinstance(profile, dict) or profile.get("version") != VERSION:
        raise SimError(f"calibration profile must be a JSON object with version {VERSION}")
    for key in ("world", "cores"):
        if not isinstance(profile.get(key), int) or profile[key] < 1:
            raise SimError(f"calibration profile: {key} must be a positive integer")
    _positive(profile, "p2p", "latency_s", allow_zero=True)
    _positive(profile, "p2p", "bandwidth_Bps")
    _positive(profile, "attention", "bandwidth_Bps")
    _positive(profile, "attention", "launch_s", allow_zero=True)
    return profile


def hardware_from_profile(profile: dict) -> HardwareModel:
    """The ``cpu`` model: memory bandwidth and launch from the attention calibration."""
    profile = load_profile(profile)
    attention = profile["attention"]
    bandwidth = float(attention["bandwidth_Bps"])
    flops = float(attention.get("flops_per_s", bandwidth * FLOPS_PER_BYTE_UNBOUND))
    threads = max(1, int(attention.get("threads_per_rank", 1)))
    return HardwareModel("cpu", bandwidth, flops, float(attention["launch_s"]),
                         cores=max(1, profile["cores"] // threads))


def backend_from_profile(profile: dict) -> BackendModel:
    """gloo with the measured α split evenly between sender and receiver."""
    profile = load_profile(profile)
    alpha = float(profile["p2p"]["latency_s"])
    return BackendModel(str(profile.get("backend", "gloo")), alpha / 2, alpha / 2)


def link_bandwidth(profile: dict) -> float:
    """The per-message bandwidth under concurrent traffic when calibrated, else ping-pong β."""
    if isinstance(profile.get("exchange"), dict) and "bandwidth_Bps" in profile["exchange"]:
        return _positive(profile, "exchange", "bandwidth_Bps")
    return _positive(profile, "p2p", "bandwidth_Bps")


def topology_from_profile(profile: dict, world: int | None = None):
    """A ``local`` topology of ``world`` ranks with latency 0 and the measured bandwidth."""
    from treeattn.topo import Topology

    profile = load_profile(profile)
    world = int(world or profile["world"])
    beta = link_bandwidth(profile)
    return Topology.from_spec(f"local:ranks={world},latency=0,bandwidth={beta!r}")
