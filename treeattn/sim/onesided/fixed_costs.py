"""The fixed costs of one-sided kernels: measured in graph replays where published, else by
analogy with NCCL's symmetric kernels.

torch's ``symm_mem`` kernels and FlashInfer's LL128 all-to-all publish no cost model. NCCL's
symmetric kernels (NCCL 2.30.7 ``src/sym_kernels.cc``, :mod:`treeattn.sim.nccl.symmetric`)
do, for GPUs that load from and store into their peers' memory the same way, so their
figures stand in:

* **an exchange**: a kernel that moves data to or from its peers with no barrier, its flags
  carried in the data. Where such a kernel was timed in CUDA-graph replays and published
  (:data:`GRAPH_EXCHANGE_US`, one sourced row per generation), that time; else NCCL's LL
  all-gather base latency (Hopper 4.5 µs). NCCL's base latencies describe an eagerly
  launched kernel, which a graph replay does not pay in full: on 8 B200s NCCL's own LL
  symmetric all-reduce (an exchange: flags in the data, no barrier) took "just over 3"
  µs at the smallest sizes with symmetric buffers (``-R 2``) and CUDA graphs, where its
  model charges 8.5 µs or more;
* **a barrier** over signal pads (a flag set in each peer's pad, a spin on one's own): half
  of what NCCL's plain kernels, which synchronise on entry and on exit, pay over its LL
  ones: ``(7.8 − 4.5) / 2 = 1.65`` µs on Hopper, ``(13 − 8.5) / 2 = 2.25`` µs on Blackwell;
* **the traffic** at NCCL's per-block NVLink load/store rate times the blocks the kernel
  launches, capped at the ceiling NCCL's model gives load/store kernels on that NVLink
  generation.

>>> from treeattn.topo import Topology
>>> from treeattn.sim.nccl.group_shape import GroupShape
>>> shape = GroupShape.of(Topology.from_spec("dgx-h100"), range(8))
>>> exchange_us(shape), round(barrier_us(shape), 2)
(4.5, 1.65)
"""

from __future__ import annotations

from treeattn.sim.nccl.group_shape import GroupShape
from treeattn.sim.nccl.symmetric import ARCH, GBPS, ArchCosts

# Generation -> (µs, source): an exchange kernel (flags in the data, no barrier) at the
# smallest sizes, timed in CUDA-graph replays, as published. Generations without a row take
# NCCL's LL all-gather base (an eager launch's figure).
GRAPH_EXCHANGE_US: dict[str, tuple[float, str]] = {
    "blackwell": (3.0, "NVIDIA/nccl-tests issue #333, comment of 2025-10-01 by an NVIDIA "
                       "NCCL engineer on a user's 8x B200 all_reduce_perf run with symmetric "
                       "buffers (-R 2) and CUDA graphs: the smallest messages take 'just "
                       "over 3 microseconds'"),
}


def arch_costs(shape: GroupShape) -> ArchCosts:
    return ARCH[shape.arch]


def exchange_us(shape: GroupShape) -> float:
    """A kernel exchanging data with its peers, no barrier: its published graph-replay time
    (:data:`GRAPH_EXCHANGE_US`), else NCCL's LL all-gather base."""
    measured = GRAPH_EXCHANGE_US.get(shape.arch)
    return measured[0] if measured else arch_costs(shape).ll_all_gather_base


def barrier_us(shape: GroupShape) -> float:
    """One barrier over the signal pads: half of NCCL's plain-over-LL all-gather base."""
    arch = arch_costs(shape)
    return (arch.base - arch.ll_all_gather_base) / 2


def bytes_per_s(gbps: float) -> float:
    """NCCL's "GB/s" (2**30 bytes per second) in bytes per second."""
    return gbps * GBPS * 1e6
