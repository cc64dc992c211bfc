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

>>> from treeattn.sim.schedule import Compute, Schedule
>>> s = Schedule("x", [[Compute("attention", 8)], [Compute("attention", 8)]])
>>> schedule_from_json(schedule_to_json(s)).steps == s.steps
True
"""

from __future__ import annotations

import math

from treeattn.sim.payloads import SimError
from treeattn.sim.schedule import OUTPUT_LAYOUTS, Collective, Compute, Merge, Recv, Schedule, Send

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


def _step_from_json(item):
    kind, *rest = item
    if kind == "compute":
        label, nbytes, flops = rest
        return Compute(label, int(nbytes), int(flops))
    if kind == "send":
        dst, nbytes, tag, payload, chunk = rest
        return Send(int(dst), int(nbytes), int(tag), payload, tuple(chunk) if chunk else None)
    if kind == "recv":
        src, nbytes, tag, payload, chunk, reduce = rest
        return Recv(int(src), int(nbytes), int(tag), payload, tuple(chunk) if chunk else None,
                    bool(reduce))
    if kind == "merge":
        nbytes, op, tag = rest
        return Merge(int(nbytes), op, None if tag is None else int(tag))
    if kind == "collective":
        op, group, nbytes, payload, tag, sharded, root = rest
        return Collective(op, tuple(int(m) for m in group), int(nbytes), payload,
                          None if tag is None else int(tag), bool(sharded),
                          None if root is None else int(root))
    raise ValueError(f"unknown step kind {kind!r}")


def schedule_to_json(schedule: Schedule) -> dict:
    """The schedule as a tagged JSON object (steps as short lists, one list per rank)."""
    return tagged("schedule", {
        "algorithm": schedule.algorithm, "world": schedule.world,
        "output_layout": schedule.output_layout,
        "params": {k: v for k, v in schedule.params.items()
                   if isinstance(v, (int, float, str, bool, list, type(None)))},
        "steps": [[_step_to_json(s) for s in steps] for steps in schedule.steps],
    })


def schedule_from_json(data: dict, source: str = "plan") -> Schedule:
    """The schedule of a plan file, validated (one-line :class:`SimError` otherwise)."""
    data = check_tag(data, "schedule", source)
    try:
        steps = [[_step_from_json(item) for item in rank] for rank in data["steps"]]
        layout = data.get("output_layout", "replicated")
        if layout not in OUTPUT_LAYOUTS or len(steps) != int(data["world"]):
            raise ValueError("world or layout does not match the steps")
        schedule = Schedule(str(data["algorithm"]), steps, dict(data.get("params", {})), layout)
    except (KeyError, TypeError, ValueError) as exc:
        raise SimError(f"{source}: malformed schedule ({exc})") from None
    return schedule.validate()
