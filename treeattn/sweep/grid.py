"""The sweep grid: topologies × node counts × context lengths, each point predicted.

A *point* is one (topology spec, model, seq_len). Predicting it runs the planner once with
``simulate_each=True`` and turns the result into one row per algorithm (see
:mod:`treeattn.sweep.rows`) plus the planner's ``pick``, each with its speedup over the
strongest baseline at that point and over Ring Attention's pass-KV ring.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path

from treeattn.sim import ALGORITHM_NAMES, DecodeWorkload, ModelConfig, SimError, plan_workload
from treeattn.sim.files.profiles import plan_overrides
from treeattn.sweep.rows import PICK, algorithm_rows
from treeattn.topo import Topology


@dataclass(frozen=True)
class SweepPoint:
    """One point of the grid: a topology spec, a model, a context length, a decode batch and
    a tensor-parallel size."""

    topology: str
    model: str
    seq_len: int
    batch: int = 1
    tp: int = 1


def with_nodes(spec: str, nodes: int) -> str:
    """``spec`` with its ``nodes`` parameter set; a spec that already names a different node
    count is a contradiction, refused rather than silently overridden.

    >>> with_nodes("dgx-h100", 4)
    'dgx-h100:nodes=4'
    >>> with_nodes("pcie-4090:gpus=4", 8)
    'pcie-4090:gpus=4,nodes=8'
    """
    name, _, params = spec.partition(":")
    given = [p for p in params.split(",") if p.startswith("nodes=")]
    if given and given[0] != f"nodes={nodes}":
        raise SimError(f"{spec} already sets {given[0]}; drop it or drop --nodes {nodes}")
    kept = [p for p in params.split(",") if p and not p.startswith("nodes=")]
    return f"{name}:" + ",".join(kept + [f"nodes={nodes}"])


def expand_grid(topologies: Iterable[str], models: Iterable[str], seq_lens: Iterable[int],
                nodes: Iterable[int] | None = None, batches: Iterable[int] = (1,),
                tp: int = 1) -> list[SweepPoint]:
    """Every combination, with ``nodes`` applied to each topology spec when given."""
    if nodes:
        for spec in topologies:
            if Path(spec).exists():
                raise SimError(f"--nodes applies to built-in specs, not to the file {spec}")
    specs = [with_nodes(t, n) for t in topologies for n in nodes] if nodes else list(topologies)
    return [SweepPoint(s, m, int(L), int(b), tp) for s in specs for m in models
            for L in seq_lens for b in batches]


def check_points(points: Iterable[SweepPoint]) -> dict[str, Topology]:
    """Build every topology of the grid and check every point, before any work is done.

    Returns the topologies by spec. Raises ``SimError``/``TopologyError`` naming the point.
    """
    topologies: dict[str, Topology] = {}
    for point in points:
        if point.topology not in topologies:
            topologies[point.topology] = Topology.load(point.topology)
        _check_point(point, topologies[point.topology])
        ModelConfig.from_name(point.model)
    return topologies


def _check_point(point: SweepPoint, topology: Topology) -> None:
    if topology.num_gpus < 2:
        raise SimError(f"{point.topology} has one GPU: there is no reduction to plan")
    if point.seq_len < topology.num_gpus:
        raise SimError(f"{point.topology}: seq_len {point.seq_len} is smaller than its "
                       f"{topology.num_gpus} GPUs")


def predict_point(point: SweepPoint, algorithms: Iterable[str] = ALGORITHM_NAMES,
                  model: ModelConfig | None = None,
                  topology: Topology | None = None, profile: dict | None = None) -> list[dict]:
    """One row per algorithm for ``point``, with its speedup over ring.

    ``model`` overrides the registry lookup of ``point.model`` (synthetic models);
    ``topology`` saves building it again.
    """
    topology = topology or Topology.load(point.topology)
    _check_point(point, topology)
    workload = DecodeWorkload(model or point.model, point.seq_len, batch=point.batch,
                              tp=point.tp)
    chosen = plan_workload(topology, workload, simulate_each=True,
                           **plan_overrides(profile, topology))
    rows = [r.to_json() for r in algorithm_rows(chosen, point.topology)
            if r.algorithm in algorithms or r.algorithm == PICK]
    for row in rows:
        row.update(topology=_short_name(point.topology), spec=point.topology,
                   hosts=len(topology.hosts),
                   model_dim=workload.model.n_heads * workload.model.head_dim)
    return rows


def _short_name(spec: str) -> str:
    """The builder name of a spec (``dgx-h100:nodes=2`` → ``dgx-h100``), or a file's stem."""
    return Path(spec).stem if Path(spec).exists() else spec.split(":")[0]


def run_sweep(points: list[SweepPoint], algorithms: Iterable[str] = ALGORITHM_NAMES,
              progress: Callable[[SweepPoint], None] | None = None,
              profile: dict | None = None) -> list[dict]:
    """Check the whole grid first, then predict every point; ``progress`` is called after
    each one."""
    topologies = check_points(points)
    rows: list[dict] = []
    for point in points:
        rows.extend(predict_point(point, tuple(algorithms),
                                  topology=topologies[point.topology], profile=profile))
        if progress:
            progress(point)
    return rows


def memory_rows(spec: str, seq_len: int, hidden_sizes=(1024, 2048, 4096, 8192, 16384),
                head_dim: int = 128) -> list[dict]:
    """Tree and ring predictions for multi-head models that differ only in hidden size.

    Every head has its own K and V (Hq = Hkv = hidden / head_dim), as in the paper's memory
    figure, so the KV cache grows with the hidden size.
    """
    rows = []
    base = ModelConfig.from_name("llama-3.1-8b")
    for hidden in hidden_sizes:
        heads = hidden // head_dim
        model = replace(base, name=f"mha-{hidden}", n_heads=heads, n_kv_heads=heads,
                        head_dim=head_dim, dim=hidden)
        rows += predict_point(SweepPoint(spec, model.name, seq_len), ("tree", "ring"), model)
    return rows


