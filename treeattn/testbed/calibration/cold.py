"""Calibrate what a host step costs right after the attention kernel: the profile's ``cold``.

Why: a decode step on a CPU streams the rank's whole KV shard through the core's caches,
so the host code that runs next (a merge, a mailbox send, a collective) finds none of its
code or data in L1/L2 and runs several times slower than the same step back to back, which
is how the other sections of a calibration time it. Measured on this project's 2-core box
after a 32 MiB shard: a merge of partials 94–117 µs against 10–12 µs warm; a 4-rank
all-to-all of partials 656 µs against 392 µs. A slow pass over memory does this, not time:
after a 2.4 ms busy loop that touches no memory the same ops cost 18 µs against 11 µs.
Priced warm, schedules that run host steps after the kernel were predicted too fast, the
collective-based ones at 4 ranks by 15–25% (``benchmarks/algorithms.py --quick``).

What is measured; a cold sample first runs the kernel over a probe shard of
:data:`PROBE_BYTES` in the run's head shape:

- ``merge_s``: the extra seconds of one merge of two packed partials (the executor's
  :func:`treeattn.kernels.merge_packed`): cold, then the same merge again warm; the median
  difference, max over ranks. Only as many ranks as cores take part, so that none times
  its core-mate's kernel.
- ``message_s``: the extra seconds of one small message from rank 0 to rank 1 through the
  executor's transport, from the later of the two ends entering to the receiver holding
  it, cold samples against warm ones (the same message sent just before). The others idle.
  The simulator charges half to the sender and half to the receiver, as it splits α.
- ``collectives_s``: per collective of one packed partial (``collective_bytes``) over all
  ``world`` ranks, every rank running the kernel first: the *whole* median seconds from the
  last member entering to the last leaving. Not an extra over the warm fit, because the
  warm samples start together (a barrier, then a release through the mailboxes) with every
  member awake, and a decode step's members
  arrive staggered, some asleep; the collective after the kernel is the one that matters.

The simulator charges these once per kind after an attention step that streams at least
``after_bytes`` (twice the L2, from sysfs): see :mod:`treeattn.testbed.host.cold`. Differences below
zero (noise) are stored as 0.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from treeattn.kernels import merge_packed, partial_attention
from treeattn.runtime.group import RankContext, wait_work
from treeattn.runtime.transport import collective_ops, transport_for
from treeattn.runtime.wire import AttnDims
from treeattn.testbed.transport.binding import group_cores

PROBE_BYTES = 32 << 20  # K+V read before a cold sample: 16x a 2 MiB L2, like a 16k shard
SAMPLES = 25  # per quantity and mode; each cold one costs a probe (a few ms)
COLD_OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")


def _probe(dims: AttnDims, device) -> tuple:
    """Query and a KV shard of about PROBE_BYTES in the run's shape and dtype."""
    per_token = 2 * dims.batch * dims.n_kv_heads * dims.head_dim * dims.kv_dtype.itemsize
    tokens = max(1, PROBE_BYTES // per_token)
    q = torch.randn(dims.batch, dims.n_heads, dims.head_dim, device=device)  # (B, Hq, D)
    kv = torch.randn(2, dims.batch, dims.n_kv_heads, tokens, dims.head_dim,
                     device=device).to(dims.kv_dtype)  # (2, B, Hkv, T, D)
    return q, kv


def _all_times(ctx: RankContext, *stamps: float) -> list[list[float]]:
    """Every rank's ``stamps`` (perf_counter, one clock on one host), in rank order."""
    mine = torch.tensor(stamps, dtype=torch.float64)
    everyone = [torch.zeros_like(mine) for _ in range(ctx.world)]
    dist.all_gather(everyone, mine)
    return [t.tolist() for t in everyone]


def busy_ranks(ctx: RankContext) -> int:
    """How many ranks run at once without sharing a core (all of them on a GPU)."""
    return min(ctx.world, group_cores()) if ctx.device.type == "cpu" else ctx.world


def _extra(cold: list[float], warm: list[float]) -> float:
    return max(0.0, statistics.median(cold) - statistics.median(warm))


def _merge_extra(ctx: RankContext, dims: AttnDims, q, kv) -> float:
    rows = dims.batch * dims.n_heads
    a = torch.randn(rows * (dims.head_dim + 1))  # packed (o, lse) partials
    b = torch.randn(rows * (dims.head_dim + 1))
    cold, warm = [], []
    # only as many ranks as cores: a rank sharing its core would time the other's kernel
    for _ in range(SAMPLES if ctx.rank < busy_ranks(ctx) else 0):
        partial_attention(q, kv[0], kv[1])
        t0 = time.perf_counter()
        merge_packed(a, b, rows)
        t1 = time.perf_counter()
        merge_packed(a, b, rows)
        warm.append(time.perf_counter() - t1)
        cold.append(t1 - t0)
    worst = torch.tensor([_extra(cold, warm) if cold else 0.0], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return float(worst.item())


def _message_once(ctx: RankContext, buf: torch.Tensor, tag: int) -> tuple[float, float]:
    """One message from rank 0 to rank 1 (the others idle); (entered, done) on each."""
    p2p, rank = transport_for(ctx), ctx.rank
    entered = time.perf_counter()
    if rank == 0:
        wait_work(p2p.isend(buf, 1, tag=tag), ctx, 1, "cold message")
    elif rank == 1:
        wait_work(p2p.irecv(buf, 0, tag=tag), ctx, 0, "cold message")
    return entered, time.perf_counter()


def _message_extra(ctx: RankContext, dims: AttnDims, q, kv) -> float:
    buf = torch.zeros(dims.batch * dims.n_heads * (dims.head_dim + 1))  # one packed partial
    samples: dict[str, list[float]] = {"cold": [], "warm": []}
    for i in range(2 * SAMPLES):
        mode = "cold" if i % 2 == 0 else "warm"
        if mode == "cold" and ctx.rank < 2:  # only the pair: the others would share its cores
            partial_attention(q, kv[0], kv[1])
        elif mode == "warm":
            _message_once(ctx, buf, tag=40)
        entered, done = _message_once(ctx, buf, tag=41)
        stamps = _all_times(ctx, entered, done)
        # from the later end entering to the receiver holding the message
        samples[mode].append(stamps[1][1] - max(stamps[0][0], stamps[1][0]))
    return _extra(samples["cold"], samples["warm"])


def collective_call(ctx: RankContext, op: str, nbytes: int):
    """A zero-argument closure running ``op`` on ``nbytes`` (whole buffer) on every rank,
    through the executor's path (:func:`~treeattn.runtime.transport.collective_ops`: mailboxes
    when the messages fit)."""
    p = ctx.world
    numel = max(p, -(-nbytes // 4) // p * p)  # a multiple of the world size, fp32
    full = torch.zeros(numel, device=ctx.device)
    part = torch.zeros(numel // p, device=ctx.device)
    pieces = [torch.zeros(numel // p, device=ctx.device) for _ in range(p)]
    ops = collective_ops(ctx, tuple(range(p)), None, transport_for(ctx).channel)
    calls = {
        "all_reduce": lambda: ops.all_reduce(full, "sum", op),
        "broadcast": lambda: ops.broadcast(full, 0, op),
        "all_gather": lambda: ops.all_gather(pieces, part, op),
        "reduce_scatter": lambda: ops.reduce_scatter(part, full, op),
        "all_to_all": lambda: ops.all_to_all(full.clone(), full, op),
    }
    return calls[op]


def _collectives_after_kernel(ctx: RankContext, nbytes: int, q, kv) -> dict[str, float]:
    """Median seconds of each of :data:`COLD_OPS` run right after every rank's kernel, from
    the last member entering to the last leaving: the whole price, not an extra (see the
    module doc). The ops take turns sample by sample, so a burst of another process's work
    lands on all of them a little rather than on one of them wholly (it moved one op's
    median by 10% between calibrations when each op took its samples in a row)."""
    calls = {op: collective_call(ctx, op, nbytes) for op in COLD_OPS}
    for call in calls.values():
        call()  # the buffers' first touch is not part of any step
    samples: dict[str, list[float]] = {op: [] for op in COLD_OPS}
    for _ in range(SAMPLES):
        for op, call in calls.items():
            partial_attention(q, kv[0], kv[1])
            entered = time.perf_counter()
            call()
            stamps = _all_times(ctx, entered, time.perf_counter())
            samples[op].append(max(s[1] for s in stamps) - max(s[0] for s in stamps))
    return {op: statistics.median(times) for op, times in samples.items()}


def l2_bytes(default: int = 2 << 20) -> int:
    """This CPU's per-core L2 size from sysfs (Linux), else ``default``."""
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    for index in sorted(base.glob("index*")):
        try:
            if (index / "level").read_text().strip() != "2":
                continue
            text = (index / "size").read_text().strip().upper()  # e.g. "2048K"
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20}.get(text[-1:], 1)
        digits = text.rstrip("KMB")
        if digits.isdigit() and int(digits) > 0:
            return int(digits) * scale
    return default


def measure_cold_steps(ctx: RankContext, dims: AttnDims) -> dict:
    """The profile's ``cold`` section (see the module docstring); every rank calls it."""
    q, kv = _probe(dims, ctx.device)
    partial_bytes = 4 * dims.batch * dims.n_heads * (dims.head_dim + 1)
    return {
        "probe_bytes": int(kv.numel() * kv.element_size()),
        # a kernel that reads twice the L2 leaves nothing of the host code in it
        "after_bytes": 2 * l2_bytes(),
        "samples": SAMPLES,
        "merge_s": _merge_extra(ctx, dims, q, kv),
        "message_s": _message_extra(ctx, dims, q, kv),
        "world": ctx.world,
        "collective_bytes": partial_bytes,
        "collectives_s": _collectives_after_kernel(ctx, partial_bytes, q, kv),
    }
