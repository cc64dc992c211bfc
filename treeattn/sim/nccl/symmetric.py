"""NCCL's symmetric-memory kernels on one NVLink domain, priced by NCCL's own model.

From NCCL 2.27, a collective whose send and receive buffers lie in registered symmetric
windows (``ncclCommWindowRegister``; what vLLM's ``pynccl`` symmetric path and NCCL's own
``torch`` allocator hook do) runs one of NCCL's symmetric kernels instead of its ring, tree
or NVLS algorithms: GPUs load and store into their peers' windows directly, with LL
(flag-carrying) or plain variants, and NVLS ``multimem`` variants where NVSwitch has
multicast. NCCL picks the kernel by its own cost model, which this module follows.

Source: NVIDIA/nccl 2.30.7 (commit 5067397c), ``src/sym_kernels.cc``:

- **Availability** (``ncclSymkAvailable``, ``ncclSymkImplemented``, ``ncclSymkMask``): every
  GPU pair of the communicator directly NVLink-connected (``isAllDirectNvlink``), one node
  here (several need the GIN kernels, not modelled); all-gather of any type; all-reduce and
  reduce-scatter only as a **sum** of floating-point data (so a max, as ``allreduce3``'s,
  takes the regular path); ``multimem`` kernels where NVLS is supported and the team has
  more than 2 ranks; TMA kernels only on Blackwell with ``NCCL_SYM_TMA_ENABLE`` (off by
  default: not modelled).
- **Cost** (``queryModel_lsa``, ``model``): ``time = baseLat + softplus(busBytes / bw − 1)``
  µs, ``bw = softmin(blocks · smBw · busMultiplier, peakBw, smBw)``; ``busBytes`` and
  ``busMultiplier`` per kernel (LL kernels move ``ranks · bytes · 9``: twice the bytes plus
  flags, no unrolling); NCCL uses the fewest blocks within 2.5% of the time at the most
  (64, ``ncclSymkMaxBlocks``; ``multimem`` ones ``⌈16 / ranks⌉`` on Hopper) and picks the
  kernel minimising ``time · (1 + 0.025 · blocks)`` (``ncclSymkPickKernel``).
- Hopper: ``baseLat`` 4.5 µs (LL) or 7.8 µs, ``smBw`` 65 GB/s for all-reduce and 44
  otherwise, ``peakBw`` 480 GB/s for the ``multimem`` all-reduce and 320 otherwise (NCCL's
  ``GBps`` is 2³⁰ bytes per second). Blackwell: 8.5/11/19.5/13 µs, 55 GB/s, 1000/600 GB/s.

``nbytes`` means what it means in :mod:`treeattn.sim.nccl.collectives` (nccl-tests' size);
NCCL's model takes a rank's share for all-gather and reduce-scatter.

>>> from treeattn.topo import Topology
>>> shape = GroupShape.of(Topology.from_spec("dgx-h100"), range(8))
>>> best = symmetric_cost("all_reduce", 16384, shape)
>>> best.algorithm, best.protocol, round(best.time_s * 1e6, 2)
('symk_AGxLLMC_R', 'LL', 6.18)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from treeattn.schedule.payloads import SimError
from treeattn.sim.nccl.collectives import CollectiveCost
from treeattn.sim.nccl.group_shape import GroupShape

MAX_BLOCKS = 64  # ncclSymkMaxBlocks (sym_kernels.h); MAXCHANNELS caps maxCTAs at 64 too
LL_BUS_FACTOR = 9  # LL kernels: 2x the bytes, plus some processing, plus no unrolling
SM_PENALTY = 0.025  # ncclSymkPickKernel: 2.5% per block when choosing among kernels
BLOCK_TOLERANCE = 1.025  # the fewest blocks within 2.5% of the time at the most
GBPS = (1 << 30) / 1e6  # sym_kernels.cc's "GBps": bytes per microsecond


class ArchCosts(NamedTuple):
    """``sym_kernels.cc``'s figures for one GPU generation (µs, and NCCL's "GB/s")."""

    ll_base: float  # LL kernels' base latency
    ll_all_gather_base: float
    all_reduce_base: float  # plain (barrier-synchronised) all-reduce
    base: float  # plain kernels otherwise
    sm_bw_all_reduce: float  # per block
    sm_bw: float
    peak_multimem_all_reduce: float
    peak: float  # load/store ceiling of the other kernels
    multimem_blocks: int  # over the ranks


ARCH = {"hopper": ArchCosts(4.5, 4.5, 7.8, 7.8, 65, 44, 480, 320, 16),
        "blackwell": ArchCosts(11.0, 8.5, 19.5, 13.0, 55, 55, 1000, 600, 32)}
SUM_ONLY = ("all_reduce", "reduce_scatter")
OPS = ("all_reduce", "all_gather", "reduce_scatter")


@dataclass(frozen=True)
class Kernel:
    """One symmetric kernel: its op, whether it is LL or multimem, and its bus model."""

    name: str
    op: str
    ll: bool
    multimem: bool

    def bus(self, nbytes: float, ranks: int) -> tuple[float, float]:
        """(busBytes, busMultiplier) of ``queryModel_lsa`` for ``nbytes`` (NCCL's size)."""
        n = ranks
        if self.ll:
            return n * nbytes * LL_BUS_FACTOR, 1.1 if self.multimem else 1.0
        if self.op == "all_reduce":
            if self.multimem:
                return nbytes / n + nbytes, float(n)
            return 2 * nbytes * (n - 1) / n, 1.0
        # all-gather and reduce-scatter: (ranks - 1) shares; multimem "to beat non-MC"
        return (n - 1) * nbytes, 0.55 * n if self.multimem else 1.0


KERNELS = (
    Kernel("AGxLL_R", "all_reduce", True, False), Kernel("AGxLLMC_R", "all_reduce", True, True),
    Kernel("RSxLD_AGxST", "all_reduce", False, False),
    Kernel("RSxLDMC_AGxSTMC", "all_reduce", False, True),
    Kernel("LL", "all_gather", True, False), Kernel("LLMC", "all_gather", True, True),
    Kernel("ST", "all_gather", False, False), Kernel("STMC", "all_gather", False, True),
    Kernel("LL", "reduce_scatter", True, False), Kernel("LD", "reduce_scatter", False, False),
    Kernel("LDMC", "reduce_scatter", False, True),
)


def _softmin(x: float, ceiling: float, softness: float) -> float:
    return ceiling - softness * math.log1p(math.expm1(ceiling / softness)
                                           * math.exp(-x / softness))


def _softplus(x: float, softness: float = 1.0) -> float:
    z = x / softness
    return x if z >= 100 else softness * math.log1p(math.exp(z))


def unavailable(op: str, shape: GroupShape, reduction: str = "sum") -> str | None:
    """Why NCCL would not run ``op`` on symmetric kernels for this group, or None."""
    if op not in OPS:
        return f"NCCL has no symmetric kernel for {op}"
    if shape.family != "nvidia" or shape.arch not in ARCH:
        return f"NCCL's symmetric kernels need Hopper or Blackwell GPUs, not {shape.arch}"
    if shape.nnodes != 1 or shape.intra != "nvlink" or not shape.nvswitch:
        return ("NCCL's symmetric kernels need every GPU pair directly on NVLink (one "
                "NVSwitch domain); this group is not")
    if op in SUM_ONLY and reduction != "sum":
        return f"NCCL's symmetric {op} is a sum only, not a {reduction}"
    return None


def _time_us(kernel: Kernel, nbytes: float, shape: GroupShape) -> tuple[float, int, float]:
    """(µs, blocks, base latency µs) of ``kernel`` as ``queryModel_lsa`` has them."""
    base_ll, base_ll_ag, base_ar, base, sm_ar, sm, peak_mc_ar, peak, mc_blocks = ARCH[shape.arch]
    n = shape.nranks
    share = nbytes if kernel.op == "all_reduce" else nbytes / n  # NCCL's nBytes
    bus, multiplier = kernel.bus(share, n)
    if kernel.ll:
        lat = base_ll_ag if kernel.op == "all_gather" else base_ll
    else:
        lat = base_ar if kernel.op == "all_reduce" else base
    sm_bw = (sm_ar if kernel.op == "all_reduce" else sm) * GBPS
    peak_bw = (peak_mc_ar if kernel.op == "all_reduce" and kernel.multimem else peak) * GBPS
    most = -(-mc_blocks // n) if kernel.multimem and not kernel.ll else MAX_BLOCKS

    def at(blocks: int) -> float:
        bw = _softmin(blocks * sm_bw * multiplier, peak_bw, sm_bw)
        return lat + _softplus(bus / bw - 1)

    best = at(most)
    for blocks in range(1, most):
        if at(blocks) <= BLOCK_TOLERANCE * best:
            return at(blocks), blocks, lat
    return best, most, lat


def symmetric_candidates(op: str, nbytes: int, shape: GroupShape,
                         reduction: str = "sum") -> list[CollectiveCost]:
    """Every symmetric kernel NCCL would consider for ``op``, priced; [] where none runs."""
    if unavailable(op, shape, reduction) is not None or shape.nranks < 2:
        return []
    multimem = shape.nranks > 2  # NVLS multicast: hasLsaMultimem needs more than 2 ranks
    out = []
    for kernel in KERNELS:
        if kernel.op != op or (kernel.multimem and not multimem):
            continue
        if kernel.ll and nbytes >= 2 << 30:
            continue  # LL kernels count elements in 32 bits (NCCL's bus bytes: the whole size)
        us, blocks, lat = _time_us(kernel, nbytes, shape)
        seconds = us * 1e-6
        moving = max(us - lat, 1e-9) * 1e-6  # the part past the base latency
        out.append(CollectiveCost(op, int(nbytes), f"symk_{kernel.name}",
                                  "LL" if kernel.ll else "Simple", lat * 1e-6,
                                  nbytes / moving, seconds,
                                  tuner_s=seconds * (1 + SM_PENALTY * blocks)))
    return out


def put_base_us(shape: GroupShape, ll: bool) -> float:
    """The fixed cost, µs, of one message written into a peer's symmetric window.

    NCCL has no symmetric send/recv, so this is our analogy, stated as such wherever it is
    used: one of its all-gather kernels' base latency (``baseLat``, LL or plain), each GPU
    storing its piece into its peers' windows being exactly what a put is. The per-hop
    latency and bandwidth stay NCCL's for the protocol (:func:`~treeattn.sim.nccl.
    sendrecv.p2p_parts`), so only the library's enqueue and proxy cost is replaced.
    """
    arch = ARCH[shape.arch]
    return arch.ll_all_gather_base if ll else arch.base


def symmetric_cost(op: str, nbytes: int, shape: GroupShape,
                   reduction: str = "sum") -> CollectiveCost:
    """The symmetric kernel NCCL picks for ``op`` (raises SimError where none can run)."""
    reason = unavailable(op, shape, reduction)
    if reason is not None:
        raise SimError(reason)
    options = symmetric_candidates(op, nbytes, shape, reduction)
    if not options:
        raise SimError(f"no symmetric kernel runs {op} of {nbytes} bytes on {shape.nranks} "
                       "ranks")
    return min(options, key=lambda c: c.choice_s)
