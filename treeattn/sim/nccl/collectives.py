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

NCCL has no table for send/recv or all-to-all (it runs them as p2p transfers). We price a
p2p message as one hop of the protocol NCCL's enqueue picks for it (:func:`p2p_protocol`: LL
only where the connection has LL buffers, which network connections lack by default):
``baseLat[ring] + hwLat[class]`` (the tree's network latency across hosts, where a lone
message's latency is fully exposed), at the pair's bandwidth (halved for LL, whose flags
take half of each line); an all-to-all as the group of p2p transfers to every peer
(:func:`_all_to_all`). That is our own analogy, stated as such in the fidelity report.

>>> from treeattn.topo import Topology
>>> shape = GroupShape.of(Topology.from_spec("dgx-h100"), range(8))
>>> best = collective_cost("all_reduce", 8, shape)
>>> best.algorithm, best.protocol, round(best.time_s * 1e6, 1)
('ring', 'LL', 15.0)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from treeattn.schedule.payloads import SimError
from treeattn.sim.nccl import tables as T
from treeattn.sim.nccl.dtypes import REDUCING_OPS, check_dtype, normalize_dtype
from treeattn.sim.nccl.group_shape import GroupShape

__all__ = ["OPS", "CollectiveCost", "GroupShape", "a2a_peer_channels", "candidates",
           "check_dtype", "check_op", "collective_cost", "net_overhead_us", "normalize_dtype",
           "nvls_refusal", "p2p_cost", "p2p_parts", "p2p_protocol", "run_channels",
           "tree_correction"]

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


def _log_size(nbytes: int) -> int:
    return (nbytes >> 6).bit_length() - 1  # log2i(bytes / 64); -1 below 64 B


def _col(shape: GroupShape) -> int:
    return min(shape.nnodes, 3) - 1  # 1 node, 2 nodes, more


def _arch_row(table: dict, arch: str) -> tuple:
    return table.get(arch) or table.get(arch.split("-")[0]) or table["ampere"]


def net_overhead_us(s: GroupShape, p: int) -> float:
    """NCCL's and RCCL's network post overhead under a multi-node ring step (getNetOverhead):
    by the hosts' CPU vendor, ×3 for Simple."""
    base = T.NCCL_NET_OVERHEAD_US.get(s.cpu_vendor, T.NCCL_NET_OVERHEAD_US["other"])
    return base * (T.NCCL_NET_OVERHEAD_SIMPLE_FACTOR if p == 2 else 1)


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
    col = _col(s)
    nch = s.channels * share
    per_channel = s.intra_speed if s.nnodes <= 2 else s.inter_speed
    bus = nch * per_channel
    amd_hosts = s.cpu_vendor in ("amd", "mixed")  # llMaxBws' row on several nodes
    ll_max = (_arch_row(T.NCCL_LL_MAX_BW, s.arch)[0] if s.nnodes == 1
              else (T.NCCL_LL_MAX_BW_MULTINODE_AMD if amd_hosts
                    else T.NCCL_LL_MAX_BW_MULTINODE_INTEL)[col])
    if algo == "ring":
        if p == 0:
            return min(ll_max, 0.5 * bus)
        if p == 1:
            return min(0.92 * bus, nch * _arch_row(T.NCCL_PER_CH_RING_LL128, s.arch)[col])
        return bus
    if algo == "tree":
        bus = min(0.92 * bus, nch * _arch_row(T.NCCL_PER_CH_TREE, s.arch)[col])
        if p == 0:
            return min(bus / 3.8, ll_max)
        if p == 1:
            factor = 7 / 9 if s.nnodes == 1 else 120 / 128
            return min(bus * factor, nch * _arch_row(T.NCCL_PER_CH_TREE_LL128, s.arch)[col])
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
    for algo, p in _nvidia_options(op, s, dtype, reduction):
        latency = _nvidia_latency_us(op, algo, p, s)
        if (algo == "ring" and p == 2 and op == "all_reduce" and s.nnodes > 1
                and nbytes / (s.compute_channels * s.nranks) >= 64):
            plateau = T.NCCL_RING_SIMPLE_PLATEAU
            latency *= (plateau["below"] if T.NCCL_COMP_CAP.get(s.arch, 0)
                        < plateau["below_comp_cap"] else plateau["from"])
        factor = _bus_to_alg(op, algo, s)
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
        cost = _priced(op, nbytes, algo, p, latency, alg_bw * price_corr)
        if used < total or rank_corr != price_corr:
            # NCCL ranks by its estimate: every channel, the correction as a step. Where ring
            # LL wins that ranking and runs on few channels (multi-node broadcasts: 27-56%
            # time drops as the size grows past the switch on 4 DGX A100/B200, 8 DGX H100
            # nodes, 36-72 GB200s), the price follows NCCL's order (choose on every
            # channel, run on few); no published measurement checks the one-channel LL rate
            tuner_bw = _nvidia_bus_bw(op, algo, p, s) * factor * rank_corr
            cost = replace(cost, tuner_s=_priced(op, nbytes, algo, p, latency, tuner_bw).time_s)
        costs.append(cost)
    return costs


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
    log_size = _log_size(nbytes)
    if not 0 <= log_size < len(table):
        return 1.0
    if stepped:
        return table[log_size]
    upper = table[log_size + 1] if log_size + 1 < len(table) else 1.0
    return table[log_size] + (upper - table[log_size]) * (math.log2(nbytes / 64) - log_size)


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


def _bus_to_alg(op: str, algo: str, s: GroupShape) -> float:
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


def _rccl_msccl_allreduce(nbytes: int, s: GroupShape) -> CollectiveCost | None:
    """The all-pairs MSCCL schedule RCCL runs instead of the tuner, where it applies.

    It applies (``mscclEnqueueCheck``) on one node of exactly 8 gfx942 GPUs, within the XML's
    size range, and only when the element count divides into its chunks per loop (256
    floats: from 1 KiB, in steps of 1 KiB); anything else falls through to the tuner. Two
    dependent direct hops: every GPU sends bytes/8 to each peer, reduces, and sends its
    reduced eighth to each peer again, each pair on its own xGMI link.
    """
    x = T.RCCL_MSCCL_ALLREDUCE
    count, rest = divmod(nbytes, x["element_bytes"])
    if (not s.rccl_msccl or s.nnodes != 1 or s.nranks != x["ranks"] or s.arch != x["arch"]
            or rest or count % x["chunks_per_loop"]
            or not x["min_bytes"] <= nbytes <= x["max_bytes"]):
        return None
    p = T.PROTOCOLS.index(x["protocol"])
    latency = (T.RCCL_BASE_LAT["ring"][p]
               + x["hops"] * T.RCCL_HW_LAT[s.intra]["ring"][p]) * s.lat_scale
    per_link = x["hops"] * nbytes / s.nranks  # bytes each link carries
    efficiency = 0.5 if x["protocol"] == "LL" else 1.0  # LL's flags take half of each line
    alg_bw = nbytes / per_link * s.p2p_intra_GBps * efficiency
    return _priced("all_reduce", nbytes, "msccl_allpairs", p, latency, alg_bw)


def _amd_costs(op: str, nbytes: int, s: GroupShape) -> list[CollectiveCost]:
    if op == "all_reduce":
        msccl = _rccl_msccl_allreduce(nbytes, s)
        if msccl is not None:
            return [msccl]
    algos = ["ring"] + (["tree"] if op == "all_reduce" else [])
    row = 0 if s.nnodes <= 2 else 1
    per_channel = s.intra_speed if s.nnodes <= 2 else s.inter_speed
    log_size = min(max(_log_size(nbytes), 0), 26)
    costs = []
    for algo in algos:
        for p in (0, 2):  # RCCL leaves LL128 off on MI300X unless forced
            if algo == "tree" and p == 2 and s.nnodes == 1:
                continue  # RCCL skips tree Simple on one gfx942 node
            base = T.RCCL_BASE_LAT[algo][p] * s.lat_scale
            intra = T.RCCL_HW_LAT[s.intra][algo][p] * s.lat_scale
            inter_algo = "tree" if s.ppn == 1 else algo  # RCCL keeps NCCL's ppn == 1 rule
            inter = T.RCCL_HW_LAT["net"][inter_algo][p] * s.net_lat_scale
            if algo == "ring" and op == "broadcast":
                hop = T.RCCL_HW_LAT["net"]["ring"][p] * s.net_lat_scale if s.nnodes > 1 else intra
                latency = base + hop
            elif algo == "ring":
                if s.nnodes > 1:  # RCCL keeps getNetOverhead under a multi-node ring step
                    intra = max(intra, net_overhead_us(s, p))
                steps = 2 * (s.nranks - 1) if op == "all_reduce" else s.nranks - 1
                inter_steps = 0 if s.nnodes == 1 else (2 if op == "all_reduce" else 1) * (
                    s.nnodes - 1)
                latency = base + (steps - inter_steps) * intra + inter_steps * inter
            else:
                latency = base + 2 * ((s.ppn - 1) * intra + int(math.log2(s.nnodes)) * inter)
            bus = s.channels * per_channel * T.RCCL_BW_RATIO[algo][row][p]
            proto = T.PROTOCOLS[p]
            correction = 1.0
            if algo == "tree":
                correction = T.RCCL_TREE_CORRECTION[proto][log_size]
            elif s.nnodes > 1:
                correction = T.RCCL_RING_CORRECTION[proto][log_size]
            alg_bw = bus * _bus_to_alg(op, algo, s)
            cost = _priced(op, nbytes, algo, p, latency, alg_bw)
            tuner = _priced(op, nbytes, algo, p, latency, alg_bw * correction)
            costs.append(replace(cost, tuner_s=tuner.time_s))
    forced = _rccl_forced_protocol(op, nbytes, s)
    if forced is not None:
        costs = [c for c in costs if c.protocol == forced] or costs
    return costs


def _rccl_forced_protocol(op: str, nbytes: int, s: GroupShape) -> str | None:
    """RCCL's post-model protocol choice on MI300X (rccl_wrap.cc): LL up to a per-rank size."""
    per_rank = nbytes / s.nranks if op in ("all_gather", "reduce_scatter") else nbytes
    if s.nnodes > 1 and op in T.RCCL_LL_MAX_PER_RANK_MULTINODE:
        return "LL" if per_rank <= T.RCCL_LL_MAX_PER_RANK_MULTINODE[op] else "Simple"
    if s.nnodes == 1 and op == "reduce_scatter" and per_rank <= T.RCCL_LL_MAX_PER_RANK_RS_ONE_NODE:
        return "LL"
    return None


def _priced(op, nbytes, algo, p, latency_us, alg_bw_GBps) -> CollectiveCost:
    time_us = latency_us + (nbytes / (1000.0 * alg_bw_GBps) if nbytes else 0.0)
    return CollectiveCost(op, int(nbytes), algo, T.PROTOCOLS[p], latency_us * 1e-6,
                          alg_bw_GBps * 1e9, time_us * 1e-6)


def p2p_protocol(nbytes: float, s: GroupShape, across_nodes: bool = False) -> int:
    """NCCL's protocol for one send/recv of ``nbytes`` on communicator ``s`` (0 LL, 2 Simple).

    ``addP2pToPlan`` (enqueue.cc) keeps LL only where the connection has an LL buffer and
    the bytes are at most ``nChannels × 16 KiB``,
    ``nChannels = min(nChannelsMin, ceil(bytes / minPartSize))``; the minimum part is the p2p
    chunk over 8 on one node, over 2 on several (512 KiB chunks on an all-NVLink node, 128 KiB
    otherwise). So 64 KiB parts (one channel, LL up to 16 KiB) on NVLink and across nodes,
    16 KiB parts (up to ``nChannelsMin`` = 2 channels, LL up to 32 KiB) on one PCIe node.
    A connection to another host (NCCL's net transport) has an LL buffer only under
    ``NCCL_ALLOC_P2P_NET_LL_BUFFERS=1`` (``s.p2p_net_ll``, :mod:`treeattn.sim.nccl.env`), so
    by default every message across hosts is Simple; inside a host the p2p and shm transports
    always map one. RCCL runs the same code (its enqueue.cc keeps NCCL_P2P_LL_THRESHOLD, its
    init.cc the same parameter, default 0).

    >>> from treeattn.topo import Topology
    >>> two = GroupShape.of(Topology.from_spec("dgx-h100:nodes=2"), range(16))
    >>> p2p_protocol(16384, two), p2p_protocol(16384, two, across_nodes=True)
    (0, 2)
    """
    if across_nodes and not s.p2p_net_ll:
        return 2
    if s.nnodes == 1 and s.intra == "nvlink":
        chunk, divisor = T.NCCL_P2P_CHUNK["nvlink"], 8
    else:
        chunk, divisor = T.NCCL_P2P_CHUNK["other"], 8 if s.nnodes == 1 else 2
    min_part = chunk // divisor
    channels = max(1, min(T.NCCL_P2P_CHANNELS, math.ceil(nbytes / min_part)))
    return 0 if nbytes <= channels * T.NCCL_P2P_LL_THRESHOLD else 2


def p2p_parts(nbytes: float, s: GroupShape, across_nodes: bool) -> tuple[int, float, float,
                                                                         float]:
    """``(protocol, base µs, hop µs, GB/s)`` of one send/recv: THE p2p price, which the engine
    (:mod:`treeattn.sim.nccl.p2p`), the closed forms, the all-to-all and :func:`p2p_cost` all
    use.

    NCCL has no p2p table; our analogy is one hop of the chosen protocol
    (:func:`p2p_protocol`, which depends on whether the pair crosses hosts):
    ``baseLat[ring][p]`` plus the library's per-hop latency for the link class, at the
    pair's bandwidth as the tuning model sees it (the GPU's NVLink total, or its rail's share
    of the network), halved for LL, whose flags take half of each line. The per-hop latency
    is given per algorithm and a send/recv is neither. Across hosts a lone message's latency
    is fully exposed, and for that case NCCL's own model uses the tree's network latency
    (``tuning.cc``: "With ppn=1 latencies are fully exposed, use the Tree network latency"):
    5.0 µs for LL, 14.0 µs for Simple on NCCL; 10.5 and 25 µs on RCCL (whose tuned 320 µs
    ring-Simple network hop is a selection weight, not a hop's cost). Inside a host we take
    the smaller of the ring's and the tree's figure (the ring's, but PCIe Simple).
    """
    hw = "net" if across_nodes else s.intra
    bw = s.p2p_inter_GBps if across_nodes else s.p2p_intra_GBps
    p = p2p_protocol(nbytes, s, across_nodes)
    hop_scale = s.net_lat_scale if hw == "net" else s.local_lat_scale
    base_t, hw_t = ((T.RCCL_BASE_LAT, T.RCCL_HW_LAT) if s.family == "amd"
                    else (T.NCCL_BASE_LAT, T.NCCL_HW_LAT))
    hop = hw_t[hw]["tree"][p] if across_nodes else min(hw_t[hw]["ring"][p], hw_t[hw]["tree"][p])
    return (p, base_t["ring"][p] * s.local_lat_scale, hop * hop_scale,
            bw * (0.5 if p == 0 else 1.0))


def p2p_cost(nbytes: int, s: GroupShape, *, across_nodes: bool | None = None,
             op: str = "sendrecv") -> CollectiveCost:
    """One send/recv of ``nbytes`` between two ranks of ``s`` (see :func:`p2p_parts`)."""
    net = s.nnodes > 1 if across_nodes is None else across_nodes
    p, base, hop, bw = p2p_parts(nbytes, s, net)
    return _priced(op, nbytes, "p2p", p, base + hop, bw)


def a2a_peer_channels(per_peer: float, s: GroupShape) -> int:
    """Channels one peer's send (and receive) of an all-to-all runs on (enqueue.cc
    ``scheduleP2pTasksToPlan``, ``addP2pToPlan``): the per-peer channels, halved until they
    times the ranks fit in the p2p channels, and no more than the message has minimum parts
    (the p2p chunk over 8 on one node, over 2 on several: 64 KiB on NVLink).

    >>> from treeattn.topo import Topology
    >>> shape = GroupShape.of(Topology.from_spec("dgx-h100"), range(8))
    >>> a2a_peer_channels(1 << 20, shape), a2a_peer_channels(4096, shape)
    (4, 1)
    """
    most, min_part = _a2a_channel_limits(s)
    return max(1, min(most, math.ceil(per_peer / min_part)))


def _a2a_channel_limits(s: GroupShape) -> tuple[int, int]:
    """(most channels a peer's transfer gets, bytes of a minimum part) in an all-to-all."""
    most = max(1, s.p2p_peer_channels)
    while most * s.nranks > s.p2p_channels and most > 1:
        most //= 2
    if s.nnodes == 1 and s.intra == "nvlink":
        return most, T.NCCL_P2P_CHUNK["nvlink"] // 8
    return most, T.NCCL_P2P_CHUNK["other"] // (8 if s.nnodes == 1 else 2)


def _all_to_all(nbytes: int, s: GroupShape) -> CollectiveCost:
    """All-to-all as NCCL runs it: a group of sends and receives of ``nbytes / n`` to and from
    every peer, all in flight together (NCCL has no all-to-all algorithm: nccl-tests'
    ``alltoall`` calls ``ncclSend``/``ncclRecv`` to every peer inside one group).

    Latency (our analogy, NCCL keeps no all-to-all entry): for the peers of the node, the
    tuning model's latency of a ring all-gather over the same ranks at the chosen protocol,
    ``baseLat[ring] + (n − 1) · hwLat[class][ring]``: each GPU moves the same ``n − 1``
    shares, and a 2-rank all-to-all is one send/recv. For network peers, one message's
    latency plus the proxy posting each further peer's send and receive one after another
    at NCCL's network post overhead (``getNetOverhead``, by CPU vendor, ×3 for Simple). So
    it grows with the peer count, and never beats one message.

    Bandwidth: each peer's transfer runs on :func:`a2a_peer_channels` channels. NCCL counts
    them as ``divUp(per_peer, min_part)``; as a price we take ``per_peer / min_part`` as a
    real number between 1 and the most, the lower envelope of that count (never more
    channels than NCCL's, so the time never falls where a part is added; :func:`run_channels`
    instead takes the upper envelope of NCCL's floor count), at the compute channel's share
    of the ring's bus bandwidth (search channels × speed / compute channels), the peers of
    one class together at most that class's bandwidth (the GPU's NVLink total, or its
    rail's share of the network); LL halves both.
    """
    per_peer = nbytes // max(1, s.nranks)
    parts = []
    if s.ppn > 1:
        p, base, hop, bw = p2p_parts(per_peer, s, False)
        local = s.ppn - 1
        wire = local * per_peer / (bw * 1e9)
        if s.family == "nvidia" and s.intra_speed > 0:
            per_channel = s.channels * s.intra_speed / s.compute_channels * (
                0.5 if p == 0 else 1.0)
            most, min_part = _a2a_channel_limits(s)
            peer_channels = max(1.0, min(most, per_peer / min_part))
            peer_bw = min(bw, peer_channels * per_channel)
            wire = max(wire, per_peer / (peer_bw * 1e9))
        parts.append((p, base + local * hop, wire))
    if s.nnodes > 1:
        p, base, hop, bw = p2p_parts(per_peer, s, True)
        remote = s.nranks - s.ppn
        posts = (remote - 1) * net_overhead_us(s, p)  # one step (send + receive) per peer
        parts.append((p, base + hop + posts, remote * per_peer / (bw * 1e9)))
    latency = max(lat for _, lat, _ in parts) * 1e-6
    wire = max(w for _, _, w in parts)
    bandwidth = nbytes / wire if wire else math.inf
    return CollectiveCost("all_to_all", int(nbytes), "p2p", T.PROTOCOLS[parts[-1][0]], latency,
                          bandwidth, latency + wire)


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
        return [_all_to_all(nbytes, shape)]
    if shape.family == "amd":
        return _amd_costs(op, nbytes, shape)
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
