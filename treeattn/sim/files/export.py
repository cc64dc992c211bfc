"""What leaves the tool in formats other tools read: traces, plan files, format tags.

* **Chrome/Perfetto traces** (:func:`trace_json`): every timeline, simulated or measured, is
  a list of ``(rank, step_index, step_name, start_s, end_s)``; each becomes one *process* of
  the trace (``predicted: helix @ 131072``, ``measured: helix @ 131072``) with one *thread*
  per rank, so a person opening the file in https://ui.perfetto.dev sees a prediction and
  its run side by side, step names matching, and where they part ways.
* **Plan files** (:func:`schedule_to_json`, :func:`schedule_from_json`): the schedule itself,
  step by step, so ``run --plan`` and ``generate --plan`` execute exactly what was planned.
* **Format tags** (:func:`tagged`): every JSON object the tool writes says what it is and
  which version of that format, as topology files already do.

Plain data: no simpy, no torch.

>>> from treeattn.schedule.ir import Compute, Schedule
>>> s = Schedule("x", [[Compute("attention", 8)], [Compute("attention", 8)]])
>>> schedule_from_json(schedule_to_json(s)).steps == s.steps
True
"""

from __future__ import annotations

import math

from treeattn.inputs import kind_of
from treeattn.schedule.ir import OUTPUT_LAYOUTS, Collective, Compute, Merge, Recv, Schedule, Send
from treeattn.schedule.payloads import (
    COLLECTIVE_OPS,
    COMPUTE_LABELS,
    MERGE_OPS,
    PARTIAL_DTYPES,
    PAYLOADS,
    SimError,
)

FORMAT_VERSION = 1
SCHEDULE_FORMAT = "treeattn.schedule"


def tagged(kind: str, body: dict | list) -> dict:
    """``{"format": "treeattn.KIND", "version": 1, ...}``; a list goes under ``rows``."""
    head = {"format": f"treeattn.{kind}", "version": FORMAT_VERSION}
    return {**head, **(body if isinstance(body, dict) else {"rows": body})}


def check_tag(data, kind: str, source: str) -> dict:
    """Return ``data`` if it is a ``treeattn.KIND`` object of a version we read."""
    if not isinstance(data, dict) or data.get("format") != f"treeattn.{kind}":
        raise SimError(f"{source} is not a treeattn {kind} file")
    if data.get("version") != FORMAT_VERSION:
        raise SimError(f"{source}: {kind} format version {data.get('version')!r}; this "
                       f"treeattn reads version {FORMAT_VERSION}")
    return data


# -- traces ------------------------------------------------------------------------------

def trace_json(timelines: list[tuple[str, list]]) -> dict:
    """A Chrome trace of ``(label, timeline)`` pairs: one process per label, a thread per rank.

    >>> t = trace_json([("predicted: tree", [(0, 0, "attention", 0.0, 1e-6)])])
    >>> t["traceEvents"][-1]["name"], t["traceEvents"][-1]["dur"]
    ('attention', 1.0)
    """
    events = []
    for pid, (label, timeline) in enumerate(timelines, 1):
        events.append({"ph": "M", "pid": pid, "name": "process_name", "args": {"name": label}})
        for rank in sorted({entry[0] for entry in timeline}):
            events.append({"ph": "M", "pid": pid, "tid": rank, "name": "thread_name",
                           "args": {"name": f"rank {rank}"}})
        for rank, index, name, start, end in timeline:
            if not (math.isfinite(start) and math.isfinite(end)):
                continue
            events.append({"ph": "X", "pid": pid, "tid": rank, "name": name,
                           "ts": start * 1e6, "dur": max(0.0, end - start) * 1e6,
                           "args": {"step": index}})
    return tagged("trace", {"displayTimeUnit": "ns", "traceEvents": events})


# -- plan files --------------------------------------------------------------------------

def _step_to_json(step) -> list:
    if isinstance(step, Compute):
        return ["compute", str(step.label), step.nbytes, step.flops]
    if isinstance(step, Send):
        return ["send", step.dst, step.nbytes, step.tag, str(step.payload),
                list(step.chunk) if step.chunk else None]
    if isinstance(step, Recv):
        return ["recv", step.src, step.nbytes, step.tag, str(step.payload),
                list(step.chunk) if step.chunk else None, step.reduce]
    if isinstance(step, Merge):
        return ["merge", step.nbytes, str(step.op), step.tag]
    if isinstance(step, Collective):
        return ["collective", str(step.op), list(step.group), step.nbytes, str(step.payload),
                step.tag, step.sharded, step.root]
    raise SimError(f"cannot export step {step!r}")


# Bounds on what a plan file may say; generated schedules stay far below every one.
MAX_WORLD = 1 << 17  # ranks (the largest topology is 65,536 GPUs)
MAX_NBYTES = 1 << 50  # bytes one step moves or touches (1 PiB)
MAX_TAG = 1 << 62
MAX_CHUNKS = 1 << 20
_ARITY = {"compute": 3, "send": 5, "recv": 6, "merge": 3, "collective": 7}


class _StepReader:
    """Strict reading of one step list: exact arity, integers that are integers (not
    ``true``, not ``"3"``), names from the IR's tables; errors name the step's field."""

    def __init__(self, source: str, world: int) -> None:
        self.source, self.world = source, world

    def fail(self, where: str, expected: str, value) -> None:
        raise SimError(f"{self.source}: malformed schedule: field {where}: expected "
                       f"{expected}, got {kind_of(value)}")

    def int(self, value, where: str, lo: int, hi: int) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            self.fail(where, f"an integer in [{lo}, {hi}]", value)
        return value

    def name(self, value, where: str, names) -> str:
        if not isinstance(value, str) or value not in names:
            self.fail(where, "one of " + ", ".join(map(str, names)), value)
        return value

    def flag(self, value, where: str) -> bool:
        if not isinstance(value, bool):
            self.fail(where, "true or false", value)
        return value

    def chunk(self, value, where: str) -> tuple[int, int] | None:
        if value is None:
            return None
        if not isinstance(value, list) or len(value) != 2:
            self.fail(where, "null or [index, count]", value)
        count = self.int(value[1], f"{where}[1]", 1, MAX_CHUNKS)
        return self.int(value[0], f"{where}[0]", 0, count - 1), count

    def rank(self, value, where: str) -> int:
        return self.int(value, where, 0, self.world - 1)

    def step(self, item, where: str):
        if not isinstance(item, list) or not item or not isinstance(item[0], str) \
                or item[0] not in _ARITY:
            self.fail(where, "a step list starting with one of " + ", ".join(_ARITY), item)
        kind, rest = item[0], item[1:]
        if len(rest) != _ARITY[kind]:
            self.fail(where, f"a {kind} step of {_ARITY[kind] + 1} items",
                      f"{len(item)} items")
        at = [f"{where}[{k}]" for k in range(1, len(item))]
        if kind == "compute":
            return Compute(self.name(rest[0], at[0], COMPUTE_LABELS),
                           self.int(rest[1], at[1], 0, MAX_NBYTES),
                           self.int(rest[2], at[2], 0, MAX_NBYTES * 1024))
        if kind in ("send", "recv"):
            step = (Send if kind == "send" else Recv)(
                self.rank(rest[0], at[0]), self.int(rest[1], at[1], 0, MAX_NBYTES),
                self.int(rest[2], at[2], 0, MAX_TAG), self.name(rest[3], at[3], PAYLOADS),
                self.chunk(rest[4], at[4]),
                *([self.flag(rest[5], at[5])] if kind == "recv" else []))
            return step
        if kind == "merge":
            tag = None if rest[2] is None else self.int(rest[2], at[2], 0, MAX_TAG)
            return Merge(self.int(rest[0], at[0], 0, MAX_NBYTES),
                         self.name(rest[1], at[1], MERGE_OPS), tag)
        op, group, nbytes, payload, tag, sharded, root = rest
        if not isinstance(group, list) or not 1 <= len(group) <= self.world:
            self.fail(at[1], f"a list of 1 to {self.world} ranks", group)
        members = tuple(self.rank(m, f"{at[1]}[{k}]") for k, m in enumerate(group))
        return Collective(self.name(op, at[0], COLLECTIVE_OPS), members,
                          self.int(nbytes, at[2], 0, MAX_NBYTES),
                          self.name(payload, at[3], PAYLOADS),
                          None if tag is None else self.int(tag, at[4], 0, MAX_TAG),
                          self.flag(sharded, at[5]),
                          None if root is None else self.rank(root, at[6]))


def schedule_to_json(schedule: Schedule) -> dict:
    """The schedule as a tagged JSON object (steps as short lists, one list per rank)."""
    return tagged("schedule", {
        "algorithm": schedule.algorithm, "world": schedule.world,
        "output_layout": schedule.output_layout,
        "partial_dtype": schedule.partial_dtype,
        "params": {k: v for k, v in schedule.params.items()
                   if isinstance(v, (int, float, str, bool, list, type(None)))},
        "steps": [[_step_to_json(s) for s in steps] for steps in schedule.steps],
    })


def schedule_from_json(data: dict, source: str = "plan") -> Schedule:
    """The schedule of a plan file, read strictly and validated (one-line :class:`SimError`
    naming the field otherwise): every field's type and range, then matching sends and
    receives, collective groups and their order, merges, and a symbolic run that refuses a
    schedule that would deadlock, naming the ranks and steps."""
    data = check_tag(data, "schedule", source)
    reader = _StepReader(source, 1)
    world = data.get("world")
    reader.int(world, "world", 1, MAX_WORLD)
    reader.world = world
    ranks = data.get("steps")
    if not isinstance(ranks, list) or len(ranks) != world:
        reader.fail("steps", f"a list of one step list per rank ({world})", ranks)
    steps = []
    for r, rank in enumerate(ranks):
        if not isinstance(rank, list):
            reader.fail(f"steps[{r}]", "a list of steps", rank)
        steps.append([reader.step(item, f"steps[{r}][{i}]") for i, item in enumerate(rank)])
    layout = data.get("output_layout", "replicated")
    reader.name(layout, "output_layout", OUTPUT_LAYOUTS)
    algorithm = data.get("algorithm")
    if not isinstance(algorithm, str) or not 0 < len(algorithm) <= 100:
        reader.fail("algorithm", "the algorithm's name", algorithm)
    params = data.get("params", {})
    if not isinstance(params, dict):
        reader.fail("params", "an object", params)
    partial_dtype = data.get("partial_dtype", "fp32")
    reader.name(partial_dtype, "partial_dtype", PARTIAL_DTYPES)
    schedule = Schedule(algorithm, steps, dict(params), layout, partial_dtype)
    try:
        return schedule.validate()
    except SimError as exc:
        raise type(exc)(f"{source}: {exc}") from None
