"""Profiles of this host's CPU ranks turned into the simulator's models: the test bed's
reader (:class:`CpuProfiles`, a :class:`~treeattn.sim.files.profiles.HostProfiles`), which
:func:`treeattn.testbed.plug_in_profiles` plugs into the planner. Reading and checking a
profile, and a GPU cluster's nccl-tests profiles, are :mod:`treeattn.sim.files.profiles`'.

``treeattn calibrate`` (the runtime) writes a JSON profile, schema version 1::

    {"version": 1, "backend": "gloo", "world": N, "cores": C,
     "p2p": {"latency_s": α, "bandwidth_Bps": β, "sizes": [...], "times_s": [...]},
     "allreduce": {"latency_s": ..., "sizes": [...], "times_s": [...]},
     "attention": {"bandwidth_Bps": ..., "launch_s": ..., "threads_per_rank": 1},
     "executor": {"step_overhead_s": ..., "program_step_s": ...},  # optional
     "pinned": bool,  # optional: the launcher bound each rank to a core
     "cold": {"merge_s": ..., "message_s": ..., "collectives_s": {...}, ...},  # optional
     "machine": {...}}

How α is split (so that latency is counted once): the one-way small-message time α of the
ping-pong fit ``t(n) = α + n/β`` (measured through the executor's transport) is all software
on one host, so it goes to the backend as
``send_s = recv_s = α/2`` (plus the optional ``executor.step_overhead_s``, the executor's
own cost per Send/Recv step beyond raw messages, :func:`executor_step_overhead`), and the
``local`` topology gets link latency 0 and bandwidth β.
A message then costs ``α/2 + 0 + n/β + α/2 = α + n/β`` on its 2-hop loopback route
(cut-through: the bottleneck bandwidth is paid once, see :mod:`treeattn.sim.network`).

Which bandwidth the links get: on loopback every byte of a message is copied by a CPU core,
so when every rank sends at once (a ring step) each message gets less than a lone ping-pong
message does. When the profile has an ``exchange`` section (all ranks send to ``r+1`` and
receive from ``r−1`` at once, a microbenchmark like the others), its per-message bandwidth is
the link bandwidth; otherwise the ping-pong β is. Small messages (tree partials) are priced
by α and hardly notice the difference.

Core sharing: compute runs on ``cores // threads_per_rank`` servers shared by all ranks of the
host (the hardware's :class:`~treeattn.testbed.host.model.CpuHost` ``cores``), so with more
ranks than cores the simulated compute queues, as the real processes do; with ``pinned`` each
rank has its own server (:mod:`treeattn.testbed.host.model`). ``cold`` prices the host steps
that run right after the attention kernel (:mod:`treeattn.testbed.host.cold`), and
``executor.program_step_s`` the compiled reduction's messages (:func:`program_costs`).

Copies: on gloo every message byte goes through the kernel's sockets, copied by the host's
cores, so a gloo profile's host has ``copies_messages`` and the engine lets a rank's
attention and its own messages' copies take turns instead of overlapping. Measured at 2 ranks
on a 2-core box, a ring step took the exchange's time plus the attention's (a 1 GiB block:
~520 ms exchange, ~95 ms attention each side, 700–730 ms a step), not the larger of the two.
"""

from __future__ import annotations

import json
import math
import statistics

from treeattn.schedule.payloads import SimError
from treeattn.sim.devices import BackendModel, HardwareModel
from treeattn.sim.files.profile_schema import KERNELS_KIND, NCCL_TESTS_KIND
from treeattn.sim.files.profiles import gpu_backend, load_profile
from treeattn.testbed.host.cold import cold_from_profile
from treeattn.testbed.host.model import CpuHost
from treeattn.testbed.host.partial_reduction import ProgramCosts

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


def hardware_from_profile(profile: dict) -> HardwareModel:
    """The ``cpu`` model: memory bandwidth and launch from the attention calibration."""
    profile = load_profile(profile)
    if profile.get("kind") == NCCL_TESTS_KIND:
        raise SimError("an nccl-tests profile calibrates collectives, not the CPU ranks")
    if profile.get("kind") == KERNELS_KIND:
        raise SimError("a kernel-table profile calibrates a GPU's kernels, not the CPU ranks")
    attention = profile["attention"]
    bandwidth = float(attention["bandwidth_Bps"])
    flops = float(attention.get("flops_per_s", bandwidth * FLOPS_PER_BYTE_UNBOUND))
    threads = max(1, int(attention.get("threads_per_rank", 1)))
    launch = float(attention["launch_s"])
    host = CpuHost(cores=max(1, profile["cores"] // threads),
                   pinned=bool(profile.get("pinned", False)),
                   cold=cold_from_profile(profile.get("cold")),
                   copies_messages=profile.get("backend") == "gloo",
                   program=program_costs(profile, float(profile["p2p"]["latency_s"])))
    return HardwareModel("cpu", bandwidth, flops, launch, host=host,
                         bandwidth_shape=_bandwidth_shape(attention, launch))


def _bandwidth_shape(attention: dict, launch: float) -> tuple:
    """Each calibrated shard size's own rate relative to the profile's bandwidth.

    A CPU whose last-level cache holds a small shard between steps reads it faster than a
    shard that only DRAM holds (this box: 134 MB from a 480 MiB L3, 537 MB from DRAM); one
    bandwidth for all sizes, their median, mispriced both. Relative factors keep
    :func:`profile_bound` (which scales ``bandwidth_Bps``) scaling every size alike. The
    first size is the launch measurement and is skipped.
    """
    sizes, times = attention.get("sizes") or [], attention.get("times_s") or []
    rates = [(float(n), n / (t - launch))
             for n, t in zip(sizes[1:], times[1:], strict=False) if t > launch and n > 0]
    if len(rates) < 2:
        return ()
    # relative to the rates' own median (which calibration stores as bandwidth_Bps), so that
    # a bound profile's scaled bandwidth_Bps scales every size and the shape stays put
    mid = statistics.median(r for _, r in rates)
    return tuple(sorted((n, r / mid) for n, r in rates))


def backend_from_profile(profile: dict) -> BackendModel:
    """gloo with the measured α split evenly between sender and receiver."""
    profile = load_profile(profile)
    if profile.get("kind") == NCCL_TESTS_KIND:
        return gpu_backend(profile)
    if profile.get("kind") == KERNELS_KIND:
        raise SimError("a kernel-table profile calibrates a GPU's kernels, not messages")
    alpha = float(profile["p2p"]["latency_s"])
    step = executor_step_overhead(profile)
    return BackendModel(str(profile.get("backend", "gloo")), alpha / 2 + step, alpha / 2 + step,
                        collectives=_collective_fits(profile))


def program_costs(profile: dict, alpha: float) -> ProgramCosts | None:
    """The C program's cost per message step (optional ``executor.program_step_s``, with
    ``program_message_bytes``, ``program_tags`` and ``program_max_world``): α/2 plus the
    calibrated step cost, at least zero, on each end. None when the profile has none (no
    program ran there).

    >>> program_costs({"executor": {"program_step_s": -3e-6, "program_message_bytes": 65536,
    ...                             "program_tags": 8, "program_max_world": 8}}, 10e-6).send_s * 1e6
    2.0...
    """
    section = profile.get("executor")
    if not isinstance(section, dict) or "program_step_s" not in section:
        return None
    try:
        step = float(section["program_step_s"])
        limit, tags = int(section["program_message_bytes"]), int(section["program_tags"])
        world = int(section["program_max_world"])
    except (KeyError, TypeError, ValueError) as exc:
        raise SimError(f"calibration profile: executor's program entries are malformed "
                       f"({exc})") from None
    if not math.isfinite(step) or limit <= 0 or tags <= 0 or world < 2:
        raise SimError("calibration profile: executor's program entries must be finite, "
                       "with a positive message limit and tag count and a world of 2 or more")
    host = max(0.0, alpha / 2 + step)
    return ProgramCosts(host, host, limit, tags, world)


def executor_step_overhead(profile: dict) -> float:
    """The runtime executor's host cost per Send or Recv step beyond raw ``isend``/``irecv``
    (optional ``executor.step_overhead_s``; 0 when the profile predates it).

    The ping-pong α is measured with raw ``isend``/``irecv`` calls of the executor's
    transport; the executor adds its own bookkeeping to every step
    (``benchmarks/executor_overhead.py`` measures it). Charged to both ends of every
    message, it is paid once per Send step and once per Recv step.

    >>> executor_step_overhead({"executor": {"step_overhead_s": 2e-6}})
    2e-06
    """
    if "executor" not in profile:
        return 0.0
    if not isinstance(profile["executor"], dict):
        raise SimError("calibration profile: executor must be an object")
    return _positive(profile, "executor", "step_overhead_s", allow_zero=True)


def _collective_fits(profile: dict) -> tuple[tuple[str, int, float, float], ...]:
    """The profile's ``collectives`` section: per op, a fit ``t = alpha + bytes * per_byte``
    measured at ``collectives.world`` ranks (see :mod:`treeattn.testbed.calibration.calibrate`)."""
    section = profile.get("collectives")
    if section is None:
        return ()
    if not isinstance(section, dict) or not isinstance(section.get("world"), int):
        raise SimError("calibration profile: collectives must be an object with a world")
    fits = []
    for op in section:
        if op == "world":
            continue
        alpha = _positive(section, op, "alpha_s", allow_zero=True)
        per_byte = _positive(section, op, "seconds_per_byte", allow_zero=True)
        fits.append((op, section["world"], alpha, per_byte))
    return tuple(fits)


def link_bandwidth(profile: dict) -> float:
    """The per-message bandwidth under concurrent traffic when calibrated, else ping-pong β."""
    if isinstance(profile.get("exchange"), dict) and "bandwidth_Bps" in profile["exchange"]:
        return _positive(profile, "exchange", "bandwidth_Bps")
    return _positive(profile, "p2p", "bandwidth_Bps")


def topology_from_profile(profile: dict, world: int | None = None,
                          host_of: list[int] | None = None):
    """A ``local`` topology of ``world`` ranks with latency 0 and the measured bandwidth;
    ``host_of[r]`` lays the ranks out as hosts (:func:`treeattn.topo.builders.local_layout`),
    default one host."""
    from treeattn.topo import Topology

    profile = load_profile(profile)
    world = int(world or profile["world"])
    beta = link_bandwidth(profile)
    if host_of is not None and len(set(host_of)) > 1:
        from treeattn.topo.builders import local_layout

        return Topology(local_layout(list(host_of), 0.0, beta),
                        name=f"local:ranks={world},latency=0,bandwidth={beta!r} on "
                             f"{len(set(host_of))} hosts")
    return Topology.from_spec(f"local:ranks={world},latency=0,bandwidth={beta!r}")


def _scaled(section: dict, factor: float, latency_keys=(), bandwidth_keys=()) -> None:
    """Scale a section's times by ``factor``: latencies × factor, bandwidths ÷ factor."""
    for key in latency_keys:
        if key in section:
            section[key] = float(section[key]) * factor
    for key in bandwidth_keys:
        if key in section:
            section[key] = float(section[key]) / factor


def profile_bound(profile: dict, side: str) -> dict:
    """The profile at the fast (``"lo"``) or slow (``"hi"``) end of its own samples' spread.

    Calibration records, per section, ``[p10/median, p90/median]`` of the timing samples
    (``spread``, or ``latency_spread`` and ``bandwidth_spread`` for message sections).
    Simulating with every cost at its p10 (or p90) gives the band a prediction has from the
    calibration's noise alone. Sections without a spread (older profiles) stay as they are.

    >>> p = {"p2p": {"latency_s": 1.0, "bandwidth_Bps": 10.0, "latency_spread": [0.5, 2.0],
    ...      "bandwidth_spread": [0.8, 1.25]}, "attention": {"bandwidth_Bps": 4.0}}
    >>> hi = profile_bound(p, "hi")["p2p"]
    >>> hi["latency_s"], hi["bandwidth_Bps"]
    (2.0, 8.0)
    """
    if side not in ("lo", "hi"):
        raise SimError(f"profile_bound: side must be 'lo' or 'hi', not {side!r}")
    k = 0 if side == "lo" else 1
    out = json.loads(json.dumps(profile))
    for name in ("p2p", "exchange"):
        section = out.get(name)
        if isinstance(section, dict):
            if "latency_spread" in section:
                _scaled(section, section["latency_spread"][k], latency_keys=("latency_s",))
            if "bandwidth_spread" in section:
                _scaled(section, section["bandwidth_spread"][k],
                        bandwidth_keys=("bandwidth_Bps", "aggregate_Bps"))
    attention = out.get("attention")
    if isinstance(attention, dict) and "spread" in attention:
        _scaled(attention, attention["spread"][k], latency_keys=("launch_s",),
                bandwidth_keys=("bandwidth_Bps",))
    for op, fit in (out.get("collectives") or {}).items():
        if op != "world" and isinstance(fit, dict) and "spread" in fit:
            _scaled(fit, fit["spread"][k], latency_keys=("alpha_s", "seconds_per_byte"))
    return out


class CpuProfiles:
    """The planner's reader of profiles of this host's CPU ranks."""

    def models(self, profile: dict, world: int | None = None,
               host_of: list[int] | None = None
               ) -> tuple[object, HardwareModel, BackendModel]:
        return (topology_from_profile(profile, world, host_of),
                hardware_from_profile(profile), backend_from_profile(profile))

    def bound(self, profile: dict, side: str) -> dict:
        return profile_bound(profile, side)
