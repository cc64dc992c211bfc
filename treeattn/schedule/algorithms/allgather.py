"""``allgather``: every rank sends its partial to every other, then merges all it received.

Rank ``r`` posts its ``p − 1`` sends to ``r+1, r+2, …`` (rotated so no rank is everyone's
first target), then receives from ``r−1, r−2, …`` and merges each. One round trip of latency,
``p − 1`` messages per rank: good on a full mesh, poor at scale.
"""

from __future__ import annotations

from treeattn.schedule.ir import Merge, Recv, Schedule, Send
from treeattn.schedule.payloads import MergeOp
from treeattn.schedule.workload import DecodeWorkload


def build_allgather(topology, workload: DecodeWorkload) -> Schedule:
    world = topology.num_gpus
    shards = workload.shards(world)
    n = workload.partial_bytes
    steps = []
    for r in range(world):
        rank_steps = [workload.attention_step(shards[r])]
        rank_steps += [Send((r + j) % world, n, 0) for j in range(1, world)]
        for j in range(1, world):
            src = (r - j) % world
            rank_steps += [Recv(src, n, 0), Merge(3 * n, MergeOp.PARTIAL, 0)]
        steps.append(rank_steps)
    return Schedule("allgather", steps, {})
