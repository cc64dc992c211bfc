"""``ring-passq``: Meta's batched ring pass-Q decode (context parallelism for inference).

"Context Parallelism for Scalable Million-Token Inference" (arXiv 2411.01783), Alg. 4. The
``B`` decode queries (one per sequence) are dealt round-robin over the ``p`` ranks: rank
``k`` owns ``Bq = ceil(B / p)`` query slots, query ``b = i·p + k`` in slot ``i``, padded with
dummy queries when ``p`` does not divide ``B`` (always when ``B < p``). Each sequence's KV
stays sharded along the sequence. The *queries* travel, not the KV::

    for j in 0 … p−1:                         # rank k holds the block of origin (k − j) mod p
        if j < p−1: Send(k+1, qblock, tag=j)
        Compute("attention_qblock")            # Bq queries over the own KV shard -> outbox
        if j < p−1: Recv(k−1, qblock, tag=j, reduce=False)
    Collective(all_to_all, outbox)             # partial of origin s goes to rank s
    Merge("partial", tag)                      # owner merges the p partials of its queries
    Collective(all_gather, outbox, sharded)    # replicate: every rank gets every origin slot
    Compute("place_rows")                      # (B, Hq, D) partial from the slots, dummies dropped

Why it costs what it costs: step ``j`` attends the real queries of origin ``(k − j) mod p``
(slots ``i`` with ``i·p + origin < B``) over the own KV shard of their sequences; padding
slots are skipped, as a batched decode kernel over the real rows would (a block with no
real query only pays its step's launch). Over ``p`` steps a rank so reads each of the ``B``
sequences' shards once, like every other algorithm. The block still rotates whole (it is
``Bq`` slots whatever their content), sent before the step's attention and received after
it, so the rotation overlaps the attention exactly as pass-KV's does (``ring``). The
messages are small (a query block), which is why the paper uses it for decode. Modelled:
the paper's Alg. 4, batched ring pass-Q for decode (not its pass-KV prefill, nor the
pass-Q prefill variant of its Alg. 3).

The natural output is batch-sharded (each owner holds its queries' outputs); treeattn's
layers run replicated, and a head-sharded consumer cannot use batch shards either, so the
schedule always ends with the gather a practitioner would add: an all-gather of each
owner's merged slot (``p·Bq`` rows, what the outbox holds) and a local placement. The output
is therefore replicated whatever ``DecodeWorkload.layout`` asks.
"""

from __future__ import annotations

from treeattn.schedule.ir import Collective, Compute, Merge, Recv, Schedule, Send, Tags
from treeattn.schedule.payloads import CollectiveOp, ComputeLabel, MergeOp, Payload
from treeattn.schedule.workload import DecodeWorkload


def build_ring_passq(topology, workload: DecodeWorkload) -> Schedule:
    """The pass-Q ring over the own KV shard, the all-to-all home, and the replication."""
    world = topology.num_gpus
    shards = workload.shards(world)
    group = tuple(range(world))
    qb = workload.buffer_bytes(Payload.QBLOCK, world)
    outbox = workload.buffer_bytes(Payload.OUTBOX, world)
    slot = outbox // world
    tags = Tags()
    home_tag = tags.collective()
    home = Collective(CollectiveOp.ALL_TO_ALL, group, outbox, Payload.OUTBOX, tag=home_tag)
    merge = Merge(3 * slot * (world - 1), MergeOp.PARTIAL, home_tag)
    gather = Collective(CollectiveOp.ALL_GATHER, group, outbox, Payload.OUTBOX, sharded=True)
    place = Compute(ComputeLabel.PLACE_ROWS, outbox + workload.partial_bytes)
    steps = []
    for k in range(world):
        nxt, prv = (k + 1) % world, (k - 1) % world
        rank_steps = []
        for j in range(world):
            last = j == world - 1
            if not last:
                rank_steps.append(Send(nxt, qb, j, Payload.QBLOCK))
            # the held block is origin (k - j)'s: only its real query slots are attended
            rank_steps.append(workload.qblock_attention_step(shards[k], world, (k - j) % world))
            if not last:
                rank_steps.append(Recv(prv, qb, j, Payload.QBLOCK, reduce=False))
        rank_steps += [home, merge, gather, place]
        steps.append(rank_steps)
    params = {"query_slots": workload.dims(world=world)["Bq"], "gathered_rows": True}
    return Schedule("ring-passq", steps, params, "replicated")
