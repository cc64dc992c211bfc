"""Calibrate the local backend with microbenchmarks only, and write the profile (version 1).

Three measurements, run inside an existing process group (every rank calls
:func:`calibrate_in_group`; rank 0 returns the profile):

- **p2p**: ping-pong between ranks 0 and 1 over message sizes. The half round trip is fitted
  by least squares to ``t = α + n/β`` (weighted by ``1/t``, so small and large sizes count
  alike).
- **allreduce**: ``all_reduce`` of small and medium tensors on all ranks.
- **collectives**: every collective the schedules use (all-reduce, all-gather,
  reduce-scatter, all-to-all, broadcast) at a few sizes on all ranks, each fitted to
  ``t = α + n·s`` (``n`` in nccl-tests' convention, see :mod:`treeattn.sim.collectives`), so
  the simulator can price collective-based schedules on this machine at this world size.
- **exchange**: every rank sends to ``r+1`` and receives from ``r−1`` at once (the ring's
  pattern). Recorded for the simulator: on loopback, concurrent messages share the host's
  copy throughput, which ping-pong alone cannot show.
- **attention**: ``treeattn.kernels.partial_attention`` over local shards of several lengths,
  with ``min(world, cores)`` ranks running at once so the memory-bandwidth contention of
  concurrent ranks is captured. Oversubscription (more ranks than cores) is *not* folded in
  here: the profile records ``cores`` and the simulator shares the cores among the ranks.
  ``launch`` is the time of a tiny shard (16 tokens: the fixed per-call cost); the bandwidth
  is the median of ``bytes / (t − launch)`` over shards of 128 and 512 MiB (fp32, the
  default shape), the memory-bound regime of long-context decode. A straight-line fit over
  all sizes would let noise in the large times swing the intercept by milliseconds.

The profile::

    {"version": 1, "backend": "gloo", "world": N, "cores": C,
     "p2p": {"latency_s": α, "bandwidth_Bps": β, "sizes": [...], "times_s": [...]},
     "allreduce": {"latency_s": ..., "sizes": [...], "times_s": [...]},
     "collectives": {"world": N, "all_reduce": {"alpha_s": ..., "seconds_per_byte": ...,
                     "sizes": [...], "times_s": [...]}, "all_gather": {...}, ...},
     "exchange": {"latency_s": ..., "bandwidth_Bps": ..., "aggregate_Bps": ..., "ranks": N,
                  "sizes": [...], "times_s": [...]},
     "attention": {"bandwidth_Bps": ..., "launch_s": ..., "threads_per_rank": 1, ...},
     "machine": {...}}
"""

from __future__ import annotations

import json
import os
import platform
import socket
import statistics
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from treeattn import atomic
from treeattn.kernels import partial_attention
from treeattn.runtime.errors import RuntimeFailure
from treeattn.runtime.group import RankContext, barrier, wait_work
from treeattn.runtime.wire import AttnDims

PROFILE_VERSION = 1
P2P_SIZES = (4, 256, 4096, 65536, 1 << 20, 1 << 22, 1 << 24, 1 << 26)
ALLREDUCE_SIZES = (4, 256, 4096, 65536)
COLLECTIVE_SIZES = (256, 4096, 65536, 1 << 20)  # bytes, nccl-tests' size convention
EXCHANGE_SIZES = (4096, 1 << 20, 1 << 24, 1 << 26)
ATTENTION_TOKENS = (16, 16384, 65536)  # the first measures the fixed per-call cost
TARGET_S = 0.15  # time budget per measured point


def fit_latency_bandwidth(sizes: list[float], times: list[float]) -> tuple[float, float]:
    """Least-squares fit of ``t = a + n/b`` weighted by ``1/t``; returns ``(a, b)``.

    >>> a, b = fit_latency_bandwidth([0, 1e6, 2e6], [1e-5, 1e-5 + 1e-3, 1e-5 + 2e-3])
    >>> round(a, 9), round(b / 1e9, 3)
    (1e-05, 1.0)
    """
    scale_n = max(float(max(sizes)), 1.0)  # scale both axes: a well-conditioned system
    n = np.asarray(sizes, dtype=float) / scale_n
    t = np.asarray(times, dtype=float)
    scale_t = max(float(t.max()), 1e-12)
    t = t / scale_t
    w = 1.0 / np.maximum(t, 1e-12)
    design = np.stack([np.ones_like(n), n], axis=1) * w[:, None]
    (a, slope), *_ = np.linalg.lstsq(design, t * w, rcond=None)
    if slope <= 1e-9:  # (normalised units) flat or falling: no bandwidth to speak of
        raise RuntimeFailure("calibration: times do not grow with size; cannot fit a bandwidth")
    a = max(float(a), 0.0) * scale_t
    slope = float(slope) * scale_t / scale_n
    if slope <= 0:
        raise RuntimeFailure("calibration: times do not grow with size; cannot fit a bandwidth")
    return a, 1.0 / slope


def _reps(first_s: float, lo: int = 3, hi: int = 200) -> int:
    return int(min(hi, max(lo, TARGET_S / max(first_s, 1e-7))))


def _sync(ctx: RankContext) -> None:
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)


def _ping_pong_once(ctx: RankContext, buf: torch.Tensor, peer: int, first: bool) -> None:
    if first:
        wait_work(dist.isend(buf, peer, tag=1), ctx, peer, "ping")
        wait_work(dist.irecv(buf, peer, tag=2), ctx, peer, "pong")
    else:
        wait_work(dist.irecv(buf, peer, tag=1), ctx, peer, "ping")
        wait_work(dist.isend(buf, peer, tag=2), ctx, peer, "pong")
    _sync(ctx)


def measure_p2p(ctx: RankContext, sizes=P2P_SIZES) -> list[float]:
    """Half round-trip seconds per size, between ranks 0 and 1 (others wait)."""
    times = []
    for size in sizes:
        buf = torch.zeros(max(1, size // 4), device=ctx.device)
        median = 0.0
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
            median = statistics.median(samples)
        times.append(median)
        barrier(ctx)
    return times


def _broadcast_pair_int(ctx: RankContext, value: int) -> int:
    """Rank 0's value, sent to rank 1 (so both do the same number of repetitions)."""
    box = torch.tensor([value], dtype=torch.int64)
    if ctx.rank == 0:
        wait_work(dist.isend(box, 1, tag=3), ctx, 1, "repetition count")
    else:
        wait_work(dist.irecv(box, 0, tag=3), ctx, 0, "repetition count")
    return int(box.item())


def measure_exchange(ctx: RankContext, sizes=EXCHANGE_SIZES) -> list[float]:
    """Seconds for every rank at once to send ``n`` bytes to ``r+1`` and receive from ``r-1``.

    This is the ring's traffic pattern. On loopback every byte is copied by the host's CPUs,
    so concurrent messages share the host's copy throughput instead of each getting the
    ping-pong bandwidth; this measurement shows by how much.
    """
    times = []
    nxt, prv = (ctx.rank + 1) % ctx.world, (ctx.rank - 1) % ctx.world
    for size in sizes:
        out = torch.zeros(max(1, size // 4), device=ctx.device)
        inc = torch.empty_like(out)

        def exchange(out=out, inc=inc) -> None:
            works = dist.batch_isend_irecv(
                [dist.P2POp(dist.isend, out, nxt, tag=5), dist.P2POp(dist.irecv, inc, prv, tag=5)]
            )
            for work, peer in zip(works, (nxt, prv), strict=True):
                wait_work(work, ctx, peer, "exchange")

        times.append(_group_median(ctx, exchange, reps=6, warmup=2))
    return times


def measure_allreduce(ctx: RankContext, sizes=ALLREDUCE_SIZES) -> list[float]:
    """Median seconds of ``all_reduce`` per size, the max over ranks."""
    times = []
    for size in sizes:
        buf = torch.zeros(max(1, size // 4), device=ctx.device)

        def all_reduce(buf=buf) -> None:
            wait_work(dist.all_reduce(buf, async_op=True), ctx, None, "all_reduce")

        times.append(_group_median(ctx, all_reduce, reps=25, warmup=3))
    return times


def _collective_call(ctx: RankContext, op: str, nbytes: int):
    """A zero-argument closure running ``op`` on ``nbytes`` (whole buffer) on every rank."""
    p = ctx.world
    numel = max(p, -(-nbytes // 4) // p * p)  # a multiple of the world size, fp32
    full = torch.zeros(numel, device=ctx.device)
    part = torch.zeros(numel // p, device=ctx.device)
    pieces = [torch.zeros(numel // p, device=ctx.device) for _ in range(p)]
    calls = {
        "all_reduce": lambda: dist.all_reduce(full, async_op=True),
        "broadcast": lambda: dist.broadcast(full, src=0, async_op=True),
        "all_gather": lambda: dist.all_gather(pieces, part, async_op=True),
        "reduce_scatter": lambda: dist.reduce_scatter_tensor(part, full, async_op=True),
        "all_to_all": lambda: dist.all_to_all_single(full.clone(), full, async_op=True),
    }

    def run() -> None:
        wait_work(calls[op](), ctx, None, op)

    return run


def measure_collectives(ctx: RankContext, sizes=COLLECTIVE_SIZES) -> dict:
    """Median seconds of each collective per size (max over ranks), and its α + n·s fit."""
    out: dict = {"world": ctx.world}
    for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"):
        times = [_group_median(ctx, _collective_call(ctx, op, n), reps=15, warmup=3)
                 for n in sizes]
        try:
            alpha, per_byte = fit_latency_bandwidth(list(sizes), times)
            per_byte = 1.0 / per_byte
        except RuntimeFailure:  # flat over these sizes: all latency, no bandwidth term
            alpha, per_byte = min(times), 0.0
        out[op] = {"alpha_s": alpha, "seconds_per_byte": per_byte,
                   "sizes": list(sizes), "times_s": times}
    return out


def _group_median(ctx: RankContext, operation, reps: int, warmup: int) -> float:
    """Median seconds of ``operation()`` run by every rank at once (a barrier before each
    repetition, the first ``warmup`` discarded), the max of the medians over ranks."""
    samples = []
    for i in range(reps):
        barrier(ctx)
        t0 = time.perf_counter()
        operation()
        _sync(ctx)
        if i >= warmup:
            samples.append(time.perf_counter() - t0)
    worst = torch.tensor([statistics.median(samples)], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return float(worst.item())


def _time_attention(dims: AttnDims, tokens: int, device: torch.device) -> tuple[int, float]:
    b, hq, hkv, d = dims.batch, dims.n_heads, dims.n_kv_heads, dims.head_dim
    q = torch.randn(b, hq, d, device=device).to(dims.kv_dtype)  # (B, Hq, D)
    k = torch.randn(b, hkv, tokens, d, device=device).to(dims.kv_dtype)  # (B, Hkv, T, D)
    v = torch.randn_like(k)  # (B, Hkv, T, D)
    partial_attention(q, k, v)
    t0 = time.perf_counter()
    partial_attention(q, k, v)
    samples = []
    for _ in range(_reps(time.perf_counter() - t0, lo=3, hi=30)):
        t0 = time.perf_counter()
        partial_attention(q, k, v)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        samples.append(time.perf_counter() - t0)
    return 2 * k.numel() * k.element_size(), statistics.median(samples)


def measure_attention(ctx: RankContext, dims: AttnDims, tokens=ATTENTION_TOKENS) -> dict:
    """Attention time per shard length, with ``min(world, cores)`` ranks busy at once."""
    cores = os.cpu_count() or 1
    concurrent = min(ctx.world, cores) if ctx.device.type == "cpu" else ctx.world
    sizes, times = [], []
    for n in tokens:
        barrier(ctx)
        nbytes, t = (0, 0.0)
        if ctx.rank < concurrent:
            nbytes, t = _time_attention(dims, n, ctx.device)
        worst = torch.tensor([t], dtype=torch.float64)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        sizes.append(2 * dims.batch * dims.n_kv_heads * n * dims.head_dim * _bytes(dims))
        times.append(float(worst.item()))
    launch = times[0]
    rates = [n / (t - launch) for n, t in zip(sizes[1:], times[1:], strict=True) if t > launch]
    if not rates:
        raise RuntimeFailure("calibration: attention time does not grow with the shard size")
    bandwidth = statistics.median(rates)
    return {
        "bandwidth_Bps": bandwidth,
        "launch_s": launch,
        "threads_per_rank": torch.get_num_threads(),
        "concurrent_ranks": concurrent,
        "shape": [dims.batch, dims.n_heads, dims.n_kv_heads, dims.head_dim, str(dims.kv_dtype)],
        "sizes": sizes,
        "times_s": times,
    }


def _bytes(dims: AttnDims) -> int:
    return torch.empty(0, dtype=dims.kv_dtype).element_size()


def machine_info() -> dict:
    """Where the profile was measured: host, CPU, versions."""
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "host": socket.gethostname(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def calibrate_in_group(ctx: RankContext, dims: AttnDims) -> dict | None:
    """Run all microbenchmarks on every rank; rank 0 returns the profile, others None."""
    if ctx.world < 2:
        raise RuntimeFailure("calibration needs at least 2 ranks (ping-pong)")
    p2p_times = measure_p2p(ctx)
    ar_times = measure_allreduce(ctx)
    collectives = measure_collectives(ctx)
    ex_times = measure_exchange(ctx)
    attention = measure_attention(ctx, dims)
    if ctx.rank != 0:
        return None
    latency, bandwidth = fit_latency_bandwidth(list(P2P_SIZES), p2p_times)
    ex_latency, ex_bandwidth = fit_latency_bandwidth(list(EXCHANGE_SIZES), ex_times)
    return {
        "format": "treeattn.profile",
        "version": PROFILE_VERSION,
        "backend": ctx.backend,
        "world": ctx.world,
        "cores": os.cpu_count() or 1,
        "p2p": {
            "latency_s": latency,
            "bandwidth_Bps": bandwidth,
            "sizes": list(P2P_SIZES),
            "times_s": p2p_times,
        },
        "allreduce": {
            "latency_s": ar_times[0],
            "sizes": list(ALLREDUCE_SIZES),
            "times_s": ar_times,
        },
        "exchange": {
            "latency_s": ex_latency,
            "bandwidth_Bps": ex_bandwidth,  # per message, all ranks exchanging at once
            "aggregate_Bps": ex_bandwidth * ctx.world,
            "ranks": ctx.world,
            "sizes": list(EXCHANGE_SIZES),
            "times_s": ex_times,
        },
        "collectives": collectives,
        "attention": attention,
        "machine": machine_info(),
    }


def read_profile(path: str | os.PathLike) -> dict:
    """Load a profile (the one schema, read by :func:`treeattn.sim.devices.load_profile`);
    a one-line :class:`RuntimeFailure` if it is unreadable or not a profile."""
    from treeattn.sim import SimError
    from treeattn.sim.devices import load_profile

    try:
        return load_profile(path)
    except SimError as exc:
        raise RuntimeFailure(str(exc)) from exc


def write_profile(profile: dict, path: str | os.PathLike) -> None:
    """Write ``profile`` as JSON atomically (strict JSON: no NaN or Infinity)."""
    atomic.write_text(path, json.dumps(profile, indent=2, allow_nan=False) + "\n")
