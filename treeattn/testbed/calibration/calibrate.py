"""Calibrate the local backend with microbenchmarks only, and write the profile (version 1).

The measurements, run inside an existing process group (every rank calls
:func:`calibrate_in_group`; rank 0 returns the profile):

- **p2p**: ping-pong between ranks 0 and 1 over message sizes: α is the median half round
  trip of the latency-bound sizes (up to 4 KiB), β the median of ``n / (t − α)`` over the
  largest sizes (:func:`latency_bandwidth`).
- **allreduce**: ``all_reduce`` of small and medium tensors on all ranks.
- **collectives**: every collective the schedules use (all-reduce, all-gather,
  reduce-scatter, all-to-all, broadcast) at a few sizes on all ranks, each fitted to
  ``t = α + n·s`` (``n`` in nccl-tests' convention, see :mod:`treeattn.sim.nccl.collectives`), so
  the simulator can price collective-based schedules on this machine at this world size.
  They run through the executor's path (:mod:`treeattn.testbed.transport.shm_collectives`): the
  mailboxes while each message fits one, the process group above.
- **exchange**: every rank sends to ``r+1`` and receives from ``r−1`` at once (the ring's
  pattern). Recorded for the simulator: on loopback, concurrent messages share the host's
  copy throughput, which ping-pong alone cannot show. Its sizes reach the largest message
  the run's schedules move (``max_bytes``, capped at :data:`EXCHANGE_CAP`; above the cap
  the profile says ``extrapolated_above_bytes``).

Why not one least-squares fit over all sizes: a ``1/t``-weighted fit over 4 KiB–64 MiB,
four samples a size, had its slope set by the noisy 16 and 64 MiB points and its intercept
by millisecond noise at 4 KiB on a loaded host; extrapolated 16x to a ring's 1 GiB block it
gave 0.95–1.8 GB/s where 1 GiB really moved at 0.75 GB/s, which made the same
``run --check`` predict 586 ms one time and 1265 ms the next.

Sampling: every point is timed a number of times set by a time budget (:data:`TARGET_S`)
with a floor (:data:`MIN_SAMPLES`); the median is the value. The exchange and attention,
which set the bandwidth-bound predictions, are measured in :data:`ROUNDS` bursts spread over
the calibration and combined by :func:`combine_rounds`, so one burst caught by another
user's load spike does not move them; and the p10/p90 of the samples
give each section a ``spread`` ``[p10/median, p90/median]`` (max over ranks) from which
``run --check`` derives the predicted band (:func:`treeattn.testbed.host.profiles.profile_bound`).
- **attention**: ``treeattn.kernels.partial_attention`` over local shards of several lengths,
  with ``min(world, cores)`` ranks running at once so the memory-bandwidth contention of
  concurrent ranks is captured. Oversubscription (more ranks than cores) is *not* folded in
  here: the profile records ``cores`` and the simulator shares the cores among the ranks.
  ``launch`` is the time of a tiny shard (16 tokens: the fixed per-call cost); the bandwidth
  is the median of ``bytes / (t − launch)`` over shards of 128 and 512 MiB (fp32, the
  default shape), the memory-bound regime of long-context decode. A straight-line fit over
  all sizes would let noise in the large times swing the intercept by milliseconds.
- **executor**: the schedule executor's own host cost per Send/Recv step beyond raw gloo
  (:func:`treeattn.testbed.calibration.overhead.measure_step_overhead`), which the simulator adds to
  both ends of every message.
- **cold** (CPU ranks): the extra cost of the first merge, message and collective right
  after the attention kernel has streamed a shard through the caches
  (:mod:`treeattn.testbed.calibration.cold`).

The profile::

    {"version": 1, "backend": "gloo", "world": N, "cores": C,
     "p2p": {"latency_s": α, "bandwidth_Bps": β, "sizes": [...], "times_s": [...]},
     "allreduce": {"latency_s": ..., "sizes": [...], "times_s": [...]},
     "collectives": {"world": N, "all_reduce": {"alpha_s": ..., "seconds_per_byte": ...,
                     "sizes": [...], "times_s": [...]}, "all_gather": {...}, ...},
     "exchange": {"latency_s": ..., "bandwidth_Bps": ..., "aggregate_Bps": ..., "ranks": N,
                  "sizes": [...], "times_s": [...]},
     "attention": {"bandwidth_Bps": ..., "launch_s": ..., "threads_per_rank": 1, ...},
     "executor": {"step_overhead_s": ..., "ratio_executor_raw": ...},
     "cold": {"probe_bytes": ..., "merge_s": ..., "message_s": ..., "collectives_s": {...}},
     "machine": {...}}
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from treeattn.kernels import partial_attention
from treeattn.runtime.errors import RuntimeFailure
from treeattn.runtime.group import RankContext, barrier, wait_work
from treeattn.runtime.measure.fitting import (  # noqa: F401  (fit_latency_bandwidth: re-export)
    fit_latency_bandwidth,
    latency_bandwidth,
    message_section,
)
from treeattn.runtime.measure.profile_io import (  # noqa: F401  (re-exported)
    PROFILE_VERSION,
    machine_info,
    read_profile,
    write_profile,
)
from treeattn.runtime.measure.timing import combine_rounds, sample_stats, spread, start_together
from treeattn.runtime.transport import transport_for
from treeattn.runtime.wire import AttnDims
from treeattn.testbed.calibration.cold import busy_ranks, collective_call, measure_cold_steps
from treeattn.testbed.calibration.overhead import measure_step_overhead
from treeattn.testbed.transport.binding import group_cores, is_pinned

P2P_SIZES = (4, 256, 4096, 65536, 1 << 20, 1 << 22, 1 << 24, 1 << 26)
EXCHANGE_CAP = 1 << 30  # largest exchange calibrated: 2 such buffers per rank
MIN_SAMPLES = 5  # floor on timed samples per point, however long one takes
# The exchange's largest sizes set a ring's prediction, and one 1 GiB sample takes ~1 s, so
# the floor alone decides how many there are: 2 per round (6 in all) left the bandwidth ±10%
# from one calibration to the next (benchmarks/results/repeatability.md); 4 per round (12).
EXCHANGE_FLOOR_PER_ROUND = 4
ROUNDS = 3  # exchange and attention: bursts spread over the calibration, pooled
ALLREDUCE_SIZES = (4, 256, 4096, 65536)
COLLECTIVE_SIZES = (256, 4096, 65536, 1 << 20)  # bytes, nccl-tests' size convention
EXCHANGE_SIZES = (4096, 1 << 20, 1 << 24, 1 << 26)
ATTENTION_TOKENS = (16, 16384, 65536)  # the first measures the fixed per-call cost
TARGET_S = 0.2  # time budget per measured point (the floor may exceed it)
EXCHANGE_TAG = 5


def exchange_sizes(max_bytes: int | None) -> tuple[int, ...]:
    """The exchange sizes: the base ones, then ×4 steps up to ``max_bytes`` (capped).

    >>> exchange_sizes(None)[-1] == 1 << 26, exchange_sizes(1 << 30)[-2:]
    (True, (268435456, 1073741824))
    """
    sizes = list(EXCHANGE_SIZES)
    target = min(int(max_bytes or 0), EXCHANGE_CAP)
    while sizes[-1] * 4 < target:
        sizes.append(sizes[-1] * 4)
    if target > sizes[-1]:
        sizes.append(target)
    return tuple(sizes)


def _reps(first_s: float, lo: int = MIN_SAMPLES, hi: int = 40) -> int:
    return int(min(hi, max(lo, TARGET_S / max(first_s, 1e-7))))


def _sync(ctx: RankContext) -> None:
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)


def _ping_pong_once(ctx: RankContext, buf: torch.Tensor, peer: int, first: bool) -> None:
    p2p = transport_for(ctx)  # the executor's path for a message of this size
    if first:
        wait_work(p2p.isend(buf, peer, tag=1), ctx, peer, "ping")
        wait_work(p2p.irecv(buf, peer, tag=2), ctx, peer, "pong")
    else:
        wait_work(p2p.irecv(buf, peer, tag=1), ctx, peer, "ping")
        wait_work(p2p.isend(buf, peer, tag=2), ctx, peer, "pong")
    _sync(ctx)


def measure_p2p(ctx: RankContext, sizes=P2P_SIZES) -> list[tuple[float, float, float]]:
    """Half round-trip ``(median, p10, p90)`` seconds per size, ranks 0 and 1 (others wait)."""
    out = []
    for size in sizes:
        buf = torch.full((max(1, size // 4),), 0.5, device=ctx.device)  # pages touched
        stats = (0.0, 0.0, 0.0)
        if ctx.rank in (0, 1):
            peer, first = 1 - ctx.rank, ctx.rank == 0
            for _ in range(2):
                _ping_pong_once(ctx, buf, peer, first)
            t0 = time.perf_counter()
            _ping_pong_once(ctx, buf, peer, first)
            reps = _broadcast_pair_int(ctx, _reps(time.perf_counter() - t0))
            samples = []
            for _ in range(reps):
                t0 = time.perf_counter()
                _ping_pong_once(ctx, buf, peer, first)
                samples.append((time.perf_counter() - t0) / 2)
            stats = sample_stats(samples)
        out.append(stats)
        barrier(ctx)
    return out


def _broadcast_pair_int(ctx: RankContext, value: int) -> int:
    """Rank 0's value, sent to rank 1 (so both do the same number of repetitions)."""
    box = torch.tensor([value], dtype=torch.int64)
    if ctx.rank == 0:
        wait_work(dist.isend(box, 1, tag=3), ctx, 1, "repetition count")
    else:
        wait_work(dist.irecv(box, 0, tag=3), ctx, 0, "repetition count")
    return int(box.item())


def measure_exchange(ctx: RankContext, sizes=EXCHANGE_SIZES,
                     floor: int = MIN_SAMPLES) -> list[tuple[float, float, float]]:
    """``(median, p10, p90)`` seconds for every rank at once to send ``n`` bytes to ``r+1``
    and receive from ``r-1``.

    This is the ring's traffic pattern. On loopback every byte is copied by the host's CPUs,
    so concurrent messages share the host's copy throughput instead of each getting the
    ping-pong bandwidth; this measurement shows by how much. Buffers are filled first, so no
    first-touch page fault lands in a timed sample.

    The receive is posted before the send, as the executor posts its receives ahead of its
    sends. The order matters on gloo: at 2 ranks on this project's 2-core box, send-first
    moved 1 GiB in either ~515 or ~790 ms, switching from sample to sample (and 64 MiB in
    32–55 ms), while receive-first took 505–535 ms (and 32–43 ms) in the same processes;
    the ring's own transfers ran at the receive-first speed, so the send-first median priced
    them 17–28% slow or right depending on which mode a calibration happened to catch.
    """
    out = []
    p2p = transport_for(ctx)
    for size in sizes:
        send = torch.full((max(1, size // 4),), 0.5, device=ctx.device)
        inc = torch.full_like(send, 0.5)
        out.append(_group_stats(ctx, lambda send=send, inc=inc: exchange_once(ctx, p2p, send, inc),
                                warmup=1, floor=floor))
        del send, inc
    return out


def exchange_once(ctx: RankContext, p2p, send: torch.Tensor, inc: torch.Tensor) -> None:
    """One exchange: receive ``inc`` from ``r−1`` and send ``send`` to ``r+1``, the receive
    posted first (see :func:`measure_exchange`), then wait for both."""
    nxt, prv = (ctx.rank + 1) % ctx.world, (ctx.rank - 1) % ctx.world
    works = [p2p.irecv(inc, prv, tag=EXCHANGE_TAG), p2p.isend(send, nxt, tag=EXCHANGE_TAG)]
    for work, peer in zip(works, (prv, nxt), strict=True):
        wait_work(work, ctx, peer, "exchange")


def measure_allreduce(ctx: RankContext, sizes=ALLREDUCE_SIZES) -> list[float]:
    """Median seconds of ``all_reduce`` per size, the max over ranks."""
    times = []
    for size in sizes:
        buf = torch.zeros(max(1, size // 4), device=ctx.device)

        def all_reduce(buf=buf) -> None:
            wait_work(dist.all_reduce(buf, async_op=True), ctx, None, "all_reduce")

        times.append(_group_stats(ctx, all_reduce, warmup=3)[0])
    return times


def measure_collectives(ctx: RankContext, sizes=COLLECTIVE_SIZES) -> dict:
    """Median seconds of each collective per size (max over ranks), its α + n·s fit and the
    spread of its samples."""
    out: dict = {"world": ctx.world}
    for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"):
        stats = [_group_stats(ctx, collective_call(ctx, op, n), warmup=3) for n in sizes]
        times = [s[0] for s in stats]
        try:
            alpha, per_byte = fit_latency_bandwidth(list(sizes), times)
            per_byte = 1.0 / per_byte
        except RuntimeFailure:  # flat over these sizes: all latency, no bandwidth term
            alpha, per_byte = min(times), 0.0
        out[op] = {"alpha_s": alpha, "seconds_per_byte": per_byte,
                   "sizes": list(sizes), "times_s": times, "spread": spread(stats)}
    return out


def _group_stats(ctx: RankContext, operation, warmup: int,
                 floor: int = MIN_SAMPLES) -> tuple[float, float, float]:
    """``(median, p10, p90)`` seconds of ``operation()`` run by every rank at once (started
    together before each repetition, :func:`start_together`; ``warmup`` untimed first), each
    the max over ranks.

    The repetition count is time-based (:func:`_reps` of the slowest rank's first timed
    run, so every rank agrees on it), never under ``floor``.
    """
    for _ in range(warmup):
        barrier(ctx)
        operation()
    start_together(ctx)
    t0 = time.perf_counter()
    operation()
    _sync(ctx)
    first = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(first, op=dist.ReduceOp.MAX)
    samples = [float(first.item())]
    for _ in range(_reps(samples[0], lo=floor) - 1):
        start_together(ctx)
        t0 = time.perf_counter()
        operation()
        _sync(ctx)
        samples.append(time.perf_counter() - t0)
    worst = torch.tensor(sample_stats(samples), dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return tuple(float(v) for v in worst.tolist())


def _time_attention(dims: AttnDims, tokens: int, device: torch.device, floor: int):
    b, hq, hkv, d = dims.batch, dims.n_heads, dims.n_kv_heads, dims.head_dim
    q = torch.randn(b, hq, d, device=device).to(dims.kv_dtype)  # (B, Hq, D)
    # Filled, not random: the speed does not depend on the values, and randn of hundreds of
    # MiB would cost seconds; not zeros, whose untouched pages would all map one zero page.
    k = torch.full((b, hkv, tokens, d), 0.5, device=device, dtype=dims.kv_dtype)
    v = torch.full_like(k, 0.25)  # (B, Hkv, T, D)
    partial_attention(q, k, v)
    t0 = time.perf_counter()
    partial_attention(q, k, v)
    samples = []
    for _ in range(_reps(time.perf_counter() - t0, lo=floor, hi=30)):
        t0 = time.perf_counter()
        partial_attention(q, k, v)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        samples.append(time.perf_counter() - t0)
    return sample_stats(samples)


def attention_stats(ctx: RankContext, dims: AttnDims, tokens=ATTENTION_TOKENS,
                    floor: int = MIN_SAMPLES) -> list[tuple[float, float, float]]:
    """Attention ``(median, p10, p90)`` per shard length (max over ranks), with
    ``min(world, cores)`` ranks busy at once."""
    concurrent = busy_ranks(ctx)
    stats = []
    for n in tokens:
        barrier(ctx)
        mine = (0.0, 0.0, 0.0)
        if ctx.rank < concurrent:
            mine = _time_attention(dims, n, ctx.device, floor)
        worst = torch.tensor(mine, dtype=torch.float64)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        stats.append(tuple(float(v) for v in worst.tolist()))
    return stats


def attention_section(ctx: RankContext, dims: AttnDims, stats, tokens=ATTENTION_TOKENS) -> dict:
    """The profile's attention section from :func:`attention_stats` (or combined rounds)."""
    sizes = [2 * dims.batch * dims.n_kv_heads * n * dims.head_dim * _bytes(dims) for n in tokens]
    times = [s[0] for s in stats]
    launch = times[0]
    rates = [n / (t - launch) for n, t in zip(sizes[1:], times[1:], strict=True) if t > launch]
    if not rates:
        raise RuntimeFailure("calibration: attention time does not grow with the shard size")
    return {
        "bandwidth_Bps": statistics.median(rates),
        "launch_s": launch,
        "threads_per_rank": torch.get_num_threads(),
        "concurrent_ranks": busy_ranks(ctx),
        "shape": [dims.batch, dims.n_heads, dims.n_kv_heads, dims.head_dim, str(dims.kv_dtype)],
        "sizes": sizes,
        "times_s": times,
        "spread": spread(stats[1:]),
    }


def _bytes(dims: AttnDims) -> int:
    return torch.empty(0, dtype=dims.kv_dtype).element_size()


def calibrate_in_group(ctx: RankContext, dims: AttnDims,
                       max_bytes: int | None = None) -> dict | None:
    """Run all microbenchmarks on every rank; rank 0 returns the profile, others None.

    ``max_bytes``: the largest message the run's schedules move; the exchange is calibrated
    up to it (capped at :data:`EXCHANGE_CAP`), so a ring's KV blocks are priced from
    measurements of their own size, not from a fit extrapolated from 64 MiB.
    """
    if ctx.world < 2:
        raise RuntimeFailure("calibration needs at least 2 ranks (ping-pong)")
    transport = transport_for(ctx)  # collective on first use, so every rank makes it here
    ex_sizes = exchange_sizes(max_bytes)
    p2p_stats = measure_p2p(ctx)
    ar_times = measure_allreduce(ctx)
    collectives = measure_collectives(ctx)
    cold = measure_cold_steps(ctx, dims) if ctx.device.type == "cpu" else None
    ex_rounds, att_rounds = [], []
    for _ in range(ROUNDS):  # interleaved bursts: a load spike hits one, not all
        ex_rounds.append(measure_exchange(ctx, ex_sizes, floor=EXCHANGE_FLOOR_PER_ROUND))
        att_rounds.append(attention_stats(ctx, dims, floor=-(-MIN_SAMPLES // ROUNDS)))
    ex_stats = combine_rounds(ex_rounds)
    attention = attention_section(ctx, dims, combine_rounds(att_rounds))
    # the executor's own cost beyond raw gloo; its raw side is CPU tensors, so CPU ranks only
    executor = measure_step_overhead(ctx) if ctx.device.type == "cpu" else None
    if ctx.rank != 0:
        return None
    exchange = message_section(list(ex_sizes), ex_stats)
    exchange.update(aggregate_Bps=exchange["bandwidth_Bps"] * ctx.world, ranks=ctx.world)
    if max_bytes and max_bytes > ex_sizes[-1]:
        exchange["extrapolated_above_bytes"] = ex_sizes[-1]
    return {
        "format": "treeattn.profile",
        "version": PROFILE_VERSION,
        "backend": ctx.backend,
        "transport": transport.kind,  # "shm+gloo": small messages through shared memory
        "world": ctx.world,
        "cores": group_cores(),
        "pinned": is_pinned(),  # each rank bound to its core(s) by the launcher
        "p2p": message_section(list(P2P_SIZES), p2p_stats),
        "allreduce": {
            "latency_s": ar_times[0],
            "sizes": list(ALLREDUCE_SIZES),
            "times_s": ar_times,
        },
        "exchange": exchange,  # bandwidth per message, all ranks exchanging at once
        "collectives": collectives,
        "attention": attention,
        **({"executor": executor} if executor else {}),
        **({"cold": cold} if cold else {}),
        "machine": machine_info(),
    }
