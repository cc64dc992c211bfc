"""``butterfly``: recursive doubling with the partial merge; every rank ends with the result.

With ``q = 2^⌊log2 p⌋`` and ``e = p − q`` extra ranks (MPICH's rule for p not a power of two):

1. fold in: extra rank ``q + i`` sends its partial to rank ``i``, which merges it;
2. ``log2 q`` rounds: rank ``r < q`` exchanges with ``r XOR 2^k`` and merges;
3. fold out: rank ``i`` sends the result to rank ``q + i`` (replace).

A power of two takes ``log2 p`` exchange rounds; otherwise ``⌊log2 p⌋`` rounds plus the two
one-way fold steps.
"""

from __future__ import annotations

from treeattn.sim.alg_common import Tags, local_attention
from treeattn.sim.schedule import Merge, Recv, Schedule, Send
from treeattn.sim.workload import DecodeWorkload


def build_butterfly(topology, workload: DecodeWorkload) -> Schedule:
    world = topology.num_gpus
    shards = workload.shards(world)
    n = workload.partial_bytes
    tags = Tags()
    steps = [[local_attention(workload, shards[r])] for r in range(world)]
    q = 1 << (world.bit_length() - 1)
    for r in range(q, world):
        tag = tags(r, r - q)
        steps[r].append(Send(r - q, n, tag))
        steps[r - q] += [Recv(r, n, tag), Merge(3 * n, "partial", tag)]
    rounds = q.bit_length() - 1
    for k in range(rounds):
        out = [tags(r, r ^ (1 << k)) for r in range(q)]
        for r in range(q):
            partner = r ^ (1 << k)
            steps[r] += [Send(partner, n, out[r]), Recv(partner, n, out[partner]),
                         Merge(3 * n, "partial", out[partner])]
    for r in range(q, world):
        tag = tags(r - q, r)
        steps[r - q].append(Send(r, n, tag))
        steps[r].append(Recv(r - q, n, tag, reduce=False))
    return Schedule("butterfly", steps, {"rounds": rounds, "extra": world - q})
