"""What one collective (or one send/recv) costs, priced the way NCCL and RCCL price it.

Decode merges move kilobytes, so their cost is almost all latency, and latency is where a
collective and a chain of point-to-point sends differ most. This module follows the
libraries' own tuning model (constants in :mod:`treeattn.sim.nccl.tables`, with sources):

1. **Describe the group** as NCCL's search sees it (:class:`GroupShape`, in
   :mod:`treeattn.sim.nccl.group_shape`): ranks, nodes, GPUs
   per node, the link class inside a node (NVLink/xGMI or PCIe), NVSwitch or not, and the
   per-channel bandwidth its topology search would settle on. All of it is read off the
   topology graph.
2. **Enumerate** every (algorithm, protocol) pair the library would consider for the op:
   ring, tree, NVLS and NVLS-tree (NVSwitch, Hopper and newer), PAT (one GPU per node), each
   with LL, LL128 and Simple where allowed.
3. **Price each**: ``time = latency + bytes / bandwidth``. Latency is a base per
   (algorithm, protocol) plus a per-hop latency per link class times the hops the algorithm
   makes, the node-local part scaled to the GPU generation (NCCL's figures describe Hopper);
   bandwidth is channels × per-channel speed, scaled per protocol and converted from bus to
   algorithm bandwidth, on the channels NCCL runs a message of that size on
   (:func:`run_channels`).
4. **Pick the fastest** by the library's own estimate, as NCCL does (RCCL then forces LL or
   Simple by size on MI300X).

``nbytes`` means what nccl-tests' ``size`` column means: the whole buffer of an all-reduce or
broadcast, the whole gathered (scattered) buffer of an all-gather (reduce-scatter), the whole
send buffer of an all-to-all, and one message of a send/recv.

Send/recv and all-to-all, which NCCL runs as p2p transfers, are priced in
:mod:`treeattn.sim.nccl.sendrecv`; RCCL's model is :mod:`treeattn.sim.nccl.rccl`.

>>> from treeattn.topo import Topology
>>> shape = GroupShape.of(Topology.from_spec("dgx-h100"), range(8))
>>> best = collective_cost("all_reduce", 8, shape)
>>> best.algorithm, best.protocol, round(best.time_s * 1e6, 1)
('ring', 'LL', 15.0)
"""

from __future__ import annotations

import functools
import math
from dataclasses import replace

from treeattn.schedule.payloads import SimError
from treeattn.sim.nccl import tables as T
from treeattn.sim.nccl.cost import (
    OPS,
    CollectiveCost,
    arch_row,
    bus_to_alg,
    log_size,
    net_overhead_us,
    priced,
    size_column,
)
from treeattn.sim.nccl.dtypes import REDUCING_OPS, check_dtype, normalize_dtype
from treeattn.sim.nccl.group_shape import GroupShape
from treeattn.sim.nccl.rccl import amd_costs
from treeattn.sim.nccl.sendrecv import all_to_all, p2p_cost

__all__ = ["OPS", "CollectiveCost", "GroupShape", "candidates", "check_dtype", "check_op",
           "collective_cost", "net_overhead_us", "normalize_dtype", "nvls_refusal", "p2p_cost",
           "run_channels", "tree_correction"]


def _nvidia_latency_us(op: str, algo: str, p: int, s: GroupShape) -> float:
    base = T.NCCL_BASE_LAT[algo][p] * s.local_lat_scale
    intra = T.NCCL_HW_LAT[s.intra][algo][p] * s.local_lat_scale
    inter_algo = "tree" if s.ppn == 1 and algo in ("tree", "ring") else algo
    inter = T.NCCL_HW_LAT["net"][inter_algo][p] * s.net_lat_scale
    log_nodes = int(math.log2(s.nnodes))
    if algo == "ring":
        if op == "broadcast":  # channels identical: one hop of the ring's hardware, pipelined
            return base + (T.NCCL_HW_LAT["net"]["ring"][p] * s.net_lat_scale if s.nnodes > 1
                           else intra)
        if s.nnodes > 1:  # the proxy's network overhead hides the NVLink hop
            intra = max(intra, net_overhead_us(s, p))
        steps = 2 * (s.nranks - 1) if op == "all_reduce" else s.nranks - 1
        inter_steps = 0 if s.nnodes == 1 else (2 if op == "all_reduce" else 1) * (s.nnodes - 1)
        return base + (steps - inter_steps) * intra + inter_steps * inter
    if algo == "tree":
        return base + 2 * ((s.ppn - 1) * intra + log_nodes * inter)
    if algo == "nvls":
        return intra + (inter if s.nnodes > 1 else 0.0)
    if algo == "nvls_tree":
        return intra + 2 * log_nodes * inter
    return base + log_nodes * inter / 3.5 + s.nranks * 2.8  # pat


def _nvidia_bus_bw(op: str, algo: str, p: int, s: GroupShape, share: float = 1.0) -> float:
    """Bus bandwidth of ``algo``/protocol ``p`` (tuning.cc) on ``share`` of the channels.

    The bus bandwidth is the channels' (``share`` of the search channels: the ones a small
    message runs on, :func:`run_channels`) times their speed; the ``perChMax*`` caps scale
    with those channels, while ``llMaxBws`` is one cap for the whole GPU, applied after.
    """
    col = size_column(s)
    nch = s.channels * share
    per_channel = s.intra_speed if s.nnodes <= 2 else s.inter_speed
    bus = nch * per_channel
    amd_hosts = s.cpu_vendor in ("amd", "mixed")  # llMaxBws' row on several nodes
    ll_max = (arch_row(T.NCCL_LL_MAX_BW, s.arch)[0] if s.nnodes == 1
              else (T.NCCL_LL_MAX_BW_MULTINODE_AMD if amd_hosts
                    else T.NCCL_LL_MAX_BW_MULTINODE_INTEL)[col])
    if algo == "ring":
        if p == 0:
            return min(ll_max, 0.5 * bus)
        if p == 1:
            return min(0.92 * bus, nch * arch_row(T.NCCL_PER_CH_RING_LL128, s.arch)[col])
        return bus
    if algo == "tree":
        bus = min(0.92 * bus, nch * arch_row(T.NCCL_PER_CH_TREE, s.arch)[col])
        if p == 0:
            return min(bus / 3.8, ll_max)
        if p == 1:
            factor = 7 / 9 if s.nnodes == 1 else 120 / 128
            return min(bus * factor, nch * arch_row(T.NCCL_PER_CH_TREE_LL128, s.arch)[col])
        return bus
    if algo in ("nvls", "nvls_tree"):
        if s.nnodes == 1:  # the group's own NVLS graph: one channel per GPU
            nvls_ch, intra_speed, inter_speed = (s.nvls_channels, s.nvls_intra_speed,
                                                 s.nvls_inter_speed)
        else:
            nvls_ch, intra_speed, inter_speed = T.NCCL_NVLS_GRAPH
            inter_speed = min(inter_speed, s.inter_speed * 2)
        eff = T.NCCL_NVLS_EFFICIENCY[s.arch]
        intra_bw = intra_speed * eff * (nvls_ch - 1) / nvls_ch
        intra_bw *= 2 if op == "all_reduce" else (s.ppn - 1) / s.ppn
        # tuning.cc: min(intraBw, bwInter), on one node too (pass 2 sets bwInter there)
        bw = min(intra_bw, inter_speed * (2 if algo == "nvls_tree" and s.nnodes <= 2 else 1))
        if algo == "nvls_tree":
            bw = min(bw, T.NCCL_PER_CH_NVLS_TREE[s.arch][col])
        return nvls_ch * bw
    return 0.75 * bus  # pat


def nvls_refusal(op: str, s: GroupShape, dtype: str = "float32",
                 reduction: str = "sum") -> str | None:
    """Why NCCL would not run ``op`` on NVLS for group ``s`` (None: it may).

    NVLS needs NVSwitch multicast (Hopper and newer), at least 2 GPUs and 2 channels of the
    node's NVLS graph (search.cc, tuning.cc); a reduction only of the (dtype, op) pairs
    ``ncclNvlsSupported`` lists (nccl_tables: NVLS), an all-gather of any dtype.
    """
    if not (s.nvswitch and s.arch in ("hopper", "blackwell")):
        return "NVLS needs NVSwitch multicast on Hopper or newer GPUs"
    if s.ppn < 2 or (s.nnodes == 1 and s.nvls_channels < 2):
        return "NVLS needs at least 2 GPUs of a node"
    if op in ("all_reduce", "reduce_scatter") and reduction not in T.NCCL_NVLS_REDUCTIONS.get(
            dtype, ()):
        return f"NCCL's NVLS kernels do not reduce {dtype} with {reduction}"
    return None


def _nvidia_options(op: str, s: GroupShape, dtype: str = "float32",
                    reduction: str = "sum") -> list[tuple[str, int]]:
    nvls_ok = nvls_refusal(op, s, dtype, reduction) is None
    algos: list[str] = ["ring"]
    if op == "all_reduce":
        algos.append("tree")
        if nvls_ok:
            algos.append("nvls" if s.nnodes == 1 else "nvls_tree")
    elif op in ("all_gather", "reduce_scatter"):
        if nvls_ok and s.nnodes == 1:
            algos.append("nvls")
        if s.ppn == 1 and s.nnodes > 1:
            algos.append("pat")
    ll128 = s.intra == "nvlink"  # LL128 needs NVLink-class paths inside the node
    options = []
    for algo in algos:
        for p in range(3):
            simple_only = algo in ("nvls", "nvls_tree", "pat")
            if (simple_only and p != 2) or (p == 1 and not ll128):
                continue
            options.append((algo, p))
    return options


def _nvidia_costs(op: str, nbytes: int, s: GroupShape, dtype: str = "float32",
                  reduction: str = "sum") -> list[CollectiveCost]:
    costs = []
    # NCCL ranks by its own latency tables; the generation factor (tables.py) prices the
    # pick, it does not move NCCL's switch points
    as_tuned = _as_tuned(s) if s.gen_lat_scale != 1.0 else s
    for algo, p in _nvidia_options(op, s, dtype, reduction):
        latency = _nvidia_latency_us(op, algo, p, s)
        tuned_latency = _nvidia_latency_us(op, algo, p, as_tuned)
        if (algo == "ring" and p == 2 and op == "all_reduce" and s.nnodes > 1
                and nbytes / (s.compute_channels * s.nranks) >= 64):
            plateau = T.NCCL_RING_SIMPLE_PLATEAU
            step = (plateau["below"] if T.NCCL_COMP_CAP.get(s.arch, 0)
                    < plateau["below_comp_cap"] else plateau["from"])
            latency *= step
            tuned_latency *= step
        factor = bus_to_alg(op, algo, s)
        if algo == "tree" and s.nnodes > 1 and s.ppn == 1:
            factor *= T.NCCL_TREE_PATTERN_FACTOR  # one GPU per node: search.cc's PATTERN_TREE
        price_corr = rank_corr = 1.0
        if op == "all_reduce" and (algo == "tree" or (algo == "nvls_tree" and s.cpu_x86
                                   and T.NCCL_COMP_CAP.get(s.arch, 0)
                                   >= T.NCCL_NVLS_TREE_CORRECTION_MIN_COMP_CAP)):
            price_corr = tree_correction(p, nbytes, algo=algo)
            rank_corr = tree_correction(p, nbytes, algo=algo, stepped=True)
        used, total = run_channels(algo, p, nbytes, s)
        alg_bw = _nvidia_bus_bw(op, algo, p, s, used / total) * factor
        cost = priced(op, nbytes, algo, p, latency, alg_bw * price_corr)
        if used < total or rank_corr != price_corr or tuned_latency != latency:
            # NCCL ranks by its estimate: every channel, the correction as a step, its own
            # latencies. Where ring
            # LL wins that ranking and runs on few channels (multi-node broadcasts: 27-56%
            # time drops as the size grows past the switch on 4 DGX A100/B200, 8 DGX H100
            # nodes, 36-72 GB200s), the price follows NCCL's order (choose on every
            # channel, run on few); no published measurement checks the one-channel LL rate
            tuner_bw = _nvidia_bus_bw(op, algo, p, s) * factor * rank_corr
            cost = replace(cost, tuner_s=priced(op, nbytes, algo, p, tuned_latency,
                                                 tuner_bw).time_s)
        costs.append(cost)
    return costs


@functools.lru_cache(maxsize=256)
def _as_tuned(s: GroupShape) -> GroupShape:
    """``s`` with NCCL's own latency tables (no generation factor), as NCCL ranks on it."""
    return replace(s, gen_lat_scale=1.0)


def tree_correction(p: int, nbytes: int, *, algo: str = "tree", stepped: bool = False) -> float:
    """The factor on a tree's (``algo`` "tree" or "nvls_tree") bandwidth at ``nbytes`` for
    protocol ``p``: NCCL's ``treeCorrectionFactor`` (tuning.cc: one entry per power of two
    from 64 B, none below 64 B, nor from 512 MiB on a tree and 1 GiB on NVLS_TREE).

    NCCL applies its entry as a step from one power of two to the next (``stepped``: the
    factor its tuner ranks by); as a step it makes a tree's time fall as the message grows
    (up to 23% just below 4 MiB on LL128, whose entries go from 0.6 to 0.8 there). For the
    price we take the line through the entries in log2(size), exact at every power of two
    (where nccl-tests measure). No entry rises by more than 0.2 per doubling from at least
    0.4, so the priced time keeps growing.

    >>> tree_correction(1, 2 << 20), round(tree_correction(1, 3 << 20), 3)
    (0.6, 0.717)
    >>> tree_correction(1, 3 << 20, stepped=True)
    0.6
    """
    table = T.NCCL_TREE_CORRECTION[T.PROTOCOLS[p]][:T.NCCL_TREE_CORRECTION_ENTRIES[algo]]
    step = log_size(nbytes)
    if not 0 <= step < len(table):
        return 1.0
    if stepped:
        return table[step]
    upper = table[step + 1] if step + 1 < len(table) else 1.0
    return table[step] + (upper - table[step]) * (math.log2(nbytes / 64) - step)


def run_channels(algo: str, p: int, nbytes: int, s: GroupShape) -> tuple[float, int]:
    """(channels the kernel runs on, the communicator's channels) for ``nbytes`` on a ring
    or tree (enqueue.cc ``topoGetAlgoInfo``): from ``comm->nChannels`` (the compute
    channels, ``GroupShape.compute_channels``), a channel is dropped while the bytes are
    below channels × threads × the protocol's per-thread threshold
    (``NCCL_LL_THREAD_THRESHOLD`` 8, LL128 8, Simple 64 bytes; a ring's LL threshold ×
    ranks, tuning.cc) at the protocol's threads (LL 512, LL128 640, Simple 512, or 256 on a
    ring of at most 12 GB/s). A small message's bus bandwidth is
    that of the channels it runs on (``used / total`` of them), with the per-channel caps
    scaled to them and the whole-GPU ``llMaxBws`` cap as is; NCCL's own estimate, by which
    it picks, assumes every channel.

    NCCL's count is an integer, ``floor(bytes / (threads × threshold))``; we take it as a
    real number (at least 1), the upper envelope of that count (never fewer channels than
    NCCL's; the all-to-all's per-peer count is the other way round): the wire time is flat
    while channels are added and never falls as the message grows, and it is within
    ``(k + 1) / k`` of NCCL's at ``k`` channels.

    >>> from treeattn.topo import Topology
    >>> shape = GroupShape.of(Topology.from_spec("dgx-h100"), range(8))
    >>> run_channels("ring", 0, 65536, shape), run_channels("ring", 0, 1 << 30, shape)
    ((2.0, 24), (24, 24))
    """
    total = s.compute_channels
    if algo not in ("ring", "tree"):
        return total, total
    threads = T.NCCL_MAX_THREADS[T.PROTOCOLS[p]]
    slow_bw, slow_threads = T.NCCL_SLOW_RING_SIMPLE
    if algo == "ring" and p == 2 and s.channels * s.intra_speed <= slow_bw:
        threads = slow_threads
    threshold = T.NCCL_THREAD_THRESHOLD[T.PROTOCOLS[p]]
    if algo == "ring" and p == 0:
        threshold *= s.nranks
    return (total if nbytes >= total * threads * threshold
            else max(1.0, nbytes / (threads * threshold))), total


def candidates(op: str, nbytes: int, shape: GroupShape, dtype: str = "float32",
               reduction: str = "sum") -> list[CollectiveCost]:
    """Every (algorithm, protocol) the library would consider for ``op`` on ``dtype`` data
    (reduced with ``reduction``), priced."""
    check_op(op, nbytes)
    dtype = check_dtype(op, dtype, shape, reduction)
    if shape.nranks == 1:
        return [CollectiveCost(op, int(nbytes), "local", "none", 0.0, math.inf, 0.0)]
    if op == "sendrecv":
        return [p2p_cost(nbytes, shape)]
    if op == "all_to_all":
        return [all_to_all(nbytes, shape)]
    if shape.family == "amd":
        return amd_costs(op, nbytes, shape)
    costs = _nvidia_costs(op, nbytes, shape, dtype, reduction)
    if dtype.startswith("float8") and op in REDUCING_OPS and shape.nranks > 8:
        # enqueue.cc: fp8 rings of more than 8 ranks lose precision; the tuner's estimate is
        # multiplied by 1024 so any other algorithm wins
        costs = [replace(c, tuner_s=c.choice_s * T.NCCL_FP8_DEEP_RING_PENALTY)
                 if c.algorithm == "ring" else c for c in costs]
    return costs


def collective_cost(op: str, nbytes: int, shape: GroupShape, *, algorithm: str | None = None,
                    protocol: str | None = None, dtype: str = "float32",
                    reduction: str = "sum") -> CollectiveCost:
    """The fastest priced way to run ``op`` (optionally forcing an algorithm or protocol).

    ``dtype`` and ``reduction`` decide where NVLS may run (:func:`nvls_refusal`); an op on a
    dtype NCCL cannot run it on raises :class:`SimError` (:func:`check_dtype`).
    """
    options = [c for c in candidates(op, nbytes, shape, dtype, reduction)
               if (algorithm is None or c.algorithm == algorithm)
               and (protocol is None or c.protocol == protocol)]
    if not options:
        raise SimError(f"{op}: no {algorithm or ''} {protocol or ''} variant on this group")
    return min(options, key=lambda c: c.choice_s)


def check_op(op: str, nbytes: int) -> None:
    """Raise :class:`SimError` for an unknown op or a size below one byte."""
    if op not in OPS:
        raise SimError(f"unknown op {op!r} (known: {', '.join(OPS)})")
    if not isinstance(nbytes, int) or nbytes < 1:
        raise SimError(f"message size must be a positive number of bytes, got {nbytes!r}")
