"""The candidate plans the planner considers, and the pruning rules that keep it fast.

A :class:`Candidate` is an algorithm plus the parameters ``build_schedule`` takes. What is
enumerated for ``p`` ranks on ``h`` hosts:

* tree shapes: binomial, 4-ary, 8-ary and double binary always; binary for p ≤ 256; flat
  for p ≤ 64; chain for p ≤ 16; hierarchical (inner flat or binomial × outer binomial or
  4-ary; flat/4-ary only up to 256 ranks) when there is more than one host; searched (FNF,
  O(p²)) for p ≤ 256;
* roots: every rank for p ≤ 16, rank 0 and rank p/2 up to 256 ranks, rank 0 beyond (on a
  symmetric cluster the root matters little; on small irregular boxes every root is tried);
* beyond ``HUGE`` (4096) ranks, only binomial, 8-ary and the two hierarchical trees with
  a flat or binomial inner tree, rooted at 0: every distinct (src, dst) pair costs a route
  look-up, and the full list would need millions of them;
* butterfly always; allgather for p ≤ 256 (its p(p−1) messages make it hopeless beyond);
* allreduce3 over a binomial tree, and over a ring for p ≤ 256;
* ring always (its closed form is vectorised; see the planner for when it is simulated).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from treeattn.sim.results import SimResult
from treeattn.sim.trees import Tree

TREE_STYLE = ("tree", "butterfly", "allgather")
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

    @property
    def latency_s(self) -> float:
        return self.result.makespan_s if self.result is not None else self.bound_s

    @property
    def method(self) -> str:
        return self.result.method if self.result is not None else "closed_form"

    @property
    def family(self) -> str:
        return "tree" if self.algorithm in TREE_STYLE else self.algorithm

    def to_dict(self) -> dict:
        return {"name": self.name, "algorithm": self.algorithm, "latency_s": self.latency_s,
                "closed_form_s": self.bound_s, "method": self.method}


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


def enumerate_candidates(world: int, hosts: int) -> list[Candidate]:
    out = []
    for shape in tree_shapes(world, hosts):
        for root in roots_for(world):
            params = dict(shape, root=root)
            out.append(Candidate(tree_name(params), "tree", params))
    out.append(Candidate("butterfly", "butterfly", {}))
    if world <= 256:
        out.append(Candidate("allgather", "allgather", {}))
    out.append(Candidate("allreduce3/tree", "allreduce3", {"inner": "tree"}))
    if world <= 256:
        out.append(Candidate("allreduce3/ring", "allreduce3", {"inner": "ring"}))
    out.append(Candidate("ring", "ring", {}))
    return out
