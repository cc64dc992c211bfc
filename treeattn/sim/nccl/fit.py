"""Calibrate the collective cost model from a user's own nccl-tests output.

``treeattn calibrate --nccl-tests all_reduce_perf.txt ... --topology SPEC`` reads the tables
(:mod:`treeattn.sim.nccl.nccltests`) and produces a :class:`CollectiveCalibration`:

* **a fit of the model.** Four multipliers on the sourced constants of
  :mod:`treeattn.sim.nccl.collectives`: latency inside a node (base and per-hop), network hop
  latency, bandwidth inside a node, network bandwidth. They minimise the mean squared log
  error over every measured row, by coordinate search on a log grid (the model is a minimum
  over algorithms, so it is not smooth enough for gradients). The residual of every row is
  recorded, so a user sees how well the model explains their machine.
* **the measured tables themselves.** For an op and group size that were measured, a
  prediction interpolates the table (log-log, between neighbouring sizes): the measurement
  is better than any model there, and this is what makes ``treeattn comm`` reproduce the
  input. Outside the measured sizes, or for other ops and group sizes, the fitted model
  answers.

Calibration is a separate, explicit step: nothing in the sourced model is ever fitted to the
published points the fidelity report scores it against.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from treeattn.schedule.payloads import SimError
from treeattn.sim.nccl.collectives import GroupShape, collective_cost
from treeattn.sim.nccl.nccltests import NcclTestsTable

SCALE_NAMES = ("lat", "net_lat", "bw", "net_bw")
_GRID = [2.0 ** (k / 4) for k in range(-12, 13)]  # 1/8 .. 8 in quarter-octave steps


@dataclass
class CollectiveCalibration:
    """Fitted multipliers, the measured tables, and the fit's residuals."""

    world: int
    scales: dict[str, float]
    tables: dict[str, tuple[tuple[int, ...], tuple[float, ...]]]
    residuals: list[dict] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)

    def shape(self, shape: GroupShape) -> GroupShape:
        """``shape`` with the fitted multipliers applied."""
        return shape.scaled(**self.scales)

    def time_s(self, op: str, nbytes: int, shape: GroupShape) -> float:
        """Seconds for ``op`` on ``nbytes``: the measured table where it covers the size and
        group, else the fitted model."""
        table = self.tables.get(op)
        if table is not None and shape.nranks == self.world:
            sizes, times = table
            if sizes[0] <= nbytes <= sizes[-1]:
                return _interpolate(sizes, times, nbytes)
        return collective_cost(op, nbytes, self.shape(shape)).time_s

    def to_json(self) -> dict:
        return {"world": self.world, "scales": self.scales,
                "tables": {op: {"sizes": list(s), "times_s": list(t)}
                           for op, (s, t) in self.tables.items()},
                "residuals": self.residuals, "sources": self.sources}

    @classmethod
    def from_json(cls, data: dict) -> CollectiveCalibration:
        try:
            scales = {k: float(data["scales"][k]) for k in SCALE_NAMES}
            tables = {}
            for op, table in data["tables"].items():
                sizes = tuple(int(n) for n in table["sizes"])
                times = tuple(float(t) for t in table["times_s"])
                if len(sizes) != len(times) or not sizes or list(sizes) != sorted(set(sizes)):
                    raise ValueError(f"table {op}")
                tables[op] = (sizes, times)
            world = int(data["world"])
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise SimError(f"calibration profile: malformed nccl_tests section ({exc})") from None
        values = list(scales.values()) + [t for _, ts in tables.values() for t in ts]
        if world < 2 or not all(math.isfinite(v) and v > 0 for v in values):
            raise SimError("calibration profile: nccl_tests scales and times must be positive")
        return cls(world, scales, tables, list(data.get("residuals", [])),
                   list(data.get("sources", [])))


def _interpolate(sizes, times, nbytes: int) -> float:
    """Log-log linear interpolation of a measured table."""
    for (n0, t0), (n1, t1) in zip(zip(sizes, times), zip(sizes[1:], times[1:])):
        if n0 <= nbytes <= n1:
            if n1 == n0:
                return t0
            w = math.log(nbytes / n0) / math.log(n1 / n0)
            return math.exp(math.log(t0) + w * (math.log(t1) - math.log(t0)))
    return times[-1]


CONFLICT_RATIO = 2.0  # one size measured twice, one time over 2x the other: not one machine


def _rows(tables: list[NcclTestsTable]) -> list[tuple[str, int, float]]:
    """(op, bytes, seconds) of each distinct (op, size), the fastest of its rows' out-of-place
    and in-place times. A size measured again (a repeated run, a second file) within
    :data:`CONFLICT_RATIO` of itself keeps its best time; beyond it the tables disagree about
    the machine, and they are refused, both named. One row per size also keeps the fit's
    work bounded by the sizes, not by the file's length."""
    best: dict[tuple[str, int], tuple[float, str, float]] = {}
    for table in tables:
        for row in table.rows:
            t = min(row.time_us, row.in_place_time_us or math.inf) * 1e-6
            key = (table.op, row.size)
            if key in best:
                low, where, high = best[key]
                low, high = min(low, t), max(high, t)
                if high > CONFLICT_RATIO * low:
                    raise SimError(f"{table.source}: {table.op} at {row.size} bytes: expected "
                                   f"one time per size, got {low * 1e6:g} us and "
                                   f"{high * 1e6:g} us (also in {where})")
                best[key] = (low, where, high)
            else:
                best[key] = (t, table.source, t)
    return [(op, size, low) for (op, size), (low, _, _) in best.items()]


def _loss(shape: GroupShape, rows, scales: dict[str, float]) -> float:
    scaled = shape.scaled(**scales)
    return sum((math.log(collective_cost(op, n, scaled).time_s / t)) ** 2
               for op, n, t in rows) / len(rows)


def fit(tables: list[NcclTestsTable], shape: GroupShape) -> CollectiveCalibration:
    """Fit the model's multipliers to ``tables`` measured on the group ``shape``."""
    if not tables:
        raise SimError("no nccl-tests tables to calibrate from")
    for table in tables:
        if table.world != shape.nranks:
            raise SimError(f"{table.source}: measured on {table.world} ranks, but the "
                           f"topology has {shape.nranks} GPUs")
    rows = _rows(tables)
    free = list(SCALE_NAMES) if shape.nnodes > 1 else ["lat", "bw"]
    scales = {k: 1.0 for k in SCALE_NAMES}
    best = _loss(shape, rows, scales)
    for _ in range(3):  # coordinate sweeps; each sweeps a whole log grid per multiplier
        improved = False
        for name in free:
            for value in _GRID:
                trial = dict(scales, **{name: value})
                loss = _loss(shape, rows, trial)
                if loss < best - 1e-12:
                    best, scales, improved = loss, trial, True
        if not improved:
            break
    scaled = shape.scaled(**scales)
    residuals = []
    for op, n, t in rows:
        predicted = collective_cost(op, n, scaled).time_s
        residuals.append({"op": op, "bytes": n, "measured_s": t, "model_s": predicted,
                          "error": predicted / t - 1})
    measured: dict[str, dict[int, float]] = {}
    for op, n, t in rows:
        measured.setdefault(op, {})
        measured[op][n] = min(t, measured[op].get(n, math.inf))
    tables_out = {op: (tuple(sorted(by)), tuple(by[n] for n in sorted(by)))
                  for op, by in measured.items()}
    return CollectiveCalibration(shape.nranks, scales, tables_out, residuals,
                                 [t.source for t in tables])
