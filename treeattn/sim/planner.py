"""``plan(topology, workload)``: score every candidate, simulate the promising, pick the fastest.

Search (branch and bound): each candidate of :mod:`treeattn.sim.candidates` first gets its
closed-form latency (:mod:`treeattn.sim.closed_form`), a lower bound on what the simulator
will say because it ignores contention. Candidates are then simulated in increasing order of
that bound until the next bound is no better than the best simulated latency (nothing left
can win) or the simulation budget is spent (8 for p ≤ 64, 3 up to 2048 ranks, 1 beyond).
Candidates never simulated are reported with their closed form, marked ``closed_form``.

The best-bounded candidate is simulated up to ``MAX_FIRST_CHUNK_MESSAGES`` chunk-messages
(butterfly on 16384 ranks needs about 260k). Any other candidate whose simulation would
need more than ``MAX_CHUNK_MESSAGES`` chunk-messages
(ring, allgather and ring all-reduce at large p: O(p²) messages) is never simulated; ring's
closed form includes the queueing of a rank's back-to-back sends on its route, and the
ring's neighbour routes do not share links on the rail-optimised fabrics we build, so there
the closed form is what the simulator would compute (tests check it at small p).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from treeattn.sim.alg_tree import make_trees
from treeattn.sim.algorithms import build_schedule
from treeattn.sim.candidates import Candidate, enumerate_candidates
from treeattn.sim.closed_form import closed_form
from treeattn.sim.costs import CostModel
from treeattn.sim.engine import simulate
from treeattn.sim.errors import SimError
from treeattn.sim.explain import explain_plan
from treeattn.sim.memory import peak_memory
from treeattn.sim.results import SimResult
from treeattn.sim.schedule import Schedule
from treeattn.sim.trees import Tree
from treeattn.sim.workload import DecodeWorkload

MAX_CHUNK_MESSAGES = 100_000
# The candidate with the best bound is simulated up to this size, so that on very large
# clusters the plan that wins is a simulated one whenever that is affordable.
MAX_FIRST_CHUNK_MESSAGES = 400_000


@dataclass
class Plan:
    """The chosen schedule, its prediction, and every candidate considered (ranked)."""

    topology: object
    workload: DecodeWorkload
    winner: Candidate
    candidates: list[Candidate]
    costs: CostModel = field(repr=False)
    _schedule: Schedule | None = field(default=None, repr=False)

    @property
    def algorithm(self) -> str:
        return self.winner.algorithm

    @property
    def name(self) -> str:
        return self.winner.name

    @property
    def prediction(self) -> SimResult:
        return self.winner.result

    @property
    def latency_s(self) -> float:
        return self.winner.latency_s

    @property
    def tree(self) -> Tree | None:
        return self.winner.trees[0] if self.winner.algorithm == "tree" else None

    @property
    def schedule(self) -> Schedule:
        if self._schedule is None:
            self._schedule = schedule_for(self.winner, self.topology, self.workload)
        return self._schedule

    def token_latency_s(self, latency_s: float | None = None) -> float:
        """All layers of attention, plus the replicated rest of the model if requested."""
        return token_latency(self.workload, self.costs,
                             self.latency_s if latency_s is None else latency_s)

    def best(self, algorithm: str) -> Candidate | None:
        """The best candidate of one algorithm, or of the tree-style family for ``"tree"``."""
        pool = [c for c in self.candidates
                if (c.family == "tree" if algorithm == "tree" else c.algorithm == algorithm)]
        return min(pool, key=lambda c: c.latency_s, default=None)

    def explain(self) -> str:
        return explain_plan(self)

    def to_dict(self) -> dict:
        tree = self.tree
        return {
            "algorithm": self.algorithm, "name": self.name,
            "tree": tree.to_dict() if tree is not None else None,
            "latency_s": self.latency_s, "token_latency_s": self.token_latency_s(),
            "comm_bytes": self.prediction.comm_bytes,
            "peak_memory_bytes": max(self.prediction.peak_memory_bytes),
            "critical_path": self.prediction.critical_path,
            "candidates": [c.to_dict() for c in self.candidates],
            "explanation": self.explain(),
        }


def token_latency(workload: DecodeWorkload, costs: CostModel, latency_s: float) -> float:
    total = workload.model.n_layers * latency_s
    if workload.include_model:
        total += workload.model.weight_bytes_per_token() / float(costs.bw.min())
    return total


def _chunk_messages(c: Candidate, cm: CostModel) -> float:
    """How many chunk-messages simulating ``c`` would inject (its simulation cost)."""
    p, w = cm.world, cm.workload
    if c.algorithm == "ring":
        return p * (p - 1) * cm.net.chunking(w.kv_bytes(max(cm.shards)))[0]
    if c.algorithm == "allgather":
        return p * (p - 1)
    if c.algorithm == "butterfly":
        return p * (p.bit_length() - 1) + 2 * p
    if c.algorithm == "allreduce3":
        return 6 * p * (p - 1) if c.params.get("inner") == "ring" else 6 * p * len(c.trees)
    return 2 * p * len(c.trees)


def score(cands: list[Candidate], topology, cm: CostModel) -> None:
    """Attach trees and the closed-form bound to each candidate."""
    for c in cands:
        if c.algorithm == "tree" or c.params.get("inner") == "tree":
            kw = {k: v for k, v in c.params.items() if k != "inner" or c.algorithm == "tree"}
            c.trees = make_trees(topology, kw.pop("shape", "binomial"), backend=cm.backend,
                                 message_bytes=cm.workload.partial_bytes, **kw)
        c.bound_s = float(closed_form(c.algorithm, cm, c.trees, c.params.get("inner", "tree")))


def schedule_for(c: Candidate, topology, workload: DecodeWorkload) -> Schedule:
    """The candidate's schedule; a searched tree is reused, not searched again."""
    if c.algorithm == "tree" and c.params.get("shape") == "searched":
        schedule = build_schedule("tree", topology, workload, tree=c.trees[0])
        schedule.params.update(shape="searched")
        return schedule
    return build_schedule(c.algorithm, topology, workload, **c.params)


def run_candidate(c: Candidate, topology, cm: CostModel) -> None:
    schedule = schedule_for(c, topology, cm.workload)
    c.result = simulate(schedule, topology, cm.workload, costs=cm, timeline=cm.world <= 4096)


def plan(topology, workload: DecodeWorkload, hardware=None, backend=None, *,
         algorithms: tuple[str, ...] | None = None, max_simulated: int | None = None,
         simulate_each: bool = False, prune: bool = True) -> Plan:
    """Pick the fastest way to reduce one decode step's attention on ``topology``.

    ``algorithms`` restricts the search; ``simulate_each`` also simulates the best-bounded
    candidate of every algorithm (for side-by-side predictions); ``prune=False`` simulates
    every candidate small enough to simulate (for checking the pruning).

    Examples
    --------
    >>> from treeattn.topo import Topology
    >>> p = plan(Topology.from_spec("dgx-h100:nodes=2"), DecodeWorkload("llama-3.1-8b", 65536))
    >>> p.algorithm != "ring" and p.latency_s < p.best("ring").latency_s
    True
    """
    cm = CostModel(topology, workload, hardware, backend)
    cands = enumerate_candidates(cm.world, len(topology.hosts))
    if algorithms is not None:
        cands = [c for c in cands if c.algorithm in algorithms]
        if not cands:
            raise SimError(f"no candidate among algorithms {', '.join(algorithms)}")
    score(cands, topology, cm)
    cands.sort(key=lambda c: (c.bound_s, c.name))
    budget = max_simulated or (8 if cm.world <= 64 else 3 if cm.world <= 2048 else 1)
    best, used = math.inf, 0
    for c in cands:
        if prune and (c.bound_s >= best or used >= budget):
            break
        limit = MAX_FIRST_CHUNK_MESSAGES if used == 0 else MAX_CHUNK_MESSAGES
        if _chunk_messages(c, cm) <= limit:
            run_candidate(c, topology, cm)
            best, used = min(best, c.latency_s), used + 1
    if simulate_each:
        for alg in {c.algorithm for c in cands}:
            first = min((c for c in cands if c.algorithm == alg), key=lambda c: c.bound_s)
            if first.result is None and _chunk_messages(first, cm) <= MAX_CHUNK_MESSAGES:
                run_candidate(first, topology, cm)
    ranked = sorted(cands, key=lambda c: (c.latency_s, c.name))
    if ranked[0].result is None:
        ranked[0].result = closed_form_result(ranked[0], topology, cm)
    return Plan(topology, workload, ranked[0], ranked, cm)


def closed_form_result(c: Candidate, topology, cm: CostModel) -> SimResult:
    """A SimResult for a candidate predicted by its closed form only (no timeline)."""
    w, p = cm.workload, cm.world
    if c.algorithm == "ring":
        kv = [w.kv_bytes(n) for n in cm.shards]
        sent = [sum(kv) - kv[(r + 1) % p] for r in range(p)]  # all blocks but r+1's
        # memory.py's walk for even blocks b: shard + 2b + 2 partials (p = 2: one b);
        # with uneven shards this takes the largest block, an upper bound.
        extra = max(kv) * (2 if p > 2 else 1)
        memory = [k + extra + 2 * w.partial_bytes for k in kv]
    else:
        schedule = schedule_for(c, topology, w)
        sent = [sum(s.nbytes for s in steps if type(s).__name__ == "Send")
                for steps in schedule.steps]
        memory = peak_memory(schedule, w)
    return SimResult(c.algorithm, dict(c.params), c.bound_s, sum(sent), sent, memory,
                     method="closed_form")
