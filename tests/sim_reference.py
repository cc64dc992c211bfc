"""A numpy reference executor of the schedule IR, for tests only.

It runs a Schedule with real tensors, following the semantics in ``treeattn/sim/schedule.py``
to the letter (sends snapshot, receives replace or wait for a Merge, chunks are array_split
slices, partial chunks slice the head axis), so a test can check that every generator leaves
softmax attention over the whole sequence on every rank.
"""

from __future__ import annotations

import numpy as np

from treeattn.sim.schedule import Compute, Merge, Recv, Schedule, Send


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
    (oa, la), (ob, lb) = a, b
    lse = np.logaddexp(la, lb)
    with np.errstate(invalid="ignore"):
        wa = np.where(np.isneginf(la), 0.0, np.exp(la - lse))
        wb = np.where(np.isneginf(lb), 0.0, np.exp(lb - lse))
    return oa * wa[:, None] + ob * wb[:, None], lse


def full_attention(q, k, v):
    return partial(q, k, v)


def _slices(n: int, chunk):
    if chunk is None:
        return slice(0, n)
    index, count = chunk
    sizes = [n // count + (1 if i < n % count else 0) for i in range(count)]
    start = sum(sizes[:index])
    return slice(start, start + sizes[index])


def _get(buf, payload, chunk):
    if payload in ("partial", "residue"):
        o, lse = buf
        s = _slices(o.shape[0], chunk)
        return o[s].copy(), lse[s].copy()
    if payload == "kv":
        return buf
    flat = buf.reshape(-1)
    return flat[_slices(flat.size, chunk)].copy()


def _put(buffers, payload, chunk, value):
    if payload == "partial":
        o, lse = buffers["partial"]
        s = _slices(o.shape[0], chunk)
        o, lse = o.copy(), lse.copy()
        o[s], lse[s] = value
        buffers["partial"] = (o, lse)
    elif payload == "kv":
        buffers["kv"] = value
    else:
        flat = buffers[payload].reshape(-1).copy()
        flat[_slices(flat.size, chunk)] = value
        buffers[payload] = flat.reshape(buffers[payload].shape)


def _fold(buffers, op, recv: Recv, value):
    if op == "partial":
        mine = _get(buffers["partial"], "partial", recv.chunk)
        _put(buffers, "partial", recv.chunk, merge(mine, value))
        return
    mine = _get(buffers[recv.payload], recv.payload, recv.chunk)
    _put(buffers, recv.payload, recv.chunk, np.maximum(mine, value) if op == "max"
         else mine + value)


def _compute(buffers, step: Compute, q, shard):
    if step.label == "attention":
        buffers["partial"] = partial(q, *shard)
    elif step.label == "attention_block":
        buffers["block"] = partial(q, *buffers["kv"])
    elif step.label == "init_max":
        buffers["max"] = buffers["partial"][1].copy()
    elif step.label == "rescale":
        o, lse = buffers["partial"]
        with np.errstate(invalid="ignore"):
            den = np.where(np.isneginf(lse), 0.0, np.exp(lse - buffers["max"]))
        buffers["den"], buffers["num"] = den, o * den[:, None]
    elif step.label == "finalize":
        den = buffers["den"]
        buffers["partial"] = (buffers["num"] / den[:, None], buffers["max"] + np.log(den))


def execute(schedule: Schedule, q, shards) -> list:
    """Run ``schedule``; return each rank's final partial. Sends snapshot; Recv blocks."""
    world = schedule.world
    buffers = [{"kv": shards[r]} for r in range(world)]
    pc, mail, kept = [0] * world, {}, [dict() for _ in range(world)]
    recv_of = [dict() for _ in range(world)]
    progress = True
    while progress:
        progress = False
        for r in range(world):
            steps = schedule.steps[r]
            while pc[r] < len(steps):
                s = steps[pc[r]]
                if isinstance(s, Send):
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
                elif isinstance(s, Merge) and s.op == "residue":  # residue = partial (+) msg
                    mine = buffers[r]["partial"]
                    buffers[r]["residue"] = mine if s.tag is None else merge(
                        mine, kept[r].pop(s.tag))
                elif isinstance(s, Merge):
                    if s.tag is None:
                        buffers[r]["partial"] = merge(buffers[r]["partial"],
                                                      buffers[r].pop("block"))
                    else:
                        _fold(buffers[r], s.op, recv_of[r][s.tag], kept[r].pop(s.tag))
                else:
                    _compute(buffers[r], s, q, shards[r])
                pc[r] += 1
                progress = True
    assert all(pc[r] == len(schedule.steps[r]) for r in range(world)), "deadlock"
    assert not mail, "unreceived messages"
    return [buffers[r]["partial"] for r in range(world)]
