"""``butterfly``: recursive doubling with the partial merge; every rank ends with the result
after ``⌈log2 p⌉`` exchange rounds, whatever ``p``.

p a power of two: ``log2 p`` rounds; in round ``k`` rank ``r`` exchanges its running partial
with ``r XOR 2^k`` and merges.

Any other p (``K = ⌊log2 p⌋``, ``m = p − 2^K``, so ``0 < m < 2^K``): cyclic recursive
doubling that never counts a rank twice (the merge is not idempotent). Ranges are cyclic:
``[a, b)`` means the ranks ``a, a+1, …, b−1`` mod p, and ``⊕`` is the partial merge. Rank
``r`` keeps two running partials:

* ``P`` (payload ``partial``) = ``[r, r + 2^j)`` after ``j`` rounds;
* ``S`` (payload ``residue``) = ``[r, r + (m mod 2^j))``, the low ``j`` bits of ``m``.

Round ``j < K``: ``r`` sends ``P`` (and ``S`` when bit ``j`` of ``m`` is set and ``S`` is not
empty) to ``r − 2^j`` and receives the same from ``r + 2^j``. If bit ``j`` is set,
``S ← P ⊕ S(r + 2^j)`` (with the *old* ``P``: ``[r, r+2^j) ⊕ [r+2^j, r+2^j+(m mod 2^j))``);
then ``P ← P ⊕ P(r + 2^j)``. Round ``K``: ``r`` receives ``S(r + 2^K) = [r+2^K, r+p)`` and
``P ⊕`` it is ``[r, r+p)``: every rank once. That is ``K + 1 = ⌈log2 p⌉`` rounds; rounds
where bit ``j`` is set carry two partials.

>>> from treeattn.topo import Topology
>>> from treeattn.schedule.workload import DecodeWorkload
>>> s = build_butterfly(Topology.from_spec("local:ranks=7"), DecodeWorkload("debug", 14))
>>> s.params["rounds"], sum(1 for x in s.steps[0] if type(x).__name__ == "Send")
(3, 4)
"""

from __future__ import annotations

from treeattn.schedule.ir import Merge, Recv, Schedule, Send, Step, Tags
from treeattn.schedule.payloads import MergeOp, Payload
from treeattn.schedule.workload import DecodeWorkload


def build_butterfly(topology, workload: DecodeWorkload) -> Schedule:
    world = topology.num_gpus
    shards = workload.shards(world)
    steps = [[workload.attention_step(shards[r])] for r in range(world)]
    if world & (world - 1) == 0:
        rounds = _xor_rounds(steps, workload.partial_bytes)
    else:
        rounds = _cyclic_rounds(steps, workload.partial_bytes)
    return Schedule("butterfly", steps, {"rounds": rounds})


def _xor_rounds(steps: list[list[Step]], n: int) -> int:
    world, tags = len(steps), Tags()
    rounds = world.bit_length() - 1
    for k in range(rounds):
        out = [tags(r, r ^ (1 << k)) for r in range(world)]
        for r in range(world):
            partner = r ^ (1 << k)
            steps[r] += [Send(partner, n, out[r]), Recv(partner, n, out[partner]),
                         Merge(3 * n, MergeOp.PARTIAL, out[partner])]
    return rounds


def _cyclic_rounds(steps: list[list[Step]], n: int) -> int:
    # Why a second partial: with p not a power of two the plain XOR exchange would pair a rank
    # with a non-existent partner, and wrapping distances cyclically makes the last round
    # overlap ranges already merged. The log-sum-exp merge is not idempotent (a rank counted
    # twice skews the softmax), so each rank also carries S, the exact range of the p − 2^K
    # extra ranks it still owes, built bit by bit of m, and closes the cycle with it at the end.
    world, tags = len(steps), Tags()
    top = world.bit_length() - 1  # K
    residue = world - (1 << top)  # m
    for j in range(top):
        dist = 1 << j
        grows = bool(residue >> j & 1)  # S takes P ⊕ S(r + 2^j) this round
        ships = grows and residue % dist != 0  # S(r + 2^j) is not empty, so it travels
        p_tag = [tags(r, (r - dist) % world) for r in range(world)]
        s_tag = [tags(r, (r - dist) % world) for r in range(world)] if ships else None
        for r in range(world):
            dst, src = (r - dist) % world, (r + dist) % world
            # Both sends go before the receives: sends never block, so every rank posts before
            # it waits and the round cannot deadlock.
            steps[r].append(Send(dst, n, p_tag[r]))
            if ships:
                steps[r].append(Send(dst, n, s_tag[r], payload=Payload.RESIDUE))
            steps[r].append(Recv(src, n, p_tag[src]))
            if ships:
                steps[r].append(Recv(src, n, s_tag[src], payload=Payload.RESIDUE))
            if grows:  # before P grows: S needs the *old* P = [r, r + 2^j)
                steps[r].append(Merge(3 * n, MergeOp.RESIDUE, s_tag[src] if ships else None))
            steps[r].append(Merge(3 * n, MergeOp.PARTIAL, p_tag[src]))
    # Final round: S(r + 2^K) = [r + 2^K, r + p) is exactly what P = [r, r + 2^K) lacks.
    dist = 1 << top
    f_tag = [tags(r, (r - dist) % world) for r in range(world)]
    for r in range(world):
        dst, src = (r - dist) % world, (r + dist) % world
        steps[r] += [Send(dst, n, f_tag[r], payload=Payload.RESIDUE),
                     Recv(src, n, f_tag[src], payload=Payload.RESIDUE),
                     Merge(3 * n, MergeOp.PARTIAL, f_tag[src])]
    return top + 1
