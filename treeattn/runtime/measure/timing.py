"""The timing harness: warm up, then time decode steps with every rank starting together,
and the robust statistics (median, p10, p90) every measurement is reported with.

Before each step all ranks start together (:func:`start_together`); each rank times its own
execution of the schedule. A step's time is the maximum over ranks (the step is done when the
last rank is done).

How many steps: at least ``steps`` (the floor), and more until ``min_time_s`` of timed steps
have passed (at most ``max_steps``): a 1 ms tree step gets hundreds of samples, a 1.5 s ring
step the floor. Rank 0's clock decides when to stop, so every rank runs the same count.

Interleaving (:func:`time_interleaved`): several schedules are timed round by round, one step
of each per round (A B C, B C A, ... : the order rotates so no schedule always runs first),
so a machine whose speed drifts during the run (other users on a shared host) slows every
schedule alike and their ratios stay stable.

Reported per schedule: median, p10 and p90 over the timed steps, bytes sent and peak memory
per rank, and the per-step timeline of the median step (rank, step index, step name, start,
end), which lines up with the simulator's timeline by (rank, step index).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from treeattn.runtime.collective_ops import CollectiveOps
from treeattn.runtime.group import RankContext, all_gather_objects, barrier, wait_work
from treeattn.runtime.run_state import RunStats
from treeattn.runtime.transport import collective_ops, transport_for

MAX_STEPS = 200
# per (channel, rank): the group's mailbox collectives and the float they all-reduce
_STARTS: dict[tuple[int, int], tuple[CollectiveOps, torch.Tensor]] = {}


def start_together(ctx: RankContext) -> None:
    """Release every rank for a timed sample at nearly the same instant (all ranks call it).

    gloo's barrier wakes each rank through a socket read. At 2 ranks on this project's 2-core
    box, 21 of 150 releases came more than 1 ms apart, and a 64k tree step timed after such
    a release counted the early rank's wait of up to 4 ms for the late one: a third of the
    steps ran 3–8 ms slow, and the median moved by whether more or fewer than half did.
    So after the barrier (which names a rank that does not arrive), a one-float all-reduce
    through the shared-memory mailboxes, whose waits spin and then sleep on a futex, releases
    them: 2 of 150 more than 1 ms apart. A group without mailboxes keeps the barrier alone.
    """
    barrier(ctx)
    channel = transport_for(ctx).channel
    if channel is None:
        return
    key = (id(channel), ctx.rank)
    if key not in _STARTS:
        _STARTS[key] = (collective_ops(ctx, tuple(range(ctx.world)), None, channel),
                        torch.zeros(1))
    ops, token = _STARTS[key]
    ops.all_reduce(token, "sum", "the start of a timed step")


def sample_stats(samples) -> tuple[float, float, float]:
    """``(median, p10, p90)`` of timing samples.

    >>> sample_stats([1.0, 2.0, 3.0, 4.0, 5.0])
    (3.0, 1.4, 4.6)
    """
    a = np.asarray(samples, dtype=float)
    return (float(np.median(a)), round(float(np.percentile(a, 10)), 12),
            round(float(np.percentile(a, 90)), 12))


def spread(stats: list[tuple[float, float, float]]) -> list[float]:
    """``[p10/median, p90/median]``, the median of each over ``(median, p10, p90)`` rows
    (``[1, 1]`` when there are none).

    >>> spread([(1.0, 0.9, 1.2), (2.0, 1.6, 2.2)])
    [0.85, 1.15]
    """
    rows = [(lo / med, hi / med) for med, lo, hi in stats if med > 0]
    if not rows:
        return [1.0, 1.0]
    return [round(float(statistics.median(r[0] for r in rows)), 6),
            round(float(statistics.median(r[1] for r in rows)), 6)]


def combine_rounds(rounds: list[list[tuple[float, float, float]]]):
    """Per size over time-separated bursts: the median of the medians (one burst hit by a
    load spike does not move it), and the band over all of them (min p10, max p90), so the
    spread also shows the drift during the calibration.

    >>> combine_rounds([[(1.0, 0.9, 1.1)], [(5.0, 4.0, 6.0)], [(1.2, 1.0, 1.3)]])
    [(1.2, 0.9, 6.0)]
    """
    return [(float(statistics.median(r[0] for r in per)), min(r[1] for r in per),
             max(r[2] for r in per)) for per in zip(*rounds, strict=True)]


@dataclass
class Measurement:
    """What the harness measured for one schedule (identical on every rank)."""

    step_s: list[float]  # per timed step, max over ranks
    median_s: float
    p90_s: float
    bytes_sent: list[int]  # per rank, one step
    peak_memory_bytes: list[int]  # per rank
    timeline: list[tuple[int, int, str, float, float]] = field(default_factory=list)
    p10_s: float = 0.0

    def to_dict(self) -> dict:
        return {
            "median_s": self.median_s,
            "p10_s": self.p10_s,
            "p90_s": self.p90_s,
            "step_s": self.step_s,
            "bytes_sent": self.bytes_sent,
            "peak_memory_bytes": self.peak_memory_bytes,
            "timeline": [list(entry) for entry in self.timeline],
        }


def _keep_going(ctx: RankContext, rounds: int, floor: int, elapsed: float, min_time_s: float,
                max_steps: int) -> bool:
    """Rank 0's decision, shared: another round while under the floor or the time budget."""
    more = rounds < floor or (elapsed < min_time_s and rounds < max(floor, max_steps))
    flag = torch.tensor([1 if more else 0], dtype=torch.int32)
    # with the group's timeout, so a lost or hung peer is named, as at every other wait
    wait_work(dist.broadcast(flag, src=0, async_op=True), ctx, None, "the step count")
    return bool(flag.item())


def time_interleaved(
    ctx: RankContext, steps: list[Callable[[], RunStats]], warmup: int = 2, floor: int = 10,
    min_time_s: float = 0.0, max_steps: int = MAX_STEPS,
) -> list[Measurement]:
    """Time several schedules round by round (A B, B A, ...); one Measurement each.

    ``min_time_s`` is per schedule: rounds continue until each has had that much timed.
    """
    n = len(steps)
    for _ in range(warmup):
        for step in steps:
            barrier(ctx)
            step()
    local: list[list[tuple[float, RunStats]]] = [[] for _ in steps]
    rounds, elapsed = 0, 0.0
    while _keep_going(ctx, rounds, max(1, floor), elapsed / n, min_time_s, max_steps):
        for k in range(n):
            i = (rounds + k) % n
            start_together(ctx)
            t0 = time.perf_counter()
            stats = steps[i]()
            took = time.perf_counter() - t0
            local[i].append((took, stats))
            elapsed += took
        rounds += 1
    return [_gather(ctx, samples) for samples in local]


def _gather(ctx: RankContext, local: list[tuple[float, RunStats]]) -> Measurement:
    mine = {
        "times": [t for t, _ in local],
        "bytes": local[-1][1].bytes_sent,
        "peak": max(s.peak_bytes for _, s in local),
        "timelines": [s.timeline for _, s in local],
    }
    everyone = all_gather_objects(ctx, mine)
    per_step = np.max(np.array([r["times"] for r in everyone]), axis=0)  # (steps,)
    median_index = int(np.argsort(per_step)[len(per_step) // 2])
    timeline = [entry for r in everyone for entry in r["timelines"][median_index]]
    median, p10, p90 = sample_stats(per_step)
    return Measurement(
        step_s=[float(t) for t in per_step],
        median_s=median,
        p90_s=p90,
        p10_s=p10,
        bytes_sent=[int(r["bytes"]) for r in everyone],
        peak_memory_bytes=[int(r["peak"]) for r in everyone],
        timeline=timeline,
    )
