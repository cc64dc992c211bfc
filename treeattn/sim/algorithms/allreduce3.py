"""``allreduce3``: the paper's implementation, three all-reduces instead of one merge tree.

Per rank::

    Compute("attention"); Compute("init_max")        # max = lse
    all-reduce "max" with op "max"
    Compute("rescale")                               # den = exp(lse − max), num = o · den
    all-reduce "num" with op "sum"; all-reduce "den" with op "sum"
    Compute("finalize")                              # o = num / den, lse = max + log den

Each all-reduce is a tree (``inner="tree"``: reduce up then broadcast down a tree of
``shape``, default binomial rooted at 0) or a ring (``inner="ring"``: reduce-scatter then
all-gather, ``p − 1`` steps each, on ``p`` slices of the flat buffer). In the ring,
reduce-scatter step ``s`` sends slice ``(r − s) mod p`` to ``r+1`` and merges slice
``(r − s − 1) mod p`` from ``r−1``; rank ``r`` then owns slice ``(r + 1) mod p``, and
all-gather step ``s`` sends slice ``(r + 1 − s) mod p`` and receives slice ``(r − s) mod p``.
"""

from __future__ import annotations

from treeattn.sim.algorithms.tree import allreduce_phase, make_trees
from treeattn.sim.schedule import (
    Compute,
    ComputeLabel,
    Merge,
    MergeOp,
    Payload,
    Recv,
    Schedule,
    Send,
    SimError,
    Tags,
)
from treeattn.sim.workload import DecodeWorkload


def ring_allreduce_phase(steps, workload: DecodeWorkload, tags: Tags, payload: str,
                         op: str) -> None:
    world = len(steps)
    sizes = workload.chunk_bytes(payload, world)
    for replace in (False, True):
        for s in range(world - 1):
            out = [tags(r, (r + 1) % world) for r in range(world)]
            for r in range(world):
                prv = (r - 1) % world
                send_c = (r + int(replace) - s) % world
                recv_c = (r - s - (0 if replace else 1)) % world
                chunk = (recv_c, world)
                steps[r].append(Send((r + 1) % world, sizes[send_c], out[r], payload,
                                     (send_c, world)))
                steps[r].append(Recv(prv, sizes[recv_c], out[prv], payload, chunk,
                                     reduce=not replace))
                if not replace:
                    steps[r].append(Merge(3 * sizes[recv_c], op, out[prv]))


def build_allreduce3(topology, workload: DecodeWorkload, inner: str = "tree",
                     shape: str = "binomial", root: int = 0, k: int = 4) -> Schedule:
    if inner not in ("tree", "ring"):
        raise SimError(f"allreduce3 inner must be 'tree' or 'ring', got {inner!r}")
    world = topology.num_gpus
    shards = workload.shards(world)
    mx, num = workload.max_bytes, workload.num_bytes
    pb = workload.partial_bytes
    steps = [[workload.attention_step(shards[r]), Compute(ComputeLabel.INIT_MAX, pb + mx)]
             for r in range(world)]
    tags = Tags()
    trees = make_trees(topology, shape, root, k) if inner == "tree" else []

    def allreduce(payload: str, op: str) -> None:
        if inner == "ring":
            ring_allreduce_phase(steps, workload, tags, payload, op)
        else:
            allreduce_phase(steps, trees, workload, tags, payload, op)

    allreduce(Payload.MAX, MergeOp.MAX)
    for r in range(world):
        steps[r].append(Compute(ComputeLabel.RESCALE, pb + 3 * mx + num))
    allreduce(Payload.NUM, MergeOp.SUM)
    allreduce(Payload.DEN, MergeOp.SUM)
    for r in range(world):
        steps[r].append(Compute(ComputeLabel.FINALIZE, num + mx + pb + mx))
    params = {"inner": inner}
    if trees:
        params.update(shape=trees[0].shape, root=trees[0].root, parent=list(trees[0].parent))
    return Schedule("allreduce3", steps, params)
