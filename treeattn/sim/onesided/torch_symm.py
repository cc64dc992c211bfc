"""torch's ``symm_mem`` kernels on one NVLink domain: one-shot, two-shot and ``multimem``.

``torch.distributed._symmetric_memory`` maps every rank's buffer into every peer's address
space, so a kernel reads and writes its peers' memory over NVLink directly, and ranks
synchronise through *signal pads* (a flag per peer and block in each rank's window). vLLM
runs its tensor-parallel all-reduce on these kernels inside one NVLink domain
(``VLLM_ALLREDUCE_USE_SYMM_MEM``), and its direct DCP all-to-all writes partials straight
into the peers' receive buffers (``VLLM_USE_DIRECT_DCP_A2A=1``, vLLM PR #48897, merged for
Kimi-K3 in PR #50484). Sources: pytorch/pytorch ``torch/csrc/distributed/c10d/symm_mem/
CUDASymmetricMemoryOps.cu`` (the kernels), and the vLLM PRs named.

How each kernel moves data, per rank, for an op of ``S`` bytes (nccl-tests' size) on ``n``
ranks, and how many barriers over the signal pads it takes (each kernel synchronises on
entry, so its peers' inputs are ready, and on exit, so its buffers may be reused):

=======================  ============================================  ========  ===========
op / kernel              NVLink traffic of one rank                    barriers  blocks ×
                                                                                 threads
=======================  ============================================  ========  ===========
all-reduce one-shot      loads ``(n−1)·S`` (every peer's whole buffer)  2         24 × 512
all-reduce two-shot      loads ``(n−1)·S/n``, stores ``(n−1)·S/n``       2         24 × 1024
all-reduce ``multimem``  ``ld_reduce`` and ``st`` of its ``S/n``        2         8 × 1024
                         through the NVSwitch: ``S + S/n`` on the
                         links (NCCL's bus bytes for its ``multimem``
                         kernel), each block's rate times ``n``
all-gather               stores ``(n−1)·S/n`` (``multimem``: the same,  2         24 (8) × 1024
                         each block's rate times ``0.55·n``, NCCL's)
reduce-scatter           loads ``(n−1)·S/n``                            2         24 × 1024
all-to-all (direct)      stores ``(n−1)·S/n`` into the peers' buffers   1         24 × 1024
=======================  ============================================  ========  ===========

The barrier (``sync_remote_blocks``) is per block and pairwise: a thread per peer sets a flag
in the peer's signal pad and spins on its own. Blocks: ``init_elementwise_launch_config``
gives a shard that fits one block's threads (16-byte vectors each) one block, else up to
the kernel's cap (read at pytorch/pytorch commit 03a4032b: one-shot 24 blocks of at most
512 threads, "register-intensive", so capped below two-shot's 24 × 1024; ``multimem`` and
its all-gather 8 × 1024; reduce-scatter runs the two-shot kernel's first half, so 24 × 1024).
The in-place two-shot vLLM calls (``two_shot_all_reduce_``) stores each reduced vector of
its shard into every peer's buffer, so its stores are the ``(n−1)·S/n`` of the table. The
direct all-to-all is vLLM's kernel, not torch's; its launch is taken as two-shot's.

Reductions are sums only (the ops take ``reduce_op="sum"``), so a max (``allreduce3``'s)
takes NCCL's regular path. ``multimem`` needs NVSwitch multicast (NVLS: Hopper and newer)
and more than two ranks.

**Prices** (:mod:`treeattn.sim.onesided.fixed_costs`: our analogy with NCCL's symmetric
kernels on the same GPUs, which publish a cost model): an exchange, plus each barrier, plus
the traffic at torch's block count times NCCL's per-block rate, capped at NCCL's load/store
ceiling (``multimem`` all-reduce: NCCL's ``multimem`` ceiling).

**Loads wait on the link.** A block's loads go no faster than its threads' outstanding
16-byte loads per NVLink round trip (Little's law): ``threads × loads in flight × 16 B``
per ``2 × 0.6`` µs, the round trip taken as twice NCCL's NVLink hop latency for its LL
protocol (``tuning.cc`` ``hwLat``: a flagged store seen by the peer). The kernels unroll
their loads over the peers (``load_and_reduce`` over the world size), so a thread of the
one-shot, the two-shot's reduce and the reduce-scatter has ``n − 1`` remote loads in
flight, a ``multimem`` thread one ``ld_reduce``; stores are posted and keep NCCL's
per-block rate. With few peers this binds well below the ceiling: on two H100s the
one-shot's 24 blocks of 512 threads load at ``24 × 512 × 16 B / 1.2 µs = 164`` GB/s.

A one-shot all-reduce on Hopper is so ``3.7`` µs plus its traffic (the fixed costs a graph
replay pays, :mod:`treeattn.sim.onesided.fixed_costs`).

**Which all-reduce kernel runs** is vLLM's choice, not the cheapest: its
``SymmMemCommunicator`` (vLLM ``vllm/distributed/device_communicators/symm_mem.py``, read at
commit 00859a52) runs ``multimem_all_reduce_`` for the world sizes of
``_WORLD_SIZES_MULTIMEM`` (SM 9.0: 4, 6, 8; SM 10.x: 6, 8) and ``two_shot_all_reduce_``
otherwise, whatever the size, and never the one-shot kernel. One kernel for every size also
keeps a price from falling as the message grows. The other ops take the cheapest kernel that
runs them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from treeattn.schedule.payloads import SimError
from treeattn.sim.nccl.collectives import CollectiveCost
from treeattn.sim.nccl.group_shape import GroupShape
from treeattn.sim.nccl.symmetric import ARCH
from treeattn.sim.nccl.tables import NCCL_HW_LAT
from treeattn.sim.onesided.fixed_costs import arch_costs, barrier_us, bytes_per_s, exchange_us

NAME = "symm_mem"
OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
SUM_ONLY = ("all_reduce", "reduce_scatter")
VECTOR_BYTES = 16  # bytes per thread and step (the 16-byte-aligned kernels)
# A load from a peer's memory is a request and a response over NVLink: twice NCCL's NVLink
# hop latency for its LL protocol (tuning.cc hwLat, 0.6 µs: a flagged store seen by the peer)
NVLINK_LOAD_ROUND_TRIP_S = 2 * NCCL_HW_LAT["nvlink"]["ring"][0] * 1e-6
# vLLM's SymmMemCommunicator._WORLD_SIZES_MULTIMEM by generation (SM 9.0; SM 10.x)
VLLM_MULTIMEM_WORLD_SIZES = {"hopper": (4, 6, 8), "blackwell": (6, 8)}


def domain_unavailable(shape: GroupShape) -> str | None:
    """Why this group cannot map its buffers into each other (None: it can)."""
    if shape.family != "nvidia" or shape.arch not in ARCH:
        return f"torch's symm_mem kernels are priced for Hopper or Blackwell, not {shape.arch}"
    if shape.nnodes != 1 or shape.intra != "nvlink" or not shape.nvswitch:
        return ("torch's symm_mem needs every GPU of the group in one NVLink domain "
                "(NVSwitch); this group is not")
    return None


def unavailable(op: str, shape: GroupShape, reduction: str = "sum") -> str | None:
    """Why torch's symm_mem would not run ``op`` for this group, or None."""
    if op not in OPS:
        return f"torch's symm_mem has no kernel for {op}"
    reason = domain_unavailable(shape)
    if reason is not None:
        return reason
    if op in SUM_ONLY and reduction != "sum":
        return f"torch's symm_mem {op} is a sum only, not a {reduction}"
    return None


@dataclass(frozen=True)
class Kernel:
    """One of the kernels above, for one op's size: the bytes one rank loads from and stores
    into its peers over NVLink, and the launch that moves them."""

    name: str
    loaded: float  # NVLink bytes one rank loads from its peers (or the switch)
    stored: float  # NVLink bytes one rank stores into its peers (or multicasts)
    barriers: int
    shard: float  # bytes one rank's blocks work through (sets the block count)
    max_blocks: int
    threads: int
    loads_in_flight: int = 1  # 16-byte loads each thread has outstanding per step
    multimem_ceiling: bool = False  # NCCL's multimem all-reduce ceiling applies
    rate_multiplier: float = 1.0  # NCCL's busMultiplier: the switch reduces n streams

    @property
    def moved(self) -> float:
        return self.loaded + self.stored

    def blocks(self) -> int:
        per_block = self.threads * VECTOR_BYTES
        return max(1, min(self.max_blocks, math.ceil(self.shard / per_block)))

    def load_block_Bps(self, per_block_Bps: float) -> float:
        """One block's load rate: NCCL's per-block rate, or, if lower, what its threads'
        outstanding loads deliver per NVLink round trip (Little's law)."""
        in_flight = self.threads * self.loads_in_flight * VECTOR_BYTES
        return min(per_block_Bps, in_flight / NVLINK_LOAD_ROUND_TRIP_S)

    def _seconds(self, nbytes: float, block_Bps: float, ceiling_Bps: float) -> float:
        if nbytes <= 0:
            return 0.0
        blocks = self.blocks()
        one = min(block_Bps * self.rate_multiplier, ceiling_Bps)
        time_s = nbytes / min(blocks * block_Bps * self.rate_multiplier, ceiling_Bps)
        if blocks > 1 and self.shard > 0:
            full_pass = nbytes * self.threads * VECTOR_BYTES / self.shard  # one block's pass
            time_s = max(time_s, full_pass / one)
        return time_s

    def traffic_s(self, per_block_Bps: float, ceiling_Bps: float) -> float:
        """Seconds the kernel's blocks take to load :attr:`loaded` and store :attr:`stored`.

        The blocks together move at their count times one block's rate (times NCCL's bus
        multiplier), at most the ceiling; a block's loads go no faster than
        :meth:`load_block_Bps`. Past one block's width (its threads × 16 bytes) every block
        holds a full pass of vectors: a kernel that launched a second block runs no shorter
        than one block's full pass, so a larger op is never cheaper (the per-block share
        halves at the threshold, the pass it waits on does not).
        """
        return (self._seconds(self.loaded, self.load_block_Bps(per_block_Bps), ceiling_Bps)
                + self._seconds(self.stored, per_block_Bps, ceiling_Bps))


def _kernels(op: str, nbytes: float, n: int, multimem: bool) -> list[Kernel]:
    share = nbytes / n
    peers = (n - 1) * share  # (n-1)/n of the op
    if op == "all_reduce":
        out = [Kernel("one_shot", (n - 1) * nbytes, 0.0, 2, nbytes, 24, 512, n - 1),
               Kernel("two_shot", peers, peers, 2, share, 24, 1024, n - 1)]
        if multimem:
            out.append(Kernel("multimem", nbytes, share, 2, share, 8, 1024, 1, True, n))
        return out
    if op == "all_gather":
        out = [Kernel("peer_store", 0.0, peers, 2, share, 24, 1024)]
        if multimem:
            # NCCL's bus bytes and multiplier for its multimem all-gather: (n-1) shares
            # arrive at each GPU, the switch's multicast raising each block's rate 0.55·n
            out.append(Kernel("multimem", 0.0, peers, 2, share, 8, 1024, 1, False, 0.55 * n))
        return out
    if op == "reduce_scatter":
        return [Kernel("peer_load", peers, 0.0, 2, share, 24, 1024, n - 1)]
    return [Kernel("direct_a2a", 0.0, peers, 1, share, 24, 1024)]


def symm_mem_kernels(op: str, nbytes: int, shape: GroupShape,
                     reduction: str = "sum") -> list[CollectiveCost]:
    """Every torch symm_mem kernel for ``op`` priced (``algorithm`` ``symm_mem_<kernel>``);
    [] where none runs."""
    if unavailable(op, shape, reduction) is not None:
        return []
    n = shape.nranks
    arch = arch_costs(shape)
    per_block = bytes_per_s(arch.sm_bw_all_reduce if op == "all_reduce" else arch.sm_bw)
    out = []
    for k in _kernels(op, float(nbytes), n, n > 2):
        ceiling = bytes_per_s(arch.peak_multimem_all_reduce if k.multimem_ceiling
                              else arch.peak)
        latency = (exchange_us(shape) + k.barriers * barrier_us(shape)) * 1e-6
        time_s = latency + k.traffic_s(per_block, ceiling)
        out.append(CollectiveCost(op, int(nbytes), f"symm_mem_{k.name}", "symm", latency,
                                  nbytes / max(time_s - latency, 1e-12), time_s))
    return out


def vllm_all_reduce_kernel(shape: GroupShape) -> str:
    """The symm_mem all-reduce kernel vLLM runs for this group: multimem or two-shot."""
    multimem = shape.nranks in VLLM_MULTIMEM_WORLD_SIZES[shape.arch] and shape.nranks > 2
    return "multimem" if multimem else "two_shot"


def symm_mem_cost(op: str, nbytes: int, shape: GroupShape,
                  reduction: str = "sum") -> CollectiveCost:
    """The symm_mem kernel that runs ``op``: vLLM's for an all-reduce, else the cheapest
    (raises SimError where none runs).

    >>> from treeattn.topo import Topology
    >>> shape = GroupShape.of(Topology.from_spec("dgx-h100"), range(8))
    >>> best = symm_mem_cost("all_reduce", 16384, shape)
    >>> best.algorithm, round(best.latency_s * 1e6, 2)
    ('symm_mem_multimem', 3.7)
    """
    reason = unavailable(op, shape, reduction)
    if reason is not None:
        raise SimError(reason)
    kernels = symm_mem_kernels(op, nbytes, shape, reduction)
    if op == "all_reduce":
        name = f"symm_mem_{vllm_all_reduce_kernel(shape)}"
        return next(c for c in kernels if c.algorithm == name)
    return min(kernels, key=lambda c: c.time_s)


def put_base_us(shape: GroupShape, ll: bool) -> float:
    """One message written into a peer's window and signalled: an exchange and one signal
    (the receiver waits on its pad). ``ll`` is ignored: torch has one put path."""
    return exchange_us(shape) + barrier_us(shape)
