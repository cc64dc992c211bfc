"""The planner's candidates: every tree shape, the butterfly, the all-gather of partials and
the collective baselines, each a named algorithm with its parameters, to be scored.

Beyond ``HUGE`` ranks only a short list of tree shapes is scored (see
:mod:`treeattn.sim.planning.planner`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from treeattn.schedule.algorithms.trees import Tree
from treeattn.schedule.ir import Schedule
from treeattn.sim.result import SimResult

# -- candidates --------------------------------------------------------------------------
HUGE = 4096  # beyond this many ranks only a short list of shapes is scored


@dataclass
class Candidate:
    """One plan the planner scored: closed-form bound, and a simulation when it ran."""

    name: str
    algorithm: str
    params: dict
    trees: list[Tree] = field(default_factory=list)
    bound_s: float = float("inf")
    result: SimResult | None = None
    built: Schedule | None = field(default=None, repr=False)  # kept when scoring built it
    costs: object = field(default=None, repr=False)  # its CostModel when not the plan's

    @property
    def transport(self) -> str:
        """How its collectives and messages run (:data:`treeattn.sim.network.TRANSPORTS`)."""
        return self.costs.transport if self.costs is not None else "nccl"

    @property
    def latency_s(self) -> float:
        return self.result.makespan_s if self.result is not None else self.bound_s

    @property
    def method(self) -> str:
        return self.result.method if self.result is not None else "closed_form"

    def to_json(self) -> dict:
        return {"name": self.name, "algorithm": self.algorithm, "transport": self.transport,
                "latency_s": self.latency_s, "closed_form_s": self.bound_s,
                "method": self.method}


def roots_for(world: int) -> list[int]:
    if world <= 16:
        return list(range(world))
    return sorted({0, world // 2}) if world <= 256 else [0]


def tree_shapes(world: int, hosts: int) -> list[dict]:
    if world > HUGE:
        return [dict(shape="binomial"), dict(shape="kary", k=8),
                dict(shape="hierarchical", inner="flat", outer="binomial"),
                dict(shape="hierarchical", inner="binomial", outer="binomial")]
    shapes = [dict(shape="binomial"), dict(shape="kary", k=4), dict(shape="kary", k=8),
              dict(shape="double_binary")]
    if world <= 256:
        shapes.append(dict(shape="binary"))
    if world <= 64:
        shapes.append(dict(shape="flat"))
    if world <= 16:
        shapes.append(dict(shape="chain"))
    if 1 < hosts < world:
        for inner in ("flat", "binomial"):
            shapes.append(dict(shape="hierarchical", inner=inner, outer="binomial"))
            if inner == "binomial" or world <= 256:
                shapes.append(dict(shape="hierarchical", inner=inner, outer="kary", k=4))
    if world <= 256:
        shapes.append(dict(shape="searched"))
    return shapes


def tree_name(params: dict) -> str:
    shape = params["shape"]
    if shape == "kary":
        shape = f"{params['k']}-ary"
    if shape == "hierarchical":
        outer = params["outer"] if params["outer"] != "kary" else f"{params['k']}-ary"
        shape = f"hierarchical({params['inner']}/{outer})"
    return f"tree/{shape}@{params['root']}"


def enumerate_candidates(world: int, hosts: int, forced: tuple[str, ...] = ()) -> list[Candidate]:
    """Every candidate for ``world`` ranks on ``hosts`` hosts; ``hier`` only where it has
    two levels (several hosts, one of them with several GPUs: elsewhere it is ``oneshot``)
    unless it is in ``forced`` (the algorithms a caller asked for by name)."""
    out = []
    for shape in tree_shapes(world, hosts):
        for root in roots_for(world):
            params = dict(shape, root=root)
            out.append(Candidate(tree_name(params), "tree", params))
    out.append(Candidate("butterfly", "butterfly", {}))
    if world <= 256:
        out.append(Candidate("allgather", "allgather", {}))
    out.append(Candidate("allreduce3", "allreduce3", {"inner": "collective"}))
    out.append(Candidate("allreduce3/tree", "allreduce3", {"inner": "tree"}))
    if world <= 256:
        out.append(Candidate("allreduce3/ring", "allreduce3", {"inner": "ring"}))
    for name in COLLECTIVE_ALGORITHMS:
        if name != "hier" or 1 < hosts < world or name in forced:
            out.append(Candidate(name, name, {}))
    if 1 < hosts < world:  # hier's rail step as two all-reduces (NCCL's tree on many hosts)
        out.append(Candidate("hier/all_reduce", "hier", {"rail": "all_reduce"}))
    out.append(Candidate("ring", "ring", {}))
    if world <= 256:
        out.append(Candidate("ring-passq", "ring-passq", {}))
    return out


# Algorithms built only of collectives and local steps: their closed form is exact.
COLLECTIVE_ALGORITHMS = ("allreduce2", "oneshot", "helix", "dcp", "hier")


def is_collective(c: Candidate) -> bool:
    return c.algorithm in COLLECTIVE_ALGORITHMS or c.params.get("inner") == "collective"


def on_transport(c: Candidate, costs) -> Candidate:
    """The same collective plan with its collectives priced by ``costs`` (a CostModel of
    another transport), named for that transport."""
    return Candidate(f"{c.name}@{costs.transport}", c.algorithm, dict(c.params),
                     trees=list(c.trees), built=c.built, costs=costs)


# -- the plan ----------------------------------------------------------------------------
