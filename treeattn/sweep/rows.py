"""Predictions as table rows: one :class:`PredictionRow` per algorithm for one planned point,
plus one row for the planner's pick.

Shared by ``treeattn predict`` and the sweeps, so both report the same numbers under the same
keys. Each algorithm row is that algorithm's best candidate and nothing else (``tree`` is a
tree shape, never the butterfly). The ``pick`` row is the planner's choice over all of them.

Speedups are reported two ways:

* ``speedup_vs_best_baseline``: against the fastest algorithm a practitioner runs today at
  this point (every registry entry but treeattn's own; see
  :data:`treeattn.schedule.algorithms.BASELINES`). This is the honest headline figure; below 1
  the baseline wins, and the planner then picks it.
* ``speedup_vs_ring``: against Ring Attention's pass-KV ring, the paper's comparison; kept
  for reference, labelled as such in tables.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from treeattn.schedule.algorithms import ALGORITHM_NAMES, SOURCES
from treeattn.sim import Plan
from treeattn.sim.planning.candidates import Candidate
from treeattn.sim.planning.planner import closed_form_result

PICK = "pick"  # the row that carries the planner's choice


@dataclass(frozen=True)
class PredictionRow:
    """One algorithm's prediction for one (topology, model, seq_len, batch) point.

    The field order is the key order of the JSON rows ``treeattn predict`` prints.
    """

    topology: str
    gpus: int
    model: str
    seq_len: int
    batch: int
    tp: int
    algorithm: str
    system: str
    name: str
    transport: str  # how its collectives run (treeattn.sim.network.TRANSPORTS)
    layout: str
    latency_s: float
    token_latency_s: float
    comm_bytes: int
    peak_memory_bytes: int
    speedup_vs_best_baseline: float | None
    best_baseline: str | None
    speedup_vs_ring: float | None
    method: str

    def to_json(self) -> dict:
        """A JSON-ready dict with the keys in field order."""
        return asdict(self)


def _row(plan_: Plan, spec: str, label: str, cand: Candidate) -> PredictionRow:
    result = cand.result or closed_form_result(cand, plan_.topology, plan_.costs)
    ring, baseline = plan_.best("ring"), plan_.best_baseline()
    cluster = plan_.cluster or plan_.topology  # with TP, the plan is one CP group's
    return PredictionRow(
        topology=spec, gpus=cluster.num_gpus, model=plan_.workload.model.name,
        seq_len=plan_.workload.seq_len, batch=plan_.workload.batch, tp=plan_.tp,
        algorithm=label,
        system=SOURCES[cand.algorithm], name=cand.name, transport=cand.transport,
        layout=plan_.workload.layout,
        latency_s=float(cand.latency_s),
        token_latency_s=float(plan_.token_latency_s(cand.latency_s)),
        comm_bytes=int(result.comm_bytes), peak_memory_bytes=int(max(result.peak_memory_bytes)),
        speedup_vs_best_baseline=(float(baseline.latency_s / cand.latency_s)
                                  if baseline else None),
        best_baseline=baseline.name if baseline else None,
        speedup_vs_ring=float(ring.latency_s / cand.latency_s) if ring else None,
        method=result.method,
    )


def algorithm_rows(plan_: Plan, spec: str) -> list[PredictionRow]:
    """One row per algorithm for a plan made with ``simulate_each``, then the pick."""
    rows = [_row(plan_, spec, algorithm, cand) for algorithm in ALGORITHM_NAMES
            if (cand := plan_.best(algorithm)) is not None]
    rows.append(_row(plan_, spec, PICK, plan_.winner))
    return rows
