"""The fixed costs of one-sided kernels as the engines run them: replayed in a CUDA graph.

torch's ``symm_mem`` kernels and FlashInfer's LL128 all-to-all publish no cost model. NCCL's
symmetric kernels (NCCL 2.30.7 ``src/sym_kernels.cc``, :mod:`treeattn.sim.nccl.symmetric`)
do, for GPUs that load from and store into their peers' memory the same way, so their
figures give the *shape* of a one-sided kernel's fixed cost:

* **an exchange**: a kernel that moves data to or from its peers with no barrier, its flags
  carried in the data: NCCL's LL all-gather base latency (Hopper 4.5 µs, Blackwell 8.5 µs);
* **a barrier** over signal pads (a flag set in each peer's pad, a spin on one's own): half
  of what NCCL's plain kernels, which synchronise on entry and on exit, pay over its LL
  ones: ``(7.8 − 4.5) / 2 = 1.65`` µs on Hopper, ``(13 − 8.5) / 2 = 2.25`` µs on Blackwell;
* **the traffic** at NCCL's per-block NVLink load/store rate times the blocks the kernel
  launches, capped at the ceiling NCCL's model gives load/store kernels on that NVLink
  generation (loads also at most what a block's outstanding loads deliver per NVLink round
  trip: :mod:`treeattn.sim.onesided.torch_symm`).

NCCL's base latencies describe a kernel launched eagerly, one call at a time (nccl-tests'
default); vLLM and SGLang capture their decode steps in CUDA graphs and replay them, which
pays a fraction of that. Each generation's fraction, :func:`graph_scale`, is one published
graph-replayed (or back-to-back) kernel's time at its smallest sizes over what NCCL's model
charges that kernel, and scales the exchange and the barrier alike:

==========  ==========  ===============  =========================================================
generation  published   NCCL's eager     source
            µs          figure, µs
==========  ==========  ===============  =========================================================
Hopper      3.7         7.8 (plain all-  sgl-project/sglang PR #2904 (2025-01-15), "unit test
                        reduce base: a   performance in H100": SGLang's custom one-shot all-reduce
                        one-shot with    (copy-input mode, one kernel) on 2 H100s at 512 B,
                        two barriers)    0.0037 ms, calls back to back without a graph
Blackwell   3.0         11.0 (LL all-    NVIDIA/nccl-tests issue #333 (comment of 2025-10-01 by an
                        reduce base)     NVIDIA NCCL engineer): 8 B200s, symmetric buffers
                                         (``-R 2``), CUDA graphs, NCCL's LL symmetric all-reduce
                                         "just over 3 microseconds" at the smallest sizes
==========  ==========  ===============  =========================================================

So a one-shot all-reduce (an exchange and two barriers) on Hopper costs ``0.474 × 7.8 = 3.7``
µs before its traffic, and on Blackwell ``0.273 × (8.5 + 2 × 2.25) = 3.5`` µs.

>>> from treeattn.topo import Topology
>>> from treeattn.sim.nccl.group_shape import GroupShape
>>> shape = GroupShape.of(Topology.from_spec("dgx-h100"), range(8))
>>> round(exchange_us(shape) + 2 * barrier_us(shape), 2)
3.7
"""

from __future__ import annotations

from typing import NamedTuple

from treeattn.sim.nccl.group_shape import GroupShape
from treeattn.sim.nccl.symmetric import ARCH, GBPS, ArchCosts


class GraphReplay(NamedTuple):
    """One published graph-replayed kernel: its time and NCCL's eager figure for it."""

    published_us: float
    nccl_eager_us: float
    source: str


GRAPH_REPLAY: dict[str, GraphReplay] = {
    "hopper": GraphReplay(3.7, ARCH["hopper"].all_reduce_base,
                          "sgl-project/sglang PR #2904, H100 unit-test table: custom one-shot "
                          "all-reduce, 2 GPUs, 512 B, 0.0037 ms (back to back, no graph)"),
    "blackwell": GraphReplay(3.0, ARCH["blackwell"].ll_base,
                             "NVIDIA/nccl-tests issue #333, 2025-10-01: 8x B200, symmetric "
                             "buffers (-R 2), CUDA graphs, NCCL's LL symmetric all-reduce "
                             "'just over 3 microseconds' at the smallest sizes"),
}


def arch_costs(shape: GroupShape) -> ArchCosts:
    return ARCH[shape.arch]


def graph_scale(shape: GroupShape) -> float:
    """The fraction of NCCL's eager fixed costs a graph replay pays on this generation."""
    row = GRAPH_REPLAY[shape.arch]
    return row.published_us / row.nccl_eager_us


def exchange_us(shape: GroupShape) -> float:
    """A kernel exchanging data with its peers, no barrier: NCCL's LL all-gather base, at
    the generation's graph-replay fraction."""
    return graph_scale(shape) * arch_costs(shape).ll_all_gather_base


def barrier_us(shape: GroupShape) -> float:
    """One barrier over the signal pads: half of NCCL's plain-over-LL all-gather base, at the
    generation's graph-replay fraction."""
    arch = arch_costs(shape)
    return graph_scale(shape) * (arch.base - arch.ll_all_gather_base) / 2


def bytes_per_s(gbps: float) -> float:
    """NCCL's "GB/s" (2**30 bytes per second) in bytes per second."""
    return gbps * GBPS * 1e6
