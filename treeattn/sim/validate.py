"""``validate(schedule)``: every send has one matching receive, and nothing can deadlock.

The deadlock check executes the schedule symbolically: sends never block, a receive
proceeds once the matching message was sent, and a rank stuck on a receive is woken when
that message is posted. Anything still waiting at the end names its rank and step.
"""

from __future__ import annotations

from collections import deque

from treeattn.sim.errors import ScheduleError
from treeattn.sim.schedule import (
    COMPUTE_LABELS,
    MERGE_OPS,
    PAYLOADS,
    Compute,
    Merge,
    Recv,
    Schedule,
    Send,
)


def _check_step(r: int, i: int, step, world: int) -> None:
    where = f"rank {r} step {i} ({type(step).__name__})"
    if isinstance(step, Compute):
        if step.label not in COMPUTE_LABELS:
            raise ScheduleError(f"{where}: unknown compute label {step.label!r}")
    elif isinstance(step, Send | Recv):
        peer = step.dst if isinstance(step, Send) else step.src
        if not 0 <= peer < world or peer == r:
            raise ScheduleError(f"{where}: peer {peer} is not another rank")
        if step.payload not in PAYLOADS:
            raise ScheduleError(f"{where}: unknown payload {step.payload!r}")
        if step.chunk is not None and not 0 <= step.chunk[0] < step.chunk[1]:
            raise ScheduleError(f"{where}: bad chunk {step.chunk}")
    elif isinstance(step, Merge):
        if step.op not in MERGE_OPS:
            raise ScheduleError(f"{where}: unknown merge op {step.op!r}")
    else:
        raise ScheduleError(f"{where}: not a schedule step")
    if getattr(step, "nbytes", 0) < 0:
        raise ScheduleError(f"{where}: negative nbytes")


def _match_messages(schedule: Schedule) -> None:
    sends: dict[tuple[int, int, int], tuple[int, Send]] = {}
    for r, steps in enumerate(schedule.steps):
        for i, s in enumerate(steps):
            _check_step(r, i, s, schedule.world)
            if isinstance(s, Send):
                key = (r, s.dst, s.tag)
                if key in sends:
                    raise ScheduleError(f"rank {r} step {i}: tag {s.tag} to {s.dst} reused")
                sends[key] = (i, s)
    for r, steps in enumerate(schedule.steps):
        for i, s in enumerate(steps):
            if not isinstance(s, Recv):
                continue
            found = sends.pop((s.src, r, s.tag), None)
            if found is None:
                raise ScheduleError(f"rank {r} step {i}: Recv from {s.src} tag {s.tag} has no Send")
            j, send = found
            if (send.nbytes, send.payload, send.chunk) != (s.nbytes, s.payload, s.chunk):
                raise ScheduleError(
                    f"rank {r} step {i}: Recv from {s.src} tag {s.tag} does not match "
                    f"rank {s.src} step {j} (size/payload/chunk)"
                )
    if sends:
        (src, dst, tag), (i, _) = next(iter(sends.items()))
        raise ScheduleError(f"rank {src} step {i}: Send to {dst} tag {tag} is never received")


def _check_merges(schedule: Schedule) -> None:
    for r, steps in enumerate(schedule.steps):
        pending: set[int] = set()
        block = False
        for i, s in enumerate(steps):
            if isinstance(s, Recv) and s.reduce:
                pending.add(s.tag)
            elif isinstance(s, Compute) and s.label == "attention_block":
                block = True
            elif isinstance(s, Merge):
                if s.tag is None and s.op == "partial" and not block:
                    raise ScheduleError(f"rank {r} step {i}: Merge with no block partial")
                if s.tag is not None and s.tag not in pending:
                    raise ScheduleError(f"rank {r} step {i}: Merge of tag {s.tag} not received")
                if s.op == "partial":  # a residue copy (tag None) leaves the block alone
                    block = block and s.tag is not None
                pending.discard(s.tag)
        if pending:
            raise ScheduleError(f"rank {r}: received tag(s) {sorted(pending)} never merged")


def _check_deadlock(schedule: Schedule) -> None:
    world = schedule.world
    pc = [0] * world
    posted: set[tuple[int, int, int]] = set()
    waiting: dict[tuple[int, int, int], int] = {}
    ready = deque(range(world))
    while ready:
        r = ready.popleft()
        steps = schedule.steps[r]
        while pc[r] < len(steps):
            s = steps[pc[r]]
            if isinstance(s, Send):
                key = (r, s.dst, s.tag)
                posted.add(key)
                if key in waiting:
                    ready.append(waiting.pop(key))
            elif isinstance(s, Recv) and (s.src, r, s.tag) not in posted:
                waiting[(s.src, r, s.tag)] = r
                break
            pc[r] += 1
    for r in range(world):
        if pc[r] < len(schedule.steps[r]):
            s = schedule.steps[r][pc[r]]
            raise ScheduleError(
                f"deadlock: rank {r} step {pc[r]} waits forever for a message from rank "
                f"{s.src} tag {s.tag}"
            )


def validate(schedule: Schedule) -> None:
    """Raise :class:`ScheduleError` naming the rank and step of the first problem found."""
    _match_messages(schedule)
    _check_merges(schedule)
    _check_deadlock(schedule)
