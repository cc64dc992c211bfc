"""The timing harness: warm up, then time ``N`` decode steps with every rank starting together.

Before each step all ranks pass a barrier; each rank times its own execution of the schedule.
A step's time is the maximum over ranks (the step is done when the last rank is done). The
harness reports the median and p90 over the timed steps, bytes sent and peak memory per rank,
and the per-step timeline of the median step (rank, step index, step name, start, end), which
lines up with the simulator's timeline by (rank, step index).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from treeattn.runtime.executor import RunStats
from treeattn.runtime.group import RankContext, all_gather_objects, barrier


@dataclass
class Measurement:
    """What the harness measured for one schedule (identical on every rank)."""

    step_s: list[float]  # per timed step, max over ranks
    median_s: float
    p90_s: float
    bytes_sent: list[int]  # per rank, one step
    peak_memory_bytes: list[int]  # per rank
    timeline: list[tuple[int, int, str, float, float]] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "median_s": self.median_s,
            "p90_s": self.p90_s,
            "step_s": self.step_s,
            "bytes_sent": self.bytes_sent,
            "peak_memory_bytes": self.peak_memory_bytes,
            "timeline": [list(entry) for entry in self.timeline],
        }


def time_steps(
    ctx: RankContext, step: Callable[[], RunStats], warmup: int = 2, steps: int = 10
) -> Measurement:
    """Run ``step`` ``warmup`` times untimed, then ``steps`` times timed; every rank calls it."""
    for _ in range(warmup):
        barrier(ctx)
        step()
    local: list[tuple[float, RunStats]] = []
    for _ in range(max(1, steps)):
        barrier(ctx)
        t0 = time.perf_counter()
        stats = step()
        local.append((time.perf_counter() - t0, stats))
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
    return Measurement(
        step_s=[float(t) for t in per_step],
        median_s=float(np.median(per_step)),
        p90_s=float(np.percentile(per_step, 90)),
        bytes_sent=[int(r["bytes"]) for r in everyone],
        peak_memory_bytes=[int(r["peak"]) for r in everyone],
        timeline=timeline,
    )
