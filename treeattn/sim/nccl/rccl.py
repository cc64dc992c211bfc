"""RCCL's collectives on AMD GPUs (gfx942, MI300X): its tuning model, its MSCCL all-pairs
schedule and the protocol it forces after the model (constants and sources in
:mod:`treeattn.sim.nccl.tables`, ``RCCL`` and ``MSCCL`` rows)."""

from __future__ import annotations

import math
from dataclasses import replace

from treeattn.sim.nccl import tables as T
from treeattn.sim.nccl.cost import (
    CollectiveCost,
    bus_to_alg,
    log_size,
    net_overhead_us,
    priced,
)
from treeattn.sim.nccl.group_shape import GroupShape


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
    return priced("all_reduce", nbytes, "msccl_allpairs", p, latency, alg_bw)


def amd_costs(op: str, nbytes: int, s: GroupShape) -> list[CollectiveCost]:
    if op == "all_reduce":
        msccl = _rccl_msccl_allreduce(nbytes, s)
        if msccl is not None:
            return [msccl]
    algos = ["ring"] + (["tree"] if op == "all_reduce" else [])
    row = 0 if s.nnodes <= 2 else 1
    per_channel = s.intra_speed if s.nnodes <= 2 else s.inter_speed
    log2_size = min(max(log_size(nbytes), 0), 26)
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
                correction = T.RCCL_TREE_CORRECTION[proto][log2_size]
            elif s.nnodes > 1:
                correction = T.RCCL_RING_CORRECTION[proto][log2_size]
            alg_bw = bus * bus_to_alg(op, algo, s)
            cost = priced(op, nbytes, algo, p, latency, alg_bw)
            tuner = priced(op, nbytes, algo, p, latency, alg_bw * correction)
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
