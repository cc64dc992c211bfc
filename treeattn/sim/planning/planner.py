"""``plan_workload(topology, workload)``: score every candidate, simulate the promising, pick
the fastest (``treeattn.plan`` is its library front door).

Search (branch and bound): each candidate first gets its closed-form latency
(:mod:`treeattn.sim.closed_form`), a lower bound on what the simulator will say because it
ignores contention. Candidates are then simulated in increasing order of that bound until
the next bound is no better than the best simulated latency (nothing left can win) or the
simulation budget is spent (8 for p ≤ 64, 3 up to 2048 ranks, 1 beyond).
Candidates never simulated are reported with their closed form, marked ``closed_form``.

The best-bounded candidate is simulated up to ``MAX_FIRST_CHUNK_MESSAGES`` chunk-messages
(butterfly on 16384 ranks needs about 260k). Any other candidate whose simulation would
need more than ``MAX_CHUNK_MESSAGES`` chunk-messages
(ring, allgather and ring all-reduce at large p: O(p²) messages) is never simulated; ring's
closed form includes the queueing of a rank's back-to-back sends on its route, and the
ring's neighbour routes do not share links on the rail-optimised fabrics we build, so there
the closed form is what the simulator would compute (tests check it at small p).

Candidates: a :class:`Candidate` is an algorithm plus the parameters ``build_schedule``
takes. What is enumerated for ``p`` ranks on ``h`` hosts (pruning rules that keep it fast):

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
* ring always (its closed form is vectorised; see the planner for when it is simulated);
* ring-passq for p ≤ 256 (ring's recurrence on query blocks, then its exact collective
  tail): its schedule has p steps on each of p ranks, and its p − 1 serial hops already lose
  to every collective well before that size (on 16 DGX H100 nodes it is 9× the winner);
* hier (node then rail all-gathers, and with its rail step as two all-reduces) when there
  are several hosts and one has several GPUs (otherwise it is oneshot);
* inside one NVLink domain, every plan again on each one-sided transport the cluster offers
  (:func:`one_sided_variants`, named ``…@nccl-symm``, ``…@symm_mem``, ``…@mnnvl_ll128``),
  and on several hosts hier again with its node step on each transport one host offers.

:meth:`Plan.explain` says in one paragraph why the winner wins.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from treeattn.schedule.algorithms import (
    BASELINES,
    SOURCES,
    WireFormatRefused,
    build_schedule,
    partial_dtype_for,
)
from treeattn.schedule.algorithms.serving import LayoutRefused, check_head_split
from treeattn.schedule.algorithms.tree import make_trees
from treeattn.schedule.algorithms.trees import Tree
from treeattn.schedule.ir import Collective, Schedule, sent_bytes
from treeattn.schedule.payloads import SimError
from treeattn.schedule.workload import DecodeWorkload
from treeattn.sim.closed_form import closed_form, collective_schedule, ring_passq
from treeattn.sim.engine import simulate
from treeattn.sim.memory import peak_memory
from treeattn.sim.network import TRANSPORTS, CostModel
from treeattn.sim.onesided import unoffered_reason
from treeattn.sim.parallel import cp_group, cp_view
from treeattn.sim.planning.candidates import (
    Candidate,
    enumerate_candidates,
    is_collective,
    on_transport,
)
from treeattn.sim.planning.explain import explain_plan, size_text
from treeattn.sim.result import SimResult

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
    # With tensor parallelism the plan is for one context-parallel group of ``cluster``.
    cluster: object = field(default=None, repr=False)
    tp: int = 1
    # Algorithms that cannot run this layout, with the reason (never priced as if they ran).
    refused: dict[str, str] = field(default_factory=dict)

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
        """All layers of attention (``predict --token`` prices the whole step)."""
        return self.workload.model.n_layers * (self.latency_s if latency_s is None
                                               else latency_s)

    def best(self, algorithm: str) -> Candidate | None:
        """The best candidate of one algorithm (each row is what its name says)."""
        pool = [c for c in self.candidates if c.algorithm == algorithm]
        return min(pool, key=lambda c: c.latency_s, default=None)

    def best_baseline(self) -> Candidate | None:
        """The fastest candidate a practitioner runs today (anything but treeattn's own)."""
        pool = [c for c in self.candidates if c.algorithm in BASELINES]
        return min(pool, key=lambda c: c.latency_s, default=None)

    def explain(self) -> str:
        return explain_plan(self)

    def to_json(self) -> dict:
        """The JSON object ``treeattn predict --json`` prints."""
        tree = self.tree
        baseline = self.best_baseline()
        return {
            "algorithm": self.algorithm, "name": self.name,
            "transport": self.winner.transport,
            "system": SOURCES[self.algorithm], "layout": self.workload.layout,
            "batch": self.workload.batch, "tp": self.tp,
            "tree": tree.to_dict() if tree is not None else None,
            "latency_s": self.latency_s, "token_latency_s": self.token_latency_s(),
            "comm_bytes": self.prediction.comm_bytes,
            "peak_memory_bytes": max(self.prediction.peak_memory_bytes),
            "critical_path": self.prediction.critical_path,
            "best_baseline": baseline.name if baseline else None,
            "speedup_vs_best_baseline": (baseline.latency_s / self.latency_s
                                         if baseline else None),
            "candidates": [c.to_json() for c in self.candidates],
            "refused": dict(self.refused),
            "explanation": self.explain(),
        }


def _chunk_messages(c: Candidate, cm: CostModel) -> float:
    """How many chunk-messages simulating ``c`` would inject (its simulation cost)."""
    p, w = cm.world, cm.workload
    if c.algorithm == "ring":
        return p * (p - 1) * cm.net.chunking(w.kv_bytes(max(cm.shards)))[0]
    if c.algorithm == "allgather":
        return p * (p - 1)
    if c.algorithm == "ring-passq":
        qblock = w.buffer_bytes("qblock", p)
        return p * (p - 1) * cm.net.chunking(qblock)[0] + 6 * p
    if c.algorithm == "butterfly":
        return p * (p.bit_length() - 1) + 2 * p
    if is_collective(c):
        return 6 * p
    if c.algorithm == "allreduce3":
        return 6 * p * (p - 1) if c.params.get("inner") == "ring" else 6 * p * len(c.trees)
    return 2 * p * len(c.trees)


def score(cands: list[Candidate], topology, cm: CostModel) -> dict[str, str]:
    """Attach trees and the closed-form bound to each candidate; drop (from ``cands``) and
    return, by algorithm, those that cannot run this layout."""
    refused: dict[str, str] = {}
    for c in list(cands):
        try:
            partial_dtype_for(c.algorithm, cm.workload)
        except WireFormatRefused as err:
            refused[c.algorithm] = str(err)
            cands.remove(c)
            continue
        if is_collective(c):
            try:
                check_head_split(c.algorithm, cm.workload, cm.world)
                c.built = schedule_for(c, topology, cm.workload)
            except LayoutRefused as err:
                refused[c.algorithm] = str(err)
                cands.remove(c)
                continue
        elif c.algorithm == "ring-passq":
            c.built = schedule_for(c, topology, cm.workload)
        elif c.algorithm == "tree" or c.params.get("inner") == "tree":
            kw = {k: v for k, v in c.params.items() if k != "inner" or c.algorithm == "tree"}
            c.trees = make_trees(topology, kw.pop("shape", "binomial"), backend=cm.backend,
                                 message_bytes=cm.workload.partial_bytes, **kw)
        c.bound_s = bound(c, cm)
    return refused


def bound(c: Candidate, cm: CostModel) -> float:
    """The candidate's closed-form latency (a lower bound) under its own cost model, or
    ``cm`` when it has none: exact for collective plans, ring's recurrence on query blocks
    plus its exact tail for ring-passq, the message closed forms otherwise."""
    cm = c.costs or cm
    if is_collective(c):
        return float(collective_schedule(cm, c.built))
    if c.algorithm == "ring-passq":
        return float(ring_passq(cm, c.built))
    return float(closed_form(c.algorithm, cm, c.trees, c.params.get("inner", "tree")))


def schedule_for(c: Candidate, topology, workload: DecodeWorkload) -> Schedule:
    """The candidate's schedule; one built while scoring, or a searched tree, is reused."""
    if c.built is not None:
        return c.built
    if c.algorithm == "tree" and c.params.get("shape") == "searched":
        schedule = build_schedule("tree", topology, workload, tree=c.trees[0])
        schedule.params.update(shape="searched")
        return schedule
    return build_schedule(c.algorithm, topology, workload, **c.params)


def run_candidate(c: Candidate, topology, cm: CostModel) -> None:
    cm = c.costs or cm
    schedule = schedule_for(c, topology, cm.workload)
    c.result = simulate(schedule, topology, cm.workload, costs=cm, timeline=cm.world <= 4096)


def one_sided_refusal(cm: CostModel) -> str | None:
    """Why no plan here is priced on a one-sided transport at all (None: they may be)."""
    if cm.backend.calibration is not None:
        return ("a measured calibration prices NCCL's regular algorithms only, not the "
                "one-sided transports")
    if cm.backend.name == "gloo" or not cm.p2p.library:
        return "CPU ranks (gloo) have no one-sided transport"
    return None


def one_sided_variants(cands: list[Candidate], topology, cm: CostModel,
                       transports: tuple[str, ...]) -> list[Candidate]:
    """The scored plans again on each one-sided transport of ``transports`` that this cluster
    offers (:mod:`treeattn.sim.onesided`: one NVLink domain, the right GPUs; never with CPU
    ranks or a measured calibration), scored and named ``…@transport``.

    * Collective plans (the baselines, and ``allreduce3`` over collectives) where at least
      one of their collectives runs on the transport; the rest of their collectives (a max,
      an op it has no kernel for) take NCCL's regular path, as the libraries do.
    * Every schedule of messages, treeattn's (trees, butterfly, all-gather of partials) and
      the baselines' (Ring Attention's pass-KV ring, the pass-Q ring, the paper's
      all-reduces over trees or a ring), each message a store into the peer's buffer
      (:mod:`treeattn.sim.nccl.p2p`): the like-for-like comparison on the same transport.

    Why: engines run their merges on one-sided transports inside one NVLink domain (vLLM's
    symmetric-memory paths, SGLang's ``fi_a2a``, TensorRT-LLM's Helix all-to-all), so there
    the strongest baseline is the fastest on any of them, and the planner compares against
    that one.
    """
    wanted = [t for t in transports if t != "nccl"]
    if not wanted or one_sided_refusal(cm) is not None:
        return []
    world = cm._shape(tuple(range(cm.world)))
    host = cm._shape(tuple(r for r in range(cm.world)
                           if topology.host_of(r) == topology.hosts[0]))
    out = []
    for transport in wanted:
        # every schedule's collectives and messages span all ranks (serving.py,
        # allreduce3.py, passq.py) but hier's, whose node step spans one host: a transport
        # that neither the whole cluster nor one host can offer serves none, which this
        # tells before building its costs
        whole = unoffered_reason(transport, world) is None
        if not whole and (unoffered_reason(transport, host) is not None
                          or not any(c.algorithm == "hier" for c in cands)):
            continue
        other = CostModel(topology, cm.workload, cm.hardware, cm.backend, transport=transport)
        other._group_shapes = cm._group_shapes  # a group's shape is the transport's too
        for c in cands:
            if not whole and c.algorithm != "hier":
                continue  # nothing but hier's node step runs inside one domain
            if is_collective(c):
                steps = (s for rank in c.built.steps for s in rank if isinstance(s, Collective))
                if not any(other.one_sided(s.op, s.group) for s in steps):
                    continue  # nothing of it runs there: the same plan at the same price
            elif other.p2p.one_sided is None:
                continue  # messages: not offered on this cluster
            variant = on_transport(c, other)
            variant.bound_s = bound(variant, cm)
            out.append(variant)
    return out


def plan_workload(topology, workload: DecodeWorkload, hardware=None, backend=None, *,
         algorithms: tuple[str, ...] | None = None, max_simulated: int | None = None,
         simulate_each: bool = False, prune: bool = True,
         transports: tuple[str, ...] = TRANSPORTS) -> Plan:
    """Pick the fastest way to reduce one decode step's attention on ``topology``.

    ``algorithms`` restricts the search; ``simulate_each`` also simulates the best-bounded
    candidate of every algorithm (for side-by-side predictions); ``prune=False`` simulates
    every candidate small enough to simulate (for checking the pruning); ``transports``
    limits how collectives and messages may run (treeattn's runtime runs ``("nccl",)``).

    Examples
    --------
    >>> from treeattn.topo import Topology
    >>> w = DecodeWorkload("llama-3.1-8b", 65536)
    >>> p = plan_workload(Topology.from_spec("dgx-h100:nodes=2"), w)
    >>> p.algorithm != "ring" and p.latency_s < p.best("ring").latency_s
    True
    """
    if workload.tp > 1:  # plan one context-parallel group on its own GPUs and heads
        group_topology, group_workload = cp_view(topology, workload)
        if isinstance(hardware, list | tuple):  # one model per GPU: those of the group's GPUs
            if len(hardware) != topology.num_gpus:
                raise SimError(f"hardware must be a HardwareModel or a list of "
                               f"{topology.num_gpus} of them")
            hardware = [hardware[r] for r in cp_group(topology.num_gpus, workload.tp)]
        chosen = plan_workload(group_topology, group_workload, hardware, backend,
                               algorithms=algorithms, max_simulated=max_simulated,
                               simulate_each=simulate_each, prune=prune, transports=transports)
        chosen.cluster, chosen.tp = topology, workload.tp
        return chosen
    cm = CostModel(topology, workload, hardware, backend)
    check_capacity(cm)
    cands = enumerate_candidates(cm.world, len(topology.hosts), algorithms or ())
    if algorithms is not None:
        cands = [c for c in cands if c.algorithm in algorithms]
        if not cands:
            raise SimError(f"no candidate among algorithms {', '.join(algorithms)}")
    refused = score(cands, topology, cm)
    if not cands:
        raise SimError("; ".join(refused.values()) or "no candidate to plan")
    cands += one_sided_variants(cands, topology, cm, transports)
    if "nccl" not in transports:
        cands = [c for c in cands if c.transport != "nccl"]
        if not cands:
            refusal = one_sided_refusal(cm)
            if refusal is None:
                shape = cm._shape(tuple(range(cm.world)))
                why = [unoffered_reason(t, shape) or f"{t} runs none of their collectives"
                       for t in transports]
                refusal = "; ".join(why)
            raise SimError(f"no candidate runs on {', '.join(transports)} here: {refusal}")
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
    # small worlds simulate in milliseconds: verify as far as it takes
    ranked = _verify_leader(cands, topology, cm, len(cands) if cm.world <= 64 else budget)
    winner = _first_that_fits(ranked, topology, cm)
    return Plan(topology, workload, winner, ranked, cm, refused=refused)


def _verify_leader(cands: list[Candidate], topology, cm: CostModel, budget: int) -> list:
    """Rank by latency, simulating the leader while it only has its closed form.

    A closed form is a lower bound, so it cannot show that a candidate beats one the engine
    has simulated: when the simulation budget ran out on candidates of equal bound (at
    world 2 every tree shape has the same bound), the next of them would otherwise win on
    its bound alone. Costs the engine adds on top of the bound (shared cores, cold host
    steps) make this likely. At most ``budget`` more simulations; a leader still unverified
    after them, or too large to simulate, wins on its bound and says so (``closed_form``).
    Usually the first simulations have already verified the leader, and this adds none.
    """
    ranked = sorted(cands, key=lambda c: (c.latency_s, c.name))
    for _ in range(budget):
        leader = ranked[0]
        if leader.result is not None or _chunk_messages(leader, cm) > MAX_CHUNK_MESSAGES:
            break
        run_candidate(leader, topology, cm)
        ranked = sorted(cands, key=lambda c: (c.latency_s, c.name))
    return ranked


def _capacity(cm: CostModel) -> float:
    """The smallest device memory among the ranks (0: unknown)."""
    known = [h.memory_bytes for h in cm.hardware if h.memory_bytes > 0]
    return min(known) if len(known) == len(cm.hardware) else 0.0


def check_capacity(cm: CostModel) -> None:
    """Refuse a workload whose KV shard alone does not fit in a GPU's memory."""
    capacity = _capacity(cm)
    if not capacity:
        return
    w = cm.workload
    need = w.kv_bytes(max(cm.shards)) + 2 * w.partial_bytes
    if need > capacity:
        raise SimError(f"{w.describe()} does not fit: each GPU needs {size_text(need)} for its KV "
                       f"shard, and a {cm.hardware[0].name} has {size_text(capacity)}")


def _first_that_fits(ranked: list[Candidate], topology, cm: CostModel) -> Candidate:
    """The fastest candidate whose predicted peak memory fits every GPU (ring's extra KV
    blocks can overflow where a merge of partials still fits)."""
    capacity = _capacity(cm)
    for c in ranked:
        if c.result is None:
            c.result = closed_form_result(c, topology, cm)
        if not capacity or max(c.result.peak_memory_bytes) <= capacity:
            if not math.isfinite(c.latency_s) or c.latency_s < 0:
                raise SimError(f"the prediction for {c.name} is {c.latency_s}: a link or device "
                               "figure must be out of range")
            return c
    raise SimError(f"no plan fits in {size_text(capacity)} of GPU memory")


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
        sent = [sum(sent_bytes(s) for s in steps) for steps in schedule.steps]
        memory = peak_memory(schedule, w)
    return SimResult(c.algorithm, dict(c.params), c.bound_s, sum(sent), sent, memory,
                     method="closed_form")
