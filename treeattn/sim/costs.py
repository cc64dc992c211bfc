"""The cost context shared by the engine, the closed forms and the planner.

:class:`CostModel` binds a topology, a workload, per-rank hardware models and a backend:
it answers "how long does this compute take on rank r" and "how long does a message from
a to b take when nothing else is on the wire", with caches that make repeated questions cheap.
"""

from __future__ import annotations

import numpy as np

from treeattn.sim.backend import BackendModel, backend_for, default_backend
from treeattn.sim.errors import SimError
from treeattn.sim.hardware import HardwareModel, hardware_for
from treeattn.sim.network import DEFAULT_CHUNK_BYTES, DEFAULT_MAX_CHUNKS, Network
from treeattn.sim.workload import DecodeWorkload


def resolve_hardware(topology, hardware) -> list[HardwareModel]:
    """One HardwareModel per rank: given, or looked up from ``topology.gpu_model(r)``."""
    world = topology.num_gpus
    if hardware is None:
        cache: dict[str, HardwareModel] = {}
        out = []
        for r in range(world):
            name = topology.gpu_model(r)
            if name not in cache:
                cache[name] = hardware_for(name)
            out.append(cache[name])
        return out
    if isinstance(hardware, HardwareModel):
        return [hardware] * world
    if isinstance(hardware, str):
        return [hardware_for(hardware)] * world
    hardware = list(hardware)
    if len(hardware) != world or not all(isinstance(h, HardwareModel) for h in hardware):
        raise SimError(f"hardware must be a HardwareModel or a list of {world} of them")
    return hardware


def resolve_backend(topology, backend) -> BackendModel:
    if backend is None:
        return default_backend(topology.gpu_model(0))
    if isinstance(backend, BackendModel):
        return backend
    return backend_for(backend)


class CostModel:
    """Compute and message costs for one (topology, workload, hardware, backend)."""

    def __init__(self, topology, workload: DecodeWorkload, hardware=None, backend=None,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 max_chunks: int = DEFAULT_MAX_CHUNKS) -> None:
        if not isinstance(workload, DecodeWorkload):
            raise SimError("workload must be a DecodeWorkload")
        self.topology = topology
        self.workload = workload
        self.world = topology.num_gpus
        self.shards = workload.shards(self.world)
        self.hardware = resolve_hardware(topology, hardware)
        self.backend = resolve_backend(topology, backend)
        self.net = Network(topology, self.backend, chunk_bytes, max_chunks)
        self.send_s = self.backend.send_s
        self.recv_s = self.backend.recv_s
        self.bw = np.array([h.memory_bandwidth_Bps for h in self.hardware])
        self.flops = np.array([h.peak_flops for h in self.hardware])
        self.launch = np.array([h.launch_s for h in self.hardware])
        self._pair_cache: dict = {}

    def compute(self, rank: int, nbytes: float, flops: float = 0.0) -> float:
        return self.hardware[rank].compute_time(nbytes, flops)

    def compute_vec(self, nbytes, flops=0.0) -> np.ndarray:
        """Per-rank compute times for arrays (or scalars) of bytes and FLOPs."""
        nbytes = np.asarray(nbytes, dtype=float)
        flops = np.asarray(flops, dtype=float)
        return np.maximum(nbytes / self.bw, flops / self.flops) + self.launch

    def attention_vec(self) -> np.ndarray:
        """Time of each rank's local partial over its own shard."""
        w = self.workload
        shards = np.asarray(self.shards, dtype=float)
        nbytes = np.array([w.attention_bytes(n) for n in self.shards], dtype=float)
        return self.compute_vec(nbytes, 4.0 * w.batch * w.model.n_heads * shards
                                * w.model.head_dim)

    def wire(self, src: int, dst: int, nbytes: float) -> float:
        return self.net.wire_time(src, dst, nbytes)

    def pair_summary(self, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
        """``(p, 2)`` array of :meth:`Network.summary` rows, cached per pair list."""
        key = (src.tobytes(), dst.tobytes())
        found = self._pair_cache.get(key)
        if found is None:
            found = np.array([self.net.summary(int(a), int(b)) for a, b in zip(src, dst)])
            self._pair_cache[key] = found
        return found

    def wire_vec(self, src: np.ndarray, dst: np.ndarray, nbytes) -> np.ndarray:
        """Vectorised :meth:`Network.wire_time` over pairs ``(src[i], dst[i])``."""
        summ = self.pair_summary(np.asarray(src), np.asarray(dst))
        return summ[:, 0] + np.asarray(nbytes, dtype=float) * summ[:, 1]
