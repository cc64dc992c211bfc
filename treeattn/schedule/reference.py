"""A numpy reference executor of the schedule IR: the clearest statement of its semantics.

It runs a :class:`~treeattn.schedule.ir.Schedule` with real arrays, following the semantics
in :mod:`treeattn.schedule.ir` to the letter (sends snapshot, receives replace or wait for a
Merge, chunks are :func:`~treeattn.schedule.ir.shard_bounds` slices, and a payload whose
layout has ``chunk_axis="Hq"`` is sliced along the head axis), so the tests can check that
every generator leaves softmax attention over the whole sequence on every rank. Numpy only:
the torch executor in :mod:`treeattn.runtime.executor` is checked against the same semantics.
Arrays drop the batch axis: ``q`` is (H, D), a KV shard is ``(k, v)`` of (n, H, D) each.

>>> import numpy as np
>>> from treeattn.topo import Topology
>>> from treeattn.sim import DecodeWorkload, build_schedule
>>> rng = np.random.default_rng(0)
>>> q, k, v = rng.normal(size=(4, 16)), rng.normal(size=(8, 4, 16)), rng.normal(size=(8, 4, 16))
>>> s = build_schedule("butterfly", Topology.from_spec("local:ranks=3"), DecodeWorkload("debug", 8))
>>> shards = [(k[a:b], v[a:b]) for a, b in shard_bounds(8, 3)]
>>> o, lse = execute(s, q, shards)[2]
>>> bool(np.allclose(o, full_attention(q, k, v)[0]))
True
"""

from __future__ import annotations

import numpy as np

from treeattn.schedule.ir import Collective, Compute, Merge, Recv, Schedule, Send
from treeattn.schedule.payloads import (
    PAYLOAD_LAYOUTS,
    CollectiveOp,
    ComputeLabel,
    MergeOp,
    Payload,
    shard_bounds,
)


def partial(q, k, v):
    """(o, lse) of one query over one block. q (H, D), k/v (n, H, D) -> o (H, D), lse (H,)."""
    if k.shape[0] == 0:
        return np.zeros_like(q), np.full(q.shape[0], -np.inf)
    s = np.einsum("hd,nhd->hn", q, k) / np.sqrt(q.shape[1])  # (H, n)
    m = s.max(axis=1, keepdims=True)
    lse = (m + np.log(np.exp(s - m).sum(axis=1, keepdims=True)))[:, 0]  # (H,)
    p = np.exp(s - lse[:, None])
    return np.einsum("hn,nhd->hd", p, v), lse


def merge(a, b):
    """The log-sum-exp merge of two partials (an empty one, lse = -inf, is the identity)."""
    (oa, la), (ob, lb) = a, b
    lse = np.logaddexp(la, lb)
    with np.errstate(invalid="ignore"):
        wa = np.where(np.isneginf(la), 0.0, np.exp(la - lse))
        wb = np.where(np.isneginf(lb), 0.0, np.exp(lb - lse))
    return oa * wa[..., None] + ob * wb[..., None], lse


def round_bf16(x):
    """``x`` rounded to the nearest bfloat16 (ties to even) through fp32, as torch rounds a
    float32 tensor: what a bf16 wire carries, returned as float64."""
    f = np.asarray(x, dtype=np.float32)
    bits = f.view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    out = bits.astype(np.uint32).view(np.float32)
    return np.where(np.isfinite(f), out, f).astype(np.float64)


def _round_sent(buffers, payload, chunk, partial_dtype: str) -> None:
    """Round the ``o`` a Send of ``chunk`` (a collective: ``None``) moves to the wire format,
    in the sender's own buffer (see :mod:`treeattn.schedule.ir`)."""
    if partial_dtype == "fp32" or not PAYLOAD_LAYOUTS[Payload(payload)].wire:
        return
    o, lse = buffers[payload]
    s = _slices(o.shape[0], chunk if _by_heads(payload) else None)
    o = o.copy()
    o[s] = round_bf16(o[s])
    buffers[payload] = (o, lse)


def full_attention(q, k, v):
    """What every rank must end with: attention over the whole sequence."""
    return partial(q, k, v)


def _slices(n: int, chunk):
    if chunk is None:
        return slice(0, n)
    index, count = chunk
    return slice(*shard_bounds(n, count)[index])


def _by_heads(payload) -> bool:
    return PAYLOAD_LAYOUTS[Payload(payload)].chunk_axis == "Hq"


def _get(buf, payload, chunk):
    if _by_heads(payload):
        o, lse = buf
        s = _slices(o.shape[0], chunk)
        return o[s].copy(), lse[s].copy()
    if payload == Payload.KV:
        return buf
    flat = buf.reshape(-1)
    return flat[_slices(flat.size, chunk)].copy()


def _put(buffers, payload, chunk, value):
    if _by_heads(payload):
        o, lse = buffers[payload]
        s = _slices(o.shape[0], chunk)
        o, lse = o.copy(), lse.copy()
        o[s], lse[s] = value
        buffers[payload] = (o, lse)
    elif payload == Payload.KV:
        buffers[payload] = value
    else:
        flat = buffers[payload].reshape(-1).copy()
        flat[_slices(flat.size, chunk)] = value
        buffers[payload] = flat.reshape(buffers[payload].shape)


def _fold(buffers, op, recv: Recv, value):
    if op == MergeOp.PARTIAL:
        mine = _get(buffers[Payload.PARTIAL], Payload.PARTIAL, recv.chunk)
        _put(buffers, Payload.PARTIAL, recv.chunk, merge(mine, value))
        return
    mine = _get(buffers[recv.payload], recv.payload, recv.chunk)
    _put(buffers, recv.payload, recv.chunk, _combine(op, mine, value))


def _combine(op, a, b):
    """Elementwise max, sum or log-sum-exp of two equally shaped arrays."""
    if op == MergeOp.MAX:
        return np.maximum(a, b)
    if op == MergeOp.LSE:
        return np.logaddexp(a, b)
    return a + b


# -- collectives: every member's buffers are visible at once (the step is a rendezvous) ----

def _heads(value, index: int, count: int):
    """Chunk ``index`` of ``count`` along the query heads (axis 0 of every array)."""
    s = slice(*shard_bounds(_n_heads(value), count)[index])
    return tuple(a[s].copy() for a in value) if isinstance(value, tuple) else value[s].copy()


def _n_heads(value) -> int:
    return (value[0] if isinstance(value, tuple) else value).shape[0]


def _set_heads(value, index: int, count: int, part):
    s = slice(*shard_bounds(_n_heads(value), count)[index])
    if isinstance(value, tuple):
        out = tuple(a.copy() for a in value)
        for a, b in zip(out, part):
            a[s] = b
        return out
    out = value.copy()
    out[s] = part
    return out


def _reduce(values, op):
    total = values[0]
    for v in values[1:]:
        total = tuple(a + b for a, b in zip(total, v)) if isinstance(total, tuple) else (
            np.maximum(total, v) if op == CollectiveOp.ALL_REDUCE_MAX else total + v)
    return total


def _collective(buffers, kept, step: Collective) -> None:
    """Run one collective on every member at once (semantics in the schedule module)."""
    group, payload, p = step.group, step.payload, len(step.group)
    if payload == Payload.QUERY:
        return  # every rank already holds the whole query: gathering its heads changes nothing
    values = [buffers[m][payload] for m in group]
    for i, member in enumerate(group):
        mine = buffers[member]
        if step.op in (CollectiveOp.ALL_REDUCE_SUM, CollectiveOp.ALL_REDUCE_MAX):
            mine[payload] = _reduce(values, step.op)
        elif step.op == CollectiveOp.BROADCAST:
            mine[payload] = values[group.index(step.root)]
        elif step.op == CollectiveOp.ALL_GATHER and step.sharded:
            out = values[i]
            for j in range(p):
                out = _set_heads(out, j, p, _heads(values[j], j, p))
            mine[payload] = out
        elif step.op == CollectiveOp.ALL_GATHER:
            kept[member][step.tag] = ("all", i, [values[j] for j in range(p) if j != i])
        elif step.op == CollectiveOp.REDUCE_SCATTER:
            part = _reduce([_heads(v, i, p) for v in values], step.op)
            mine[payload] = _set_heads(values[i], i, p, part)
        else:  # all-to-all: the other members' chunk i, folded into my chunk i by the Merge
            kept[member][step.tag] = ("heads", (i, p),
                                      [_heads(values[j], i, p) for j in range(p) if j != i])


def _fold_collective(buffers, op, payload, value) -> None:
    """``Merge(op, tag)`` of what a collective kept: fold each piece in, in group order.

    A gather folds every member's piece, one's own in its place, from the first member on,
    so that every member does the same operations in the same order and the replicas are
    bit-identical whatever the wire format."""
    target = payload  # a gather or all-to-all of partials, or pass-Q's outbox
    if value[0] == "all":
        index, others = value[1], value[2]
        ordered = [*others[:index], buffers[target], *others[index:]]
        folded = ordered[0]
        for piece in ordered[1:]:
            folded = merge(folded, piece) if op == MergeOp.PARTIAL else _combine(op, folded,
                                                                                  piece)
        buffers[target] = folded
        return
    (index, count), pieces = value[1], value[2]
    mine = _heads(buffers[target], index, count)
    for piece in pieces:
        mine = merge(mine, piece) if op == MergeOp.PARTIAL else _combine(op, mine, piece)
    buffers[target] = _set_heads(buffers[target], index, count, mine)


def _compute(buffers, step: Compute, q, shard):
    """Local work; which buffers each label sets is the IR's ``COMPUTE_SETS``."""
    if step.label == ComputeLabel.ATTENTION:
        buffers[Payload.PARTIAL] = partial(q, *shard)
    elif step.label == ComputeLabel.ATTENTION_BLOCK:
        buffers["block"] = partial(q, *buffers[Payload.KV])
    elif step.label == ComputeLabel.INIT_MAX:
        buffers[Payload.MAX] = buffers[Payload.PARTIAL][1].copy()
    elif step.label == ComputeLabel.RESCALE:
        o, lse = buffers[Payload.PARTIAL]
        with np.errstate(invalid="ignore"):
            den = np.where(np.isneginf(lse), 0.0, np.exp(lse - buffers[Payload.MAX]))
        buffers[Payload.DEN], buffers[Payload.NUM] = den, o * den[:, None]
    elif step.label == ComputeLabel.FINALIZE:
        den = buffers[Payload.DEN]
        buffers[Payload.PARTIAL] = (buffers[Payload.NUM] / den[:, None],
                                    buffers[Payload.MAX] + np.log(den))
    elif step.label == ComputeLabel.RESCALE_PACKED:
        o, lse = buffers[Payload.PARTIAL]
        with np.errstate(invalid="ignore"):
            den = np.where(np.isneginf(lse), 0.0, np.exp(lse - buffers[Payload.MAX]))
        buffers[Payload.NUMDEN] = (o * den[:, None], den)
    elif step.label == ComputeLabel.FINALIZE_PACKED:
        num, den = buffers[Payload.NUMDEN]
        buffers[Payload.PARTIAL] = (num / den[:, None], buffers[Payload.MAX] + np.log(den))
    elif step.label == ComputeLabel.FINALIZE_GLOBAL:
        buffers[Payload.PARTIAL] = (buffers[Payload.NUM].copy(), buffers[Payload.MAX].copy())


def _passq(buffers, step: Compute, rank: int, world: int, shard) -> None:
    """ring-passq's two labels with the batch axis dropped (B = 1, so Bq = 1): rank 0's
    block holds the only real query, every other origin a dummy zero query whose partial
    is computed, moved and merged like a real one and dropped by ``place_rows``."""
    o, lse = buffers[Payload.OUTBOX]  # (P, Bq, H, D), (P, Bq, H)
    if step.label == ComputeLabel.PLACE_ROWS:  # query b = i·p + s < B = 1: slot 0, row 0
        buffers[Payload.PARTIAL] = (o[0, 0].copy(), lse[0, 0].copy())
        return
    j = buffers["passq_steps"]
    origin = (rank - j) % world  # the j-th attended block came j hops round the ring
    o, lse = o.copy(), lse.copy()
    for i, row in enumerate(buffers[Payload.QBLOCK]):  # sequence i·p + origin: the only one
        o[origin, i], lse[origin, i] = partial(row, *shard)
    buffers[Payload.OUTBOX], buffers["passq_steps"] = (o, lse), j + 1


def _passq_buffers(rank: int, world: int, q) -> dict:
    """The own query block (origin ``rank``; a dummy zero query but on rank 0) and the
    identity outbox."""
    heads, dim = q.shape
    block = q[None].copy() if rank == 0 else np.zeros((1, heads, dim))  # (Bq, H, D)
    return {Payload.QBLOCK: block, "passq_steps": 0,
            Payload.OUTBOX: (np.zeros((world, 1, heads, dim)),  # (P, Bq, H, D)
                             np.full((world, 1, heads), -np.inf))}  # (P, Bq, H)


def _at(schedule: Schedule, pc: list[int], member: int, step: Collective) -> bool:
    steps = schedule.steps[member]
    return pc[member] < len(steps) and steps[pc[member]] == step


def execute(schedule: Schedule, q, shards) -> list:
    """Run ``schedule``; return each rank's final partial. Sends snapshot; Recv blocks."""
    world = schedule.world
    buffers = [{Payload.KV: shards[r], **_passq_buffers(r, world, q)} for r in range(world)]
    pc, mail, kept = [0] * world, {}, [dict() for _ in range(world)]
    recv_of = [dict() for _ in range(world)]
    merge_payload = [dict() for _ in range(world)]
    progress = True
    while progress:
        progress = False
        for r in range(world):
            steps = schedule.steps[r]
            while pc[r] < len(steps):
                s = steps[pc[r]]
                if isinstance(s, Send):
                    _round_sent(buffers[r], s.payload, s.chunk, schedule.partial_dtype)
                    mail[(r, s.dst, s.tag)] = _get(buffers[r][s.payload], s.payload, s.chunk)
                elif isinstance(s, Recv):
                    key = (s.src, r, s.tag)
                    if key not in mail:
                        break
                    value = mail.pop(key)
                    if s.reduce:
                        kept[r][s.tag], recv_of[r][s.tag] = value, s
                    else:
                        _put(buffers[r], s.payload, s.chunk, value)
                elif isinstance(s, Collective):
                    if not all(_at(schedule, pc, m, s) for m in s.group):
                        break  # a rendezvous: wait until every member stands at it
                    if s.payload != Payload.QUERY:
                        for m in s.group:
                            _round_sent(buffers[m], s.payload, None, schedule.partial_dtype)
                    _collective([buffers[m] for m in range(world)], kept, s)
                    for m in s.group:
                        if s.tag is not None:
                            merge_payload[m][s.tag] = s.payload
                        if m != r:
                            pc[m] += 1
                elif isinstance(s, Merge) and s.tag in merge_payload[r]:
                    _fold_collective(buffers[r], s.op, merge_payload[r].pop(s.tag),
                                     kept[r].pop(s.tag))
                elif isinstance(s, Merge) and s.op == MergeOp.RESIDUE:  # residue = partial (+) msg
                    mine = buffers[r][Payload.PARTIAL]
                    buffers[r][Payload.RESIDUE] = mine if s.tag is None else merge(
                        mine, kept[r].pop(s.tag))
                elif isinstance(s, Merge):
                    if s.tag is None:
                        buffers[r][Payload.PARTIAL] = merge(buffers[r][Payload.PARTIAL],
                                                      buffers[r].pop("block"))
                    else:
                        _fold(buffers[r], s.op, recv_of[r][s.tag], kept[r].pop(s.tag))
                elif s.label in (ComputeLabel.ATTENTION_QBLOCK, ComputeLabel.PLACE_ROWS):
                    _passq(buffers[r], s, r, world, shards[r])
                else:
                    _compute(buffers[r], s, q, shards[r])
                pc[r] += 1
                progress = True
    assert all(pc[r] == len(schedule.steps[r]) for r in range(world)), "deadlock"
    assert not mail, "unreceived messages"
    return [buffers[r][Payload.PARTIAL] for r in range(world)]
