"""Calibration profiles as the planner reads them: checked, and turned into the simulator's
models (:mod:`treeattn.sim.devices`).

Two kinds, one schema (:mod:`treeattn.sim.files.profile_schema`):

* a GPU cluster's collectives, calibrated from nccl-tests output (``calibrate
  --nccl-tests``): read here, into the library's backend with the cluster's measured scales
  (:func:`gpu_backend`)::

    {"version": 1, "kind": "nccl-tests", "backend": "nccl"|"rccl", "topology": NAME,
     "gpu_model": MODEL, "hosts": H, "world": N,
     "nccl_tests": {"world", "scales", "tables", "residuals", "sources"},
     "nccl_env": {NAME: VALUE} (optional: the NCCL variables the run had, sim/nccl/env.py)}

* a GPU's kernels, calibrated from a measured kernel table (``calibrate --kernels``): read
  by :mod:`treeattn.sim.deploy.kernel_table` into the GPU's hardware model;

* this host's CPU ranks (``treeattn calibrate``): read by the CPU test bed, which plugs its
  reader in (:class:`HostProfiles`, :func:`plug_in_host_profiles`;
  :mod:`treeattn.testbed.host.profiles`).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Protocol

from treeattn.inputs import InputError, read_json
from treeattn.schedule.payloads import SimError
from treeattn.sim.devices import BACKENDS, BackendModel, HardwareModel
from treeattn.sim.files.profile_schema import (
    KERNELS_KIND,
    NCCL_TESTS_KIND,
    check_profile,
    refuse_if_foreign,
)

VERSION = 1  # of the profile schema
MAX_PROFILE_BYTES = 16 << 20  # a profile is a few KB; an nccl-tests one a few hundred


def load_profile(source: str | Path | dict) -> dict:
    """Read and check a calibration profile (a path or an already-parsed dict) against the
    schema of :mod:`treeattn.sim.files.profile_schema`: a regular file of bounded size, bounded
    nesting, numbers only where numbers belong, finite and in range, required keys present.

    >>> p = load_profile({"version": 1, "backend": "gloo", "world": 2, "cores": 4,
    ...                   "p2p": {"latency_s": 3e-5, "bandwidth_Bps": 2e9},
    ...                   "attention": {"bandwidth_Bps": 1e10, "launch_s": 1e-5}})
    >>> p["world"]
    2
    """
    try:
        if isinstance(source, dict):
            profile, name = source, "calibration profile"
        else:
            profile = read_json(source, "profile", MAX_PROFILE_BYTES)
            name = f"profile {source}"
        check_profile(profile, name)
        if profile.get("kind") == NCCL_TESTS_KIND:
            nccl_calibration(profile)  # raises on a malformed section
    except InputError as exc:
        raise SimError(str(exc)) from None
    return profile


def nccl_calibration(profile: dict):
    """The :class:`~treeattn.sim.nccl.fit.CollectiveCalibration` of an nccl-tests profile."""
    from treeattn.sim.nccl.fit import CollectiveCalibration

    section = profile.get("nccl_tests")
    if not isinstance(section, dict):
        raise SimError("calibration profile: kind nccl-tests needs an nccl_tests object")
    return CollectiveCalibration.from_json(section)


def is_gpu_profile(profile: dict) -> bool:
    """Whether ``profile`` calibrates a GPU cluster's collectives (not this CPU's ranks)."""
    return load_profile(profile).get("kind") == NCCL_TESTS_KIND


def gpu_backend(profile: dict) -> BackendModel:
    """An nccl-tests profile's backend: the library's, its per-message costs scaled by the
    cluster's measured base latency, with the calibration attached."""
    profile = load_profile(profile)
    if profile.get("kind") != NCCL_TESTS_KIND:
        raise SimError("a profile of this host's CPU ranks has no GPU backend")
    calibration = nccl_calibration(profile)
    base = BACKENDS.get(str(profile.get("backend", "nccl")), BACKENDS["nccl"])
    lat = calibration.scales["lat"]  # p2p shares the collectives' base latency
    return replace(base, send_s=base.send_s * lat, recv_s=base.recv_s * lat,
                   calibration=calibration,
                   nccl_env=tuple(profile.get("nccl_env", {}).items()))


class HostProfiles(Protocol):
    """The reader of profiles of this host's CPU ranks (the CPU test bed plugs one in)."""

    def models(self, profile: dict, world: int | None = None,
               host_of: list[int] | None = None
               ) -> tuple[object, HardwareModel, BackendModel]:
        """``(topology, hardware, backend)``: the calibrated ``local`` topology of ``world``
        ranks (the profile's own world when None; ``host_of[r]`` lays them out as hosts),
        the CPU's model and the backend."""

    def bound(self, profile: dict, side: str) -> dict:
        """The profile at the fast (``"lo"``) or slow (``"hi"``) end of its samples' spread."""


_host_profiles: HostProfiles | None = None


def plug_in_host_profiles(reader: HostProfiles | None) -> None:
    """Read profiles of CPU ranks with ``reader`` from now on (None: refuse them)."""
    global _host_profiles
    _host_profiles = reader


def host_profiles(name: str = "calibration profile") -> HostProfiles:
    """The plugged-in reader of CPU ranks' profiles; refuses ``name`` without one."""
    if _host_profiles is None:
        raise SimError(f"{name} calibrates CPU ranks (treeattn calibrate): reading it needs the "
                       "CPU test bed plugged in (treeattn.testbed.plug_in_profiles())")
    return _host_profiles


def plan_overrides(profile, topology, nccl_env=()) -> dict:
    """``plan()``'s ``hardware``/``backend`` from a calibration profile (a path or a dict):
    this CPU's ranks (``calibrate``), a GPU cluster's collectives (``calibrate
    --nccl-tests``), which must have been measured on as many GPUs as ``topology`` has, or a
    GPU's kernels (``calibrate --kernels``). ``nccl_env`` (``NAME=VALUE`` strings,
    :mod:`treeattn.sim.nccl.env`) sets the variables the library runs with on the backend,
    the profile's or the topology's default."""
    from treeattn.sim.nccl.env import parse_nccl_env

    env = parse_nccl_env(nccl_env)
    found = _profile_overrides(profile, topology)
    if env:
        from treeattn.sim.devices import default_backend

        backend = found.get("backend") or default_backend(topology.gpu_model(0))
        found["backend"] = replace(backend, nccl_env=parse_nccl_env(
            [*backend.nccl_env, *env]))  # the flag's value wins over the profile's
    return found


def _profile_overrides(profile, topology) -> dict:
    if not profile:
        return {}
    name = "calibration profile" if isinstance(profile, dict) else f"profile {profile}"
    profile = load_profile(profile)
    try:  # a profile of another kind of machine (CPU ranks for GPUs, H100s for an MI300X)
        refuse_if_foreign(profile, topology, name)  # would price the wrong one: refuse it
    except InputError as exc:
        raise SimError(str(exc)) from None
    if profile.get("kind") == NCCL_TESTS_KIND:
        return {"backend": gpu_backend(profile)}
    if profile.get("kind") == KERNELS_KIND:
        from treeattn.sim.deploy.kernel_table import hardware_from_kernels

        return {"hardware": [hardware_from_kernels(profile)] * topology.num_gpus}
    _, hardware, backend = host_profiles(name).models(profile)
    return {"hardware": hardware, "backend": backend}
