"""The fixed costs of one-sided kernels, by analogy with NCCL's symmetric kernels.

torch's ``symm_mem`` kernels and FlashInfer's LL128 all-to-all publish no cost model. NCCL's
symmetric kernels (NCCL 2.30.7 ``src/sym_kernels.cc``, :mod:`treeattn.sim.nccl.symmetric`)
do, for GPUs that load from and store into their peers' memory the same way, so their
figures stand in:

* **an exchange**: a kernel that moves data to or from its peers with no barrier, its flags
  carried in the data, costs NCCL's LL all-gather base latency (Hopper 4.5 µs, Blackwell
  8.5 µs);
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


def arch_costs(shape: GroupShape) -> ArchCosts:
    return ARCH[shape.arch]


def exchange_us(shape: GroupShape) -> float:
    """A kernel exchanging data with its peers, no barrier: NCCL's LL all-gather base."""
    return arch_costs(shape).ll_all_gather_base


def barrier_us(shape: GroupShape) -> float:
    """One barrier over the signal pads: half of NCCL's plain-over-LL all-gather base."""
    arch = arch_costs(shape)
    return (arch.base - arch.ll_all_gather_base) / 2


def bytes_per_s(gbps: float) -> float:
    """NCCL's "GB/s" (2**30 bytes per second) in bytes per second."""
    return gbps * GBPS * 1e6
