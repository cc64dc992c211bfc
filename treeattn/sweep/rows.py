"""Predictions as table rows: one :class:`PredictionRow` per algorithm for one planned point.

Shared by ``treeattn predict`` and the sweeps, so both report the same numbers under the same
keys. ``tree`` is the best tree-style plan (a tree shape, butterfly or all-gather); every
other name is that algorithm's best candidate; ``speedup_vs_ring`` compares with the best ring.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from treeattn.sim import ALGORITHM_NAMES, Plan
from treeattn.sim.planner import closed_form_result


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
    algorithm: str
    name: str
    latency_s: float
    token_latency_s: float
    comm_bytes: int
    peak_memory_bytes: int
    speedup_vs_ring: float | None
    method: str

    def to_json(self) -> dict:
        """A JSON-ready dict with the keys in field order."""
        return asdict(self)


def algorithm_rows(plan_: Plan, spec: str) -> list[PredictionRow]:
    """One row per algorithm for a plan made with ``simulate_each``."""
    ring = plan_.best("ring")
    rows = []
    for algorithm in ALGORITHM_NAMES:
        cand = plan_.best(algorithm)
        if cand is None:
            continue
        result = cand.result or closed_form_result(cand, plan_.topology, plan_.costs)
        rows.append(PredictionRow(
            topology=spec, gpus=plan_.topology.num_gpus, model=plan_.workload.model.name,
            seq_len=plan_.workload.seq_len, batch=plan_.workload.batch, algorithm=algorithm,
            name=cand.name, latency_s=float(cand.latency_s),
            token_latency_s=float(plan_.token_latency_s(cand.latency_s)),
            comm_bytes=int(result.comm_bytes),
            peak_memory_bytes=int(max(result.peak_memory_bytes)),
            speedup_vs_ring=float(ring.latency_s / cand.latency_s) if ring else None,
            method=result.method,
        ))
    return rows
