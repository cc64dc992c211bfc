"""How big a cluster the planner takes on: refused up front past a bound, a note before a
long one, so that no accepted size runs for minutes without a word.

The planner builds and prices candidate schedules whose steps grow with the GPUs (a binomial
tree: an attention and about ``2·log2(p)`` messages per rank), and simulates the best. Its
time grows about linearly in the GPUs: measured here (``treeattn predict --topology
dgx-h100:nodes=N --model llama-3.1-8b --seq-len 1M``, the 2-core CPU host) 14 s at 4,096
GPUs and 54 s at 16,384, about :data:`SECONDS_PER_GPU` each. So past :data:`NOTE_GPUS` a
note states that estimate before the work starts, and past :data:`MAX_PLAN_GPUS` the request
is refused with its size and the estimate, before any work: plan a slice of the cluster
(fewer nodes) instead.
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Iterator

from treeattn.schedule.payloads import SimError
from treeattn.topo.fabric import build_limits

NOTE_GPUS = 2048
MAX_PLAN_GPUS = 16384
SECONDS_PER_GPU = 3.5e-3  # measured, see the module docstring; a faster host takes less


def simulated_steps(gpus: int) -> int:
    """Steps of one binomial tree's schedule on ``gpus`` ranks: the estimate quoted.

    >>> simulated_steps(8)
    64
    """
    return gpus * (2 * max(1, math.ceil(math.log2(max(2, gpus)))) + 2)


def check_planning_size(gpus: int, what: str) -> str | None:
    """Refuse (SimError) a cluster past :data:`MAX_PLAN_GPUS`; return a note past
    :data:`NOTE_GPUS`, else None."""
    steps = simulated_steps(gpus)
    if gpus > MAX_PLAN_GPUS:
        raise SimError(f"{what}: {gpus:,} GPUs, expected at most {MAX_PLAN_GPUS:,} for the "
                       f"planner (one tree's schedule alone is about {steps:,} simulated "
                       "steps, and planning prices dozens); plan fewer nodes")
    if gpus > NOTE_GPUS:
        return (f"note: planning {gpus:,} GPUs (about {steps:,} simulated steps per "
                f"schedule); this takes about {gpus * SECONDS_PER_GPU:.0f} s on one core")
    return None


@contextlib.contextmanager
def planning_limits() -> Iterator[None]:
    """Build topologies for the planner: past :data:`MAX_PLAN_GPUS` refused before they are
    built (a 65,536-GPU cluster takes about half a minute to build), a note on stderr before
    a long build."""
    with build_limits(MAX_PLAN_GPUS, "the planner",
                      note=lambda line: print(line, file=sys.stderr, flush=True)):
        yield
