"""``allreduce3`` and ``allreduce2``: the paper's all-reduces instead of one merge tree.

Per rank::

    Compute("attention"); Compute("init_max")        # max = lse
    all-reduce "max" with op "max"
    Compute("rescale")                               # den = exp(lse − max), num = o · den
    all-reduce "num" with op "sum"; all-reduce "den" with op "sum"
    Compute("finalize")                              # o = num / den, lse = max + log den

By default (``inner="collective"``) each all-reduce is one library collective over all
ranks, as the paper's reference code runs it (``torch.distributed.all_reduce``; NCCL picks
ring, tree or NVLS). The p2p variants build it from sends instead: a tree
(``inner="tree"``: reduce up then broadcast down a tree of ``shape``, default binomial
rooted at 0) or a ring (``inner="ring"``: reduce-scatter then
all-gather, ``p − 1`` steps each, on ``p`` slices of the flat buffer). In the ring,
reduce-scatter step ``s`` sends slice ``(r − s) mod p`` to ``r+1`` and merges slice
``(r − s − 1) mod p`` from ``r−1``; rank ``r`` then owns slice ``(r + 1) mod p``, and
all-gather step ``s`` sends slice ``(r + 1 − s) mod p`` and receives slice ``(r − s) mod p``.

``allreduce2`` packs ``num`` and ``den`` into one buffer (``"numden"``) so that two
collectives do the work of three: the max, then one sum.
"""

from __future__ import annotations

from treeattn.schedule.algorithms.tree import allreduce_phase, make_trees
from treeattn.schedule.ir import Collective, Compute, Merge, Recv, Schedule, Send, Tags
from treeattn.schedule.payloads import CollectiveOp, ComputeLabel, MergeOp, Payload, SimError
from treeattn.schedule.workload import DecodeWorkload


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


INNER = ("collective", "tree", "ring")
_REDUCE = {MergeOp.MAX: CollectiveOp.ALL_REDUCE_MAX, MergeOp.SUM: CollectiveOp.ALL_REDUCE_SUM}


def all_reduce_everywhere(steps, workload: DecodeWorkload, payload: str, op: str) -> None:
    """Append one all-reduce collective of ``payload`` over every rank."""
    call = Collective(_REDUCE[MergeOp(op)], tuple(range(len(steps))),
                      workload.buffer_bytes(payload), payload)
    for rank_steps in steps:
        rank_steps.append(call)


def build_allreduce3(topology, workload: DecodeWorkload, inner: str = "collective",
                     shape: str = "binomial", root: int = 0, k: int = 4) -> Schedule:
    if inner not in INNER:
        raise SimError(f"allreduce3 inner must be one of {', '.join(INNER)}, got {inner!r}")
    world = topology.num_gpus
    shards = workload.shards(world)
    mx, num = workload.max_bytes, workload.num_bytes
    pb = workload.partial_bytes
    steps = [[workload.attention_step(shards[r]), Compute(ComputeLabel.INIT_MAX, pb + mx)]
             for r in range(world)]
    tags = Tags()
    trees = make_trees(topology, shape, root, k) if inner == "tree" else []

    def allreduce(payload: str, op: str) -> None:
        if inner == "collective":
            all_reduce_everywhere(steps, workload, payload, op)
        elif inner == "ring":
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


def build_allreduce2(topology, workload: DecodeWorkload) -> Schedule:
    """All-reduce the max, then one all-reduce of ``num`` and ``den`` packed together."""
    world = topology.num_gpus
    shards = workload.shards(world)
    mx, pb = workload.max_bytes, workload.partial_bytes
    steps = [[workload.attention_step(shards[r]), Compute(ComputeLabel.INIT_MAX, pb + mx)]
             for r in range(world)]
    all_reduce_everywhere(steps, workload, Payload.MAX, MergeOp.MAX)
    for r in range(world):
        steps[r].append(Compute(ComputeLabel.RESCALE_PACKED, 2 * pb + mx))
    all_reduce_everywhere(steps, workload, Payload.NUMDEN, MergeOp.SUM)
    for r in range(world):
        steps[r].append(Compute(ComputeLabel.FINALIZE_PACKED, 2 * pb + mx))
    return Schedule("allreduce2", steps, {})
