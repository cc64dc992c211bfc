"""Closed-form α-β latency of each algorithm on uncontended links.

Every message from ``a`` to ``b`` of ``n`` bytes costs the sender's post, then the
cut-through wire time (``Σ latency + n/β_bottleneck``), then the receiver's completion:
``α_ab(n) + n/β_ab(n)``, all from :mod:`treeattn.sim.nccl.p2p`, the engine's own per-message
model (on NCCL/RCCL the protocol the library picks for ``n``; on gloo the cheaper of the
Python steps' and the C program's costs, where a calibration has both, so that these stay
lower bounds). Compute
steps cost ``max(bytes/BW, FLOPs/peak) + launch``. The formulas below follow each algorithm's step
order (the schedule generators' docstrings) and propagate per-rank ready times:

* tree, up: ``T(v) = fold over children c (reduce order) of max(T, T(c) + send + wire) + recv
  + merge``; down: each child receives ``send · k + wire`` after its parent's k-th send.
  On a homogeneous network this is ``attn + depth · 2(α + n/β) + merges`` for a binomial tree.
* butterfly: ``⌈log2 p⌉`` rounds of ``max(own sends, partner's arrivals) + recv + merge``;
  when p is not a power of two some rounds carry two partials (see
  :mod:`treeattn.schedule.algorithms.butterfly`).
* allgather: the ``j``-th message from ``r`` leaves at ``attn_r + j·send``; ``r`` merges its
  ``p − 1`` arrivals in order.
* ring: rank r's step ``i + 1`` starts at
  ``max(S_r(i) + send + compute(block), A_r(i)) + recv`` where the block arrives at
  ``A_r(i) = max(S_{r−1}(i) + send + wire(block), A_r(i−1) + block / β_min)``: a rank's
  back-to-back sends all take the same route, so they queue on its slowest link (ring's one
  unavoidable contention; without it a fast sender would be credited with overlapping
  transfers on one link).
* allreduce3: the phases above in sequence with the rescale/finalize computes between them.
* ring-passq: ring's recurrence with query blocks and the own shard attended every step,
  then its collective tail (:func:`ring_passq`).

They ignore link contention and shared cores, so the simulator can only be slower; with no
contention it agrees to rounding. Everything is vectorised or linear in the number of
messages, which is what lets the planner score thousands of ranks quickly.
"""

from __future__ import annotations

import numpy as np

from treeattn.schedule.algorithms.trees import Tree
from treeattn.sim.network import CostModel


def tree_up(cm: CostModel, start, tree: Tree, nbytes: float) -> list[float]:
    """Ready times after the up pass (merging ``nbytes`` messages) of ``tree``."""
    t = list(start)
    arrive = [0.0] * tree.world
    for v in reversed(tree.pre_order):
        now = t[v]
        for c in tree.reduce_order(v):
            now = max(now, arrive[c]) + cm.recv_cost(nbytes) + cm.compute(v, 3 * nbytes)
        u = tree.parent[v]
        if u >= 0:
            now += cm.send_cost(nbytes)
            arrive[v] = now + cm.wire(v, u, nbytes)
        t[v] = now
    return t


def tree_down(cm: CostModel, start, tree: Tree, nbytes: float) -> list[float]:
    """Ready times after the down pass (broadcast of ``nbytes``) of ``tree``."""
    t = list(start)
    arrive = [0.0] * tree.world
    for v in tree.pre_order:
        now = t[v]
        if tree.parent[v] >= 0:
            now = max(now, arrive[v]) + cm.recv_cost(nbytes)
        for c in tree.bcast_order(v):
            now += cm.send_cost(nbytes)
            arrive[c] = now + cm.wire(v, c, nbytes)
        t[v] = now
    return t


def tree_allreduce(cm: CostModel, start, trees: list[Tree], payload: str = "partial"):
    count = len(trees)
    sizes = cm.workload.chunk_bytes(payload, count)
    t = list(start)
    for tree, n in zip(trees, sizes):
        t = tree_up(cm, t, tree, n)
    for tree, n in zip(trees, sizes):
        t = tree_down(cm, t, tree, n)
    return t


def tree(cm: CostModel, trees: list[Tree]) -> float:
    return max(tree_allreduce(cm, cm.attention_vec(), trees))


def butterfly(cm: CostModel) -> float:
    p, n = cm.world, cm.workload.partial_bytes
    merge = [cm.compute(r, 3 * n) for r in range(p)]
    send, recv = cm.send_cost(n), cm.recv_cost(n)
    t = list(cm.attention_vec())
    if p & (p - 1) == 0:
        k = 1
        while k < p:
            sent = [t[r] + send for r in range(p)]
            t = [max(sent[r], sent[r ^ k] + cm.wire(r ^ k, r, n)) + recv + merge[r]
                 for r in range(p)]
            k <<= 1
        return max(t)
    top = p.bit_length() - 1
    residue = p - (1 << top)
    for j in range(top + 1):
        final = j == top
        grows = not final and bool(residue >> j & 1)
        ships = grows and residue % (1 << j) != 0
        t = _cyclic_round(cm, t, 1 << j, n, 2 if ships else 1,
                          [merge[r] * (1 + grows) for r in range(p)])
    return max(t)


def _cyclic_round(cm: CostModel, t: list[float], dist: int, n: float, messages: int,
                  merges: list[float]) -> list[float]:
    """One round of the cyclic butterfly: ``r`` posts ``messages`` partials to ``r − dist``,
    receives as many from ``r + dist`` (back to back on one route: each waits for the one
    before it to clear the bottleneck), then merges."""
    p = cm.world
    send, recv = cm.send_cost(n), cm.recv_cost(n)
    out = []
    for r in range(p):
        src = (r + dist) % p
        wire = cm.wire(src, r, n)
        serial = n * cm.p2p.summary(src, r, n)[1]  # behind the previous one on the bottleneck
        now, arrival = t[r] + messages * send, 0.0
        for i in range(messages):
            arrival = max(t[src] + (i + 1) * send + wire, arrival + serial)
            now = max(now, arrival) + recv
        out.append(now + merges[r])
    return out


def allgather(cm: CostModel) -> float:
    p, n = cm.world, cm.workload.partial_bytes
    attn = cm.attention_vec()
    send, recv = cm.send_cost(n), cm.recv_cost(n)
    end = 0.0
    for r in range(p):
        now = attn[r] + (p - 1) * send
        merge = cm.compute(r, 3 * n)
        for j in range(1, p):
            src = (r - j) % p
            arrival = attn[src] + j * send + cm.wire(src, r, n)
            now = max(now, arrival) + recv + merge
        end = max(end, now)
    return end


def _ring_pairs(cm: CostModel) -> tuple[np.ndarray, np.ndarray]:
    ranks = np.arange(cm.world)
    return (ranks - 1) % cm.world, ranks


def ring(cm: CostModel) -> float:
    p, w = cm.world, cm.workload
    shards = np.asarray(cm.shards)
    kv = np.array([w.kv_bytes(int(n)) for n in shards], dtype=float)
    att = np.array([w.attention_bytes(int(n)) for n in shards], dtype=float)
    fl = 4.0 * w.batch * w.model.n_heads * w.model.head_dim * shards
    merge = cm.compute_vec(3 * w.partial_bytes)
    prv, ranks = _ring_pairs(cm)
    inv_min = cm.pair_summary(prv, ranks, float(kv.max()))[:, 1]
    t = np.zeros(p)
    last_arrival = np.full(p, -np.inf)
    for i in range(p - 1):
        held = (ranks - i) % p
        work = cm.compute_vec(att[held], fl[held]) + (merge if i else 0.0)
        size = kv[(prv - i) % p]
        sent = t + cm.send_vec(kv[(ranks - i) % p])
        arrival = np.maximum(sent[prv] + cm.wire_vec(prv, ranks, size),
                             last_arrival + size * inv_min)
        last_arrival = arrival
        t = np.maximum(sent + work, arrival) + cm.send_vec(size, recv=True)
    last = (ranks + 1) % p
    return float(np.max(t + cm.compute_vec(att[last], fl[last]) + merge))


def ring_allreduce(cm: CostModel, start, payload: str, op_merge: bool = True) -> np.ndarray:
    p = cm.world
    sizes = np.array(cm.workload.chunk_bytes(payload, p), dtype=float)
    prv, ranks = _ring_pairs(cm)
    t = np.asarray(start, dtype=float)
    for replace in (False, True):
        for s in range(p - 1):
            send_c = (ranks + int(replace) - s) % p
            recv_c = (ranks - s - (0 if replace else 1)) % p
            sent = t + cm.send_vec(sizes[send_c])
            arrival = sent[prv] + cm.wire_vec(prv, ranks, sizes[send_c[prv]])
            t = np.maximum(sent, arrival) + cm.send_vec(sizes[send_c[prv]], recv=True)
            if not replace:
                t = t + cm.compute_vec(3 * sizes[recv_c])
    return t


def allreduce3(cm: CostModel, inner: str, trees: list[Tree]) -> float:
    w = cm.workload
    pb, mx, num = w.partial_bytes, w.max_bytes, w.num_bytes
    t = cm.attention_vec() + cm.compute_vec(pb + mx)

    def allreduce(start, payload):
        if inner == "ring":
            return ring_allreduce(cm, start, payload)
        return np.asarray(tree_allreduce(cm, start, trees, payload))

    t = allreduce(t, "max") + cm.compute_vec(pb + 3 * mx + num)
    t = allreduce(allreduce(t, "num"), "den")
    return float(np.max(t + cm.compute_vec(num + mx + pb + mx)))


def closed_form(algorithm: str, cm: CostModel, trees: list[Tree] | None = None,
                inner: str = "tree") -> float:
    """Uncontended latency of one decode step of attention (see the module docstring)."""
    if algorithm == "tree":
        return tree(cm, trees)
    if algorithm == "butterfly":
        return butterfly(cm)
    if algorithm == "allgather":
        return allgather(cm)
    if algorithm == "ring":
        return ring(cm)
    return allreduce3(cm, inner, trees or [])


def ring_passq(cm: CostModel, schedule) -> float:
    """Pass-Q: the ring loop of query blocks, then the collective tail of ``schedule``.

    Rank r's step ``j + 1`` starts at ``max(S_r(j) + send + attend_r(j), A_r(j)) + recv``
    with the block arriving at ``A_r(j) = max(S_{r−1}(j) + send + wire(qblock),
    A_r(j−1) + qblock / β_min)`` (as for ring, with the attention of step ``j``'s real
    query slots over the own shard instead of a foreign block); then the all-to-all, merge,
    gather and placement as
    :func:`collective_schedule` resolves them (exact for that part).
    """
    from treeattn.schedule.ir import Collective, Compute
    from treeattn.schedule.payloads import ComputeLabel, Payload

    p = cm.world
    attends = [[s for s in steps if isinstance(s, Compute)
                and s.label == ComputeLabel.ATTENTION_QBLOCK] for steps in schedule.steps]
    work = np.array([[cm.compute(r, s.nbytes, s.flops) for s in attends[r]]
                     for r in range(p)])  # (rank, step): the real slots of that step's origin
    qb = float(cm.workload.buffer_bytes(Payload.QBLOCK, p))
    prv, ranks = _ring_pairs(cm)
    inv_min = cm.pair_summary(prv, ranks, qb)[:, 1]
    t, last_arrival = np.zeros(p), np.full(p, -np.inf)
    for j in range(p - 1):
        sent = t + cm.send_cost(qb)
        arrival = np.maximum(sent[prv] + cm.wire_vec(prv, ranks, qb), last_arrival + qb * inv_min)
        last_arrival = arrival
        t = np.maximum(sent + work[:, j], arrival) + cm.recv_cost(qb)
    tails = [steps[next(i for i, s in enumerate(steps) if isinstance(s, Collective)):]
             for steps in schedule.steps]
    return collective_steps(cm, tails, list(t + work[:, p - 1]))


def collective_schedule(cm: CostModel, schedule) -> float:
    """Exact latency of a schedule made of local steps and collectives only.

    Each rank's clock advances by its compute steps; a collective starts when its last
    member arrives and lasts :meth:`CostModel.collective_time`. The engine does the same,
    so for these schedules the bound is the prediction. Linear in the number of steps: a
    collective is resolved once, when its last member reaches it.
    """
    return collective_steps(cm, schedule.steps, [0.0] * schedule.world)


def collective_steps(cm: CostModel, rank_steps: list[list], clock: list[float]) -> float:
    """:func:`collective_schedule` of per-rank step lists from per-rank start times."""
    from treeattn.schedule.ir import Collective, Compute, Merge
    from treeattn.schedule.payloads import GroupIds

    world = len(rank_steps)
    clock, pc = list(clock), [0] * world
    calls: dict[tuple, list[int]] = {}  # (group id, k-th call) -> members waiting at it
    seen: dict[tuple, int] = {}  # (rank, group id) -> collectives of the group reached
    group_id = GroupIds()
    ready = list(range(world))
    while ready:
        r = ready.pop()
        steps = rank_steps[r]
        while pc[r] < len(steps):
            step = steps[pc[r]]
            if isinstance(step, Compute | Merge):
                flops = step.flops if isinstance(step, Compute) else 0
                clock[r] += cm.compute(r, step.nbytes, flops)
            elif isinstance(step, Collective):
                g = group_id(step.group)
                k = seen.get((r, g), 0)
                seen[(r, g)] = k + 1
                waiting = calls.setdefault((g, k), [])
                waiting.append(r)
                if len(waiting) < len(step.group):
                    break  # the last member to arrive resolves it for everyone
                end = max(clock[m] for m in waiting) + cm.collective_time(
                    step.op, step.group, step.nbytes)
                for m in waiting:
                    clock[m] = end
                    pc[m] += 1
                    if m != r:
                        ready.append(m)
                del calls[(g, k)]
                continue
            else:
                raise ValueError("collective_schedule: point-to-point steps present")
            pc[r] += 1
    return max(clock)

