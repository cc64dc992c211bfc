"""The peak-memory model: what one rank of a schedule holds at its fullest moment.

Per rank (:func:`peak_memory`): the KV shard plus what the algorithm keeps
alive. What is counted, walking a rank's steps in order (the peak over all points):

* its own KV shard (the cache), always; ``"kv"`` starts as an alias of it (no extra bytes);
* the payload buffers once set: ``partial`` (by ``attention``), ``max`` (``init_max``),
  ``num`` and ``den`` (``rescale``), ``residue`` (its first Merge), ``outbox`` (its first
  ``attention_qblock``; pass-Q's ``qblock`` by its first Recv, the own block being a view
  of the replicated query), or by a replacing Recv
  (a chunked replace counts the whole buffer once). A replacing Recv of ``"kv"`` makes
  ``"kv"`` a separate block of the received size (the previous foreign block is freed at
  that moment);
* the block partial of an ``attention_block`` until its ``Merge(tag=None)``;
* a message received with ``reduce=True`` until the Merge of its tag;
* the one receive posted ahead: the runtime posts a rank's next receive as soon as the
  previous one completed (the first at the start), so its buffer is live from then until
  it completes.

Send buffers are not counted: a send reads the buffer in place, and a replacing Recv
allocates a fresh tensor instead of overwriting it. Ring therefore peaks at
``shard + current block + incoming block (+ partials)``, and tree at ``shard + partials``.
"""

from __future__ import annotations

from treeattn.schedule.ir import Collective, Compute, Merge, Recv, Schedule
from treeattn.schedule.payloads import COMPUTE_SETS, ComputeLabel, MergeOp, Payload
from treeattn.schedule.workload import DecodeWorkload


def _set_by_compute(label: str, workload: DecodeWorkload, world: int) -> dict[str, int]:
    return {p: workload.buffer_bytes(p, world) for p in COMPUTE_SETS[ComputeLabel(label)]}


def rank_peak(steps, shard_bytes: int, workload: DecodeWorkload, world: int = 1) -> int:
    """Peak bytes of one rank's schedule of ``world`` ranks (see the module docstring)."""
    recvs = [i for i, s in enumerate(steps) if isinstance(s, Recv)]
    posted = steps[recvs[0]].nbytes if recvs else 0
    next_recv = 1
    named: dict[str, int] = {}
    kept: dict[int, int] = {}
    block = 0
    peak = shard_bytes + posted
    for s in steps:
        if isinstance(s, Compute):
            named.update(_set_by_compute(s.label, workload, world))
            if s.label == ComputeLabel.ATTENTION_BLOCK:
                block = workload.partial_bytes
        elif isinstance(s, Recv):
            if s.reduce:
                kept[s.tag] = s.nbytes
            elif s.payload == Payload.KV:
                named[Payload.KV] = s.nbytes
            else:
                full = s.nbytes if s.chunk is None else workload.buffer_bytes(s.payload, world)
                named[s.payload] = max(named.get(s.payload, 0), full)
            posted = steps[recvs[next_recv]].nbytes if next_recv < len(recvs) else 0
            next_recv += 1
        elif isinstance(s, Collective):
            if s.keeps_messages:  # the other members' contributions, until the Merge
                kept[s.tag] = int(s.nbytes * (len(s.group) - 1) / len(s.group))
            else:
                named[s.payload] = workload.buffer_bytes(s.payload, world)
        elif isinstance(s, Merge):
            if s.op == MergeOp.RESIDUE:
                named[Payload.RESIDUE] = workload.partial_bytes
            if s.tag is None and s.op == MergeOp.PARTIAL:
                block = 0
            elif s.tag is not None:
                kept.pop(s.tag, None)
        live = shard_bytes + sum(named.values()) + sum(kept.values()) + posted + block
        peak = max(peak, live)
    return peak


def peak_memory(schedule: Schedule, workload: DecodeWorkload) -> list[int]:
    """Peak bytes per rank for ``schedule`` on ``workload``'s shards."""
    shards = workload.shards(schedule.world)
    return [rank_peak(steps, workload.kv_bytes(shards[r]), workload, schedule.world)
            for r, steps in enumerate(schedule.steps)]
