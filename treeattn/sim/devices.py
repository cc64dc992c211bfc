"""The device cost models: per-GPU compute (:class:`HardwareModel`), per-library messaging
overhead (:class:`BackendModel`), their registries, and both built from a calibration profile.

Hardware
--------
Per-device compute models: how long a Compute or Merge step takes.

A step that touches ``nbytes`` and does ``flops`` takes
``max(nbytes / memory_bandwidth, flops / peak_flops) + launch_s`` (decode attention is
memory-bound, so the first term wins in practice).


``launch_s``: a decode attention is two kernels (split-K partial + combine); a CUDA/HIP
launch costs a few µs from the host (CUDA C++ Best Practices Guide, "kernel launch overhead").
We take 4 µs per Compute step on GPUs. The H200 run agrees: treeattn's kernel at T=4k (16.8 MB
of K+V) takes 8.2 µs as a graph replay, 3.9 µs of reading at the copy bandwidth plus about
4 µs (``benchmarks/results/kernels-h200.md``).

Memory efficiency: no kernel reads HBM at the datasheet peak. :data:`MEMORY_EFFICIENCY` holds
the fraction treeattn's own decode kernel reached where it was measured, and a GPU's model
reads at ``datasheet × efficiency``. GPUs not measured keep the datasheet figure (1.0).

The ``cpu`` profile is a placeholder until the runtime calibrates it
(:func:`hardware_from_profile`). ``cores`` is the number of compute
servers shared by all ranks of one host (``None``: each rank owns its device).

The figures (peak memory bandwidth, dense 16-bit FLOP/s) and their datasheet sources live in
THE GPU table, :data:`treeattn.topo.hardware.GPU_SPECS`, which the topology builders and
importers read too; :data:`HARDWARE` has one model per row of it.

Backends
--------
Communication-library software overhead, paid at each end of every message.

A message from ``a`` to ``b`` costs ``send_s`` on the sender (posting it occupies the rank),
then the wire time along its route (per-hop link latency plus chunked, pipelined
transfer, see :mod:`treeattn.sim.network`), then ``recv_s`` on the receiver once it has
arrived. The small-message latency is therefore ``α = send_s + route latency + recv_s``.

Sources:

* ``nccl``: NCCL keeps no cost table for send/recv; we price one p2p message as one ring
  hop of its LL protocol (see :func:`treeattn.sim.collectives.p2p_cost`): the ring LL base
  of NCCL 2.30.7's ``tuning.cc`` (6.6 µs), split between the two ends (3.3 µs each), plus
  the route's per-hop latency, which lives in the topology's links (0.6 µs NVLink, 1.0 µs
  PCIe, 2.7 µs network). Collectives are priced by the library's own model instead.
* ``rccl``: the same with RCCL's ring LL base for gfx942 (12.0 µs, ``tuning_model_5``):
  6.0 µs each end.
* ``gloo``: TCP on loopback through gloo's pair transport costs tens of µs per message on a
  typical Linux host; 15 µs per end is a placeholder that calibration replaces
  (:func:`backend_from_profile`). Between CPU ranks of one host the runtime sends small
  messages through shared memory instead (``treeattn/runtime/transport.py``), and
  calibration measures that same path, so a calibrated α is the shared-memory one.

Calibration profiles
--------------------
Calibration profiles: measured gloo costs on this machine, turned into sim models.

``treeattn calibrate`` (the runtime) writes a JSON profile, schema version 1::

    {"version": 1, "backend": "gloo", "world": N, "cores": C,
     "p2p": {"latency_s": α, "bandwidth_Bps": β, "sizes": [...], "times_s": [...]},
     "allreduce": {"latency_s": ..., "sizes": [...], "times_s": [...]},
     "attention": {"bandwidth_Bps": ..., "launch_s": ..., "threads_per_rank": 1},
     "executor": {"step_overhead_s": ...},  # optional
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
host (:class:`HardwareModel` ``cores``), so with more ranks than
cores the simulated compute queues, as the real processes do.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field, replace
from pathlib import Path

from treeattn.sim.cold import ColdSteps, cold_from_profile
from treeattn.sim.payloads import SimError
from treeattn.topo.hardware import GPU_SPECS


@dataclass(frozen=True)
class HardwareModel:
    """Compute cost model of one device type.

    Examples
    --------
    >>> h = HardwareModel("toy", memory_bandwidth_Bps=1e9, peak_flops=1e12, launch_s=1e-6)
    >>> round(h.compute_time(nbytes=1000, flops=0), 9)
    2e-06
    """

    name: str
    memory_bandwidth_Bps: float
    peak_flops: float
    launch_s: float
    cores: int | None = None
    memory_bytes: float = 0.0  # device memory capacity; 0: unknown (no capacity check)
    # ((bytes, factor), ...) sorted by bytes: the bandwidth at a step of ``bytes`` is
    # ``memory_bandwidth_Bps × factor``, interpolated in log(bytes) and held flat beyond the
    # ends. From calibration, where a CPU's caches make a small shard read faster than a large
    # one (:func:`hardware_from_profile`); empty: one bandwidth for every size.
    bandwidth_shape: tuple[tuple[float, float], ...] = ()
    pinned: bool = False  # ranks bound round-robin to the ``cores`` (the local launcher's way)
    cold: ColdSteps | None = None  # host steps right after the kernel (treeattn.sim.cold)

    def __post_init__(self) -> None:
        if self.memory_bandwidth_Bps <= 0 or self.peak_flops <= 0 or self.launch_s < 0:
            raise SimError(f"hardware {self.name}: bandwidth and FLOPs must be positive")
        if self.cores is not None and self.cores < 1:
            raise SimError(f"hardware {self.name}: cores must be at least 1")

    def bandwidth_at(self, nbytes: float) -> float:
        """Bytes/s for a step touching ``nbytes`` (see ``bandwidth_shape``).

        >>> h = HardwareModel("toy", 1e9, 1e12, 0.0, bandwidth_shape=((1e6, 2.0), (1e8, 1.0)))
        >>> h.bandwidth_at(1e3), h.bandwidth_at(1e7), h.bandwidth_at(1e9)
        (2000000000.0, 1500000000.0, 1000000000.0)
        """
        if not self.bandwidth_shape or nbytes <= 0:
            return self.memory_bandwidth_Bps
        sizes = [math.log(b) for b, _ in self.bandwidth_shape]
        factors = [f for _, f in self.bandwidth_shape]
        x = math.log(nbytes)
        if x <= sizes[0]:
            return self.memory_bandwidth_Bps * factors[0]
        for (x0, f0), (x1, f1) in zip(zip(sizes, factors), zip(sizes[1:], factors[1:])):
            if x <= x1:
                return self.memory_bandwidth_Bps * (f0 + (f1 - f0) * (x - x0) / (x1 - x0))
        return self.memory_bandwidth_Bps * factors[-1]

    def compute_time(self, nbytes: float, flops: float = 0.0) -> float:
        """Seconds for a step touching ``nbytes`` and doing ``flops``."""
        return max(nbytes / self.bandwidth_at(nbytes), flops / self.peak_flops) + self.launch_s



GPU_LAUNCH_S = 4e-6
CPU_LAUNCH_S = 20e-6  # placeholder: `treeattn calibrate` measures it
# Fraction of the datasheet memory bandwidth at which treeattn's Triton decode kernel reads
# K+V, as measured. Source: benchmarks/results/kernels-h200.json (NVIDIA H200, 2026-11-30,
# bf16, B=1, Hq=32, Hkv=8, D=128, CUDA-graph replays): 0.82 at T=64k, 0.88 at 128k, 0.90 at
# 256k, 0.93 at 512k, 0.94 at 1M; we take the median, 0.90. The H100 has the same SM, memory
# controller design and kernel, so it takes the H200's figure until it is measured itself.
MEMORY_EFFICIENCY = {"H200": 0.90, "H100": 0.90}
# One model per row of THE GPU table, so every GPU a topology can name has one.
HARDWARE: dict[str, HardwareModel] = {
    name: HardwareModel(name, spec.memory_bandwidth * MEMORY_EFFICIENCY.get(name, 1.0),
                        spec.peak_flops, CPU_LAUNCH_S if name == "cpu" else GPU_LAUNCH_S,
                        memory_bytes=float(spec.memory_capacity))
    for name, spec in GPU_SPECS.items()
}


def hardware_for(model: str) -> HardwareModel:
    """The registered model for a GPU type name as ``Topology.gpu_model`` spells it."""
    key = str(model).strip()
    if key in HARDWARE:
        return HARDWARE[key]
    folded = {k.lower(): v for k, v in HARDWARE.items()}
    if key.lower() in folded:
        return folded[key.lower()]
    raise SimError(f"no hardware model for device {model!r} (known: {', '.join(HARDWARE)})")


@dataclass(frozen=True)
class BackendModel:
    """Per-message software overhead of a communication library.

    Examples
    --------
    >>> backend_for("nccl").send_s
    3.3e-06
    """

    name: str
    send_s: float
    recv_s: float
    # Measured collectives (calibration): ((op, world, alpha_s, seconds_per_byte), ...).
    collectives: tuple[tuple[str, int, float, float], ...] = ()
    # A GPU cluster's calibration from nccl-tests (treeattn.sim.nccl_fit), if any.
    calibration: object = field(default=None, compare=False, hash=False)

    def __post_init__(self) -> None:
        if self.send_s < 0 or self.recv_s < 0:
            raise SimError(f"backend {self.name}: overheads must be non-negative")

    def measured_collective(self, op: str, world: int) -> tuple[float, float] | None:
        """``(alpha_s, seconds_per_byte)`` calibrated for ``op`` at ``world`` ranks, if any."""
        for name, size, alpha, per_byte in self.collectives:
            if name == op and size == world:
                return alpha, per_byte
        return None

    @property
    def overhead_s(self) -> float:
        """Software part of α: both ends together."""
        return self.send_s + self.recv_s


BACKENDS: dict[str, BackendModel] = {
    "nccl": BackendModel("nccl", 3.3e-6, 3.3e-6),
    "rccl": BackendModel("rccl", 6.0e-6, 6.0e-6),
    "gloo": BackendModel("gloo", 15e-6, 15e-6),
}


def backend_for(name: str) -> BackendModel:
    key = str(name).strip().lower()
    if key not in BACKENDS:
        raise SimError(f"unknown backend {name!r} (known: {', '.join(BACKENDS)})")
    return BACKENDS[key]


def default_backend(gpu_model: str) -> BackendModel:
    """gloo for CPU ranks, RCCL on AMD GPUs, NCCL otherwise."""
    if gpu_model.lower() == "cpu":
        return BACKENDS["gloo"]
    if gpu_model.upper().startswith("MI"):
        return BACKENDS["rccl"]
    return BACKENDS["nccl"]


# -- calibration profiles ----------------------------------------------------------------
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
            raise SimError(f"cannot read profile {source}: {exc}") from None
    if not isinstance(profile, dict) or profile.get("version") != VERSION:
        raise SimError(f"calibration profile must be a JSON object with version {VERSION}")
    if profile.get("kind") == NCCL_TESTS_KIND:
        _nccl_calibration(profile)  # raises on a malformed section
        return profile
    for key in ("world", "cores"):
        if not isinstance(profile.get(key), int) or profile[key] < 1:
            raise SimError(f"calibration profile: {key} must be a positive integer")
    _positive(profile, "p2p", "latency_s", allow_zero=True)
    _positive(profile, "p2p", "bandwidth_Bps")
    _positive(profile, "attention", "bandwidth_Bps")
    _positive(profile, "attention", "launch_s", allow_zero=True)
    return profile


# A profile of a GPU cluster, calibrated from nccl-tests output (``calibrate --nccl-tests``):
#   {"version": 1, "kind": "nccl-tests", "backend": "nccl"|"rccl", "topology": NAME,
#    "world": N, "nccl_tests": {"world", "scales", "tables", "residuals", "sources"}}
NCCL_TESTS_KIND = "nccl-tests"


def _nccl_calibration(profile: dict):
    from treeattn.sim.nccl_fit import CollectiveCalibration

    section = profile.get("nccl_tests")
    if not isinstance(section, dict):
        raise SimError("calibration profile: kind nccl-tests needs an nccl_tests object")
    return CollectiveCalibration.from_json(section)


def is_gpu_profile(profile: dict) -> bool:
    """Whether ``profile`` calibrates a GPU cluster's collectives (not this CPU's ranks)."""
    return load_profile(profile).get("kind") == NCCL_TESTS_KIND


def plan_overrides(profile, topology) -> dict:
    """``plan()``'s ``hardware``/``backend`` from a calibration profile (a path or a dict):
    this CPU's ranks (``calibrate``), or a GPU cluster's collectives (``calibrate
    --nccl-tests``), which must have been measured on as many GPUs as ``topology`` has."""
    if not profile:
        return {}
    profile = load_profile(profile)
    if profile.get("kind") == NCCL_TESTS_KIND:
        if profile["world"] != topology.num_gpus:
            raise SimError(f"the profile was calibrated on {profile['world']} GPUs, the "
                           f"topology has {topology.num_gpus}")
        return {"backend": backend_from_profile(profile)}
    return {"hardware": hardware_from_profile(profile), "backend": backend_from_profile(profile)}


def hardware_from_profile(profile: dict) -> HardwareModel:
    """The ``cpu`` model: memory bandwidth and launch from the attention calibration."""
    profile = load_profile(profile)
    if profile.get("kind") == NCCL_TESTS_KIND:
        raise SimError("an nccl-tests profile calibrates collectives, not the CPU ranks")
    attention = profile["attention"]
    bandwidth = float(attention["bandwidth_Bps"])
    flops = float(attention.get("flops_per_s", bandwidth * FLOPS_PER_BYTE_UNBOUND))
    threads = max(1, int(attention.get("threads_per_rank", 1)))
    launch = float(attention["launch_s"])
    return HardwareModel("cpu", bandwidth, flops, launch,
                         cores=max(1, profile["cores"] // threads),
                         pinned=bool(profile.get("pinned", False)),
                         cold=cold_from_profile(profile.get("cold")),
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
        calibration = _nccl_calibration(profile)
        base = BACKENDS.get(str(profile.get("backend", "nccl")), BACKENDS["nccl"])
        lat = calibration.scales["lat"]  # p2p shares the collectives' base latency
        return replace(base, send_s=base.send_s * lat, recv_s=base.recv_s * lat,
                       calibration=calibration)
    alpha = float(profile["p2p"]["latency_s"])
    step = executor_step_overhead(profile)
    return BackendModel(str(profile.get("backend", "gloo")), alpha / 2 + step, alpha / 2 + step,
                        collectives=_collective_fits(profile))


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
    measured at ``collectives.world`` ranks (see :mod:`treeattn.runtime.calibrate`)."""
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


def topology_from_profile(profile: dict, world: int | None = None):
    """A ``local`` topology of ``world`` ranks with latency 0 and the measured bandwidth."""
    from treeattn.topo import Topology

    profile = load_profile(profile)
    world = int(world or profile["world"])
    beta = link_bandwidth(profile)
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
