"""What one simulated run returns (:class:`SimResult`), and the walk back along its critical
path that splits the makespan into compute, software overhead and time on the wire."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from treeattn.schedule.ir import Collective, Compute, Merge, Recv, Send


@dataclass
class SimResult:
    """The prediction for one schedule.

    ``timeline`` holds ``(rank, step_index, step_name, start_s, end_s)``; ``bytes_per_link``
    maps a directed edge ``(u, v)`` to the bytes that crossed it; ``bytes_per_rank`` is what
    each rank sent; ``comm_bytes`` their sum (each message counted once, not per hop).
    ``critical_path`` splits the makespan into ``compute_s`` (Compute and Merge steps,
    waiting for a shared core included), ``overhead_s``
    (software send/recv overhead) and ``wire_s`` (in flight, contention and an attention's
    wait for its rank's message copies included).
    ``method`` is ``"simulated"`` or ``"closed_form"`` (see :mod:`treeattn.sim.closed_form`).
    """

    algorithm: str
    params: dict
    makespan_s: float
    comm_bytes: int
    bytes_per_rank: list[int]
    memory: list[int] | Callable[[], list[int]] = field(default_factory=list, repr=False)
    steps_timeline: list | Callable[[], list] = field(default_factory=list, repr=False)
    bytes_per_link: dict[tuple[str, str], int] = field(default_factory=dict, repr=False)
    critical_path: dict = field(default_factory=dict)
    method: str = "simulated"

    @property
    def peak_memory_bytes(self) -> list[int]:
        """Peak bytes per rank (computed on first use; see :func:`peak_memory`)."""
        if callable(self.memory):
            self.memory = self.memory()
        return self.memory

    @property
    def timeline(self) -> list[tuple[int, int, str, float, float]]:
        """``(rank, step_index, step_name, start_s, end_s)`` for every step (built lazily)."""
        if callable(self.steps_timeline):
            self.steps_timeline = self.steps_timeline()
        return self.steps_timeline

    @property
    def latency_s(self) -> float:
        return self.makespan_s

    def summary(self) -> dict:
        return {
            "algorithm": self.algorithm, "latency_s": self.makespan_s,
            "comm_bytes": self.comm_bytes, "peak_memory_bytes": max(self.peak_memory_bytes),
            "method": self.method, "critical_path": self.critical_path,
        }


def critical_path(steps, start, end, cause, copy_wait=None) -> dict:
    """Walk back from the last step to finish, following what each step waited for.

    ``start[r][i]``/``end[r][i]`` are step times; ``cause[r][i]`` is, for a Recv that waited
    on its message, ``(src_rank, src_step, inject_time, arrival_time)``, else ``None``;
    ``copy_wait[r][i]``, how long a Compute waited for its rank's message copies (wire time).
    """
    r = max(range(len(end)), key=lambda x: end[x][-1] if end[x] else 0.0)
    i = len(steps[r]) - 1
    out = {"compute_s": 0.0, "overhead_s": 0.0, "wire_s": 0.0, "steps": 0}
    while i >= 0:
        step = steps[r][i]
        out["steps"] += 1
        if isinstance(step, Compute | Merge):
            waited = copy_wait[r][i] if copy_wait is not None else 0.0
            out["compute_s"] += end[r][i] - start[r][i] - waited
            out["wire_s"] += waited
        elif isinstance(step, Send):
            out["overhead_s"] += end[r][i] - start[r][i]
        elif isinstance(step, Collective):
            found = cause[r][i]
            out["wire_s"] += end[r][i] - (found[2] if found else start[r][i])
            if found is not None:  # a later member held everyone up: follow it
                r, i = found[0], found[1] - 1
                continue
        elif isinstance(step, Recv) and cause[r][i] is not None:
            src, j, inject, arrival = cause[r][i]
            out["overhead_s"] += end[r][i] - arrival
            out["wire_s"] += arrival - inject
            r, i = src, j
            continue
        else:
            out["overhead_s"] += end[r][i] - start[r][i]
        i -= 1
    return out
