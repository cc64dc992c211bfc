"""What every priced collective variant is, and the pieces NCCL's and RCCL's models share.

A :class:`CollectiveCost` is one (algorithm, protocol) way of running an op on ``nbytes``:
its latency, its algorithm bandwidth and its time, with the library's own estimate beside it
where the library ranks by something else (:mod:`treeattn.sim.nccl.collectives`,
:mod:`treeattn.sim.nccl.rccl`, :mod:`treeattn.sim.nccl.sendrecv`).
"""

from __future__ import annotations

from dataclasses import dataclass

from treeattn.sim.nccl import tables as T
from treeattn.sim.nccl.group_shape import GroupShape

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "sendrecv")


@dataclass(frozen=True)
class CollectiveCost:
    """One priced way of running ``op`` on ``nbytes``; times in seconds, bandwidth B/s."""

    op: str
    nbytes: int
    algorithm: str
    protocol: str
    latency_s: float
    bandwidth_Bps: float  # algorithm bandwidth
    time_s: float
    tuner_s: float | None = None  # the library's own estimate, where it differs from time_s

    @property
    def choice_s(self) -> float:
        """What the library ranks this variant by: its tuner's estimate."""
        return self.time_s if self.tuner_s is None else self.tuner_s

    @property
    def algbw_GBps(self) -> float:
        return self.nbytes / self.time_s / 1e9 if self.time_s > 0 else 0.0


def log_size(nbytes: int) -> int:
    return (nbytes >> 6).bit_length() - 1  # log2i(bytes / 64); -1 below 64 B


def size_column(shape: GroupShape) -> int:
    return min(shape.nnodes, 3) - 1  # 1 node, 2 nodes, more


def arch_row(table: dict, arch: str) -> tuple:
    return table.get(arch) or table.get(arch.split("-")[0]) or table["ampere"]


def net_overhead_us(s: GroupShape, p: int) -> float:
    """NCCL's and RCCL's network post overhead under a multi-node ring step (getNetOverhead):
    by the hosts' CPU vendor, ×3 for Simple."""
    base = T.NCCL_NET_OVERHEAD_US.get(s.cpu_vendor, T.NCCL_NET_OVERHEAD_US["other"])
    return base * (T.NCCL_NET_OVERHEAD_SIMPLE_FACTOR if p == 2 else 1)


def bus_to_alg(op: str, algo: str, s: GroupShape) -> float:
    n = s.nranks
    if op in ("all_gather", "reduce_scatter") and algo != "ring":
        return 1.0  # NVLS and PAT report bus bandwidth as is
    if algo == "tree":
        return 0.5
    if op == "all_reduce":
        return n / (2 * (n - 1))
    if op in ("all_gather", "reduce_scatter"):
        return n / (n - 1)
    return 1.0


def priced(op, nbytes, algo, p, latency_us, alg_bw_GBps) -> CollectiveCost:
    time_us = latency_us + (nbytes / (1000.0 * alg_bw_GBps) if nbytes else 0.0)
    return CollectiveCost(op, int(nbytes), algo, T.PROTOCOLS[p], latency_us * 1e-6,
                          alg_bw_GBps * 1e9, time_us * 1e-6)
