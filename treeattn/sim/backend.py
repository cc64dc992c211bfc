"""Communication-library software overhead, paid at each end of every message.

A message from ``a`` to ``b`` costs ``send_s`` on the sender (posting it occupies the rank),
then the wire time along its route (per-hop link latency plus chunked, pipelined
transfer, see :mod:`treeattn.sim.network`), then ``recv_s`` on the receiver once it has
arrived. The small-message latency is therefore ``α = send_s + route latency + recv_s``.

Sources:

* ``nccl``: NCCL's tuning model (``src/graph/tuning.cc``) charges a base latency of
  ≈6.6–6.8 µs per collective operation on top of per-hop hardware latencies (0.6 µs NVLink,
  1.0 µs PCIe, 2.7–5 µs network). The per-hop part lives in the topology's link latencies,
  so here only the base is split evenly between the two ends: 3.3 µs each.
* ``gloo``: TCP on loopback through gloo's pair transport costs tens of µs per message on a
  typical Linux host; 15 µs per end is a placeholder that calibration replaces
  (:func:`treeattn.sim.profile.backend_from_profile`).
"""

from __future__ import annotations

from dataclasses import dataclass

from treeattn.sim.errors import SimError


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

    def __post_init__(self) -> None:
        if self.send_s < 0 or self.recv_s < 0:
            raise SimError(f"backend {self.name}: overheads must be non-negative")

    @property
    def overhead_s(self) -> float:
        """Software part of α: both ends together."""
        return self.send_s + self.recv_s


BACKENDS: dict[str, BackendModel] = {
    "nccl": BackendModel("nccl", 3.3e-6, 3.3e-6),
    "rccl": BackendModel("rccl", 3.3e-6, 3.3e-6),
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
