"""``allreduce3`` on the backend's own ``all_reduce``: the paper's implementation.

The schedule library spells allreduce3's three all-reduces (max, then two sums) as explicit
sends and receives, so the simulator can cost them. This module runs the same computation
with three calls to ``torch.distributed.all_reduce`` instead, so the two can be measured side
by side. Its timeline has seven entries: ``attention``, ``init_max``, ``all_reduce:max``,
``rescale``, ``all_reduce:num``, ``all_reduce:den``, ``finalize`` (step names as in
:func:`treeattn.schedule.ir.step_name`). Bytes sent are counted as a ring all-reduce would
send them, ``2·(p−1)/p`` of each buffer (the backend does not report its own).
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

from treeattn.kernels import finalize_sums, partial_attention, rescale_to_max
from treeattn.runtime.group import RankContext, wait_work
from treeattn.runtime.run_state import RunStats, TensorMemory
from treeattn.runtime.wire import AttnDims


def _all_reduce(ctx: RankContext, t: torch.Tensor, op, stats: RunStats) -> torch.Tensor:
    out = t.clone()
    wait_work(dist.all_reduce(out, op=op, async_op=True), ctx, None, "all_reduce")
    p = ctx.world
    stats.bytes_sent += int(2 * (p - 1) / p * out.numel() * out.element_size())
    return out


def run_allreduce3_native(
    ctx: RankContext,
    q: torch.Tensor,
    kv: torch.Tensor,
    dims: AttnDims,
    scale: float | None = None,
    resident: list[torch.Tensor] | None = None,
) -> tuple[tuple[torch.Tensor, torch.Tensor], RunStats]:
    """Attention over this rank's ``kv`` (2, B, Hkv, T, D), merged with three all-reduces."""
    scale = scale if scale is not None else 1.0 / math.sqrt(dims.head_dim)
    stats, memory = RunStats(), TensorMemory(resident or [kv])
    t0 = time.perf_counter()
    live: list[torch.Tensor] = []

    def mark(name: str, start: float) -> None:
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)
        index = len(stats.timeline)
        stats.timeline.append((ctx.rank, index, name, start, time.perf_counter() - t0))
        memory.sample(live)

    start = time.perf_counter() - t0
    o, lse = partial_attention(q, kv[0], kv[1], scale=scale)  # (B, Hq, D), (B, Hq)
    live += [o, lse]
    mark("attention", start)
    start = time.perf_counter() - t0
    m = lse.clone()  # (B, Hq)
    mark("init_max", start)
    start = time.perf_counter() - t0
    m = _all_reduce(ctx, m, dist.ReduceOp.MAX, stats)
    mark("all_reduce:max", start)
    start = time.perf_counter() - t0
    num, den = rescale_to_max(o, lse, m)  # (B, Hq, D), (B, Hq)
    live += [den, num]
    mark("rescale", start)
    start = time.perf_counter() - t0
    num = _all_reduce(ctx, num, dist.ReduceOp.SUM, stats)
    mark("all_reduce:num", start)
    start = time.perf_counter() - t0
    den = _all_reduce(ctx, den, dist.ReduceOp.SUM, stats)
    mark("all_reduce:den", start)
    start = time.perf_counter() - t0
    o, lse = finalize_sums(num, den, m)
    mark("finalize", start)
    stats.peak_bytes = memory.peak
    if ctx.device.type == "cuda":
        stats.peak_bytes = int(torch.cuda.max_memory_allocated(ctx.device))
    return (o, lse), stats
