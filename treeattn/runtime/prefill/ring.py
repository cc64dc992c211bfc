"""Context-parallel prefill attention: a ring that passes KV blocks (pass-KV).

Where each position is stored and which queries each rank runs is
:class:`treeattn.sim.prefill.layout.PrefillLayout`: contiguous storage (the decode cache's
layout), zig-zag compute (balanced causal work). The two are reconciled for free: in a
pass-KV ring every rank's block visits every other rank, so each rank *keeps* the parts of
the blocks passing by that fall in its storage run, and no all-to-all is needed at the end.

Per layer, rank ``r``'s block is ``(2, B, Hkv, S_r, D)``: the document part of its storage run
(positions ``< C``) followed by the K/V of its own compute chunks. Ring step ``s`` attends the
block of rank ``(r - s) mod W`` while the next one is on the wire (one ``isend`` to ``r+1``,
one ``irecv`` from ``r-1``, both posted before the step's attention). A rank therefore holds,
besides its storage shard, at most three blocks of one layer: its own (being built), the one
being attended to and forwarded, and the one arriving. Every rank knows every block's runs
from the layout alone, so only tensors travel, and empty blocks are never sent. Messages go
through :mod:`treeattn.runtime.transport`: ``isend``/``irecv`` on gloo, grouped
``batch_isend_irecv`` on NCCL.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from treeattn.runtime.group import RankContext, wait_work
from treeattn.runtime.transport import transport_for
from treeattn.sim.prefill.layout import PrefillLayout, Run

# far above the tags a schedule's rounds use, and any local channel's (the test bed's mailboxes
# take tags 0..8): blocks always take the process group
PREFILL_TAG = 24
TILE_Q, TILE_K = 256, 1024  # score tiles: bound the (queries x keys) fp32 scratch
PREFILL_ALGORITHMS = ("pass-kv", "pass-q")  # what the runtime runs (pass-Q: prefill_passq)


def run_positions(runs: tuple[Run, ...], device) -> torch.Tensor:
    """The positions of ``runs``, concatenated (n,) int64."""
    if not runs:
        return torch.zeros(0, dtype=torch.int64, device=device)
    return torch.cat([torch.arange(a, b, device=device) for a, b in runs])


def merge_prefill_pair(acc, part):
    """Log-sum-exp merge of two partials ``(o (B,Hq,T,D), lse (B,Hq,T))``, fp32; rows with
    ``lse = -inf`` (no key seen) are the identity."""
    (o1, l1), (o2, l2) = acc, part
    m = torch.maximum(l1, l2)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # both -inf: weights 0
    w1, w2 = torch.exp(l1 - m), torch.exp(l2 - m)  # (B, Hq, T)
    total = w1 + w2
    safe = torch.where(total > 0, total, torch.ones_like(total))
    o = (o1 * w1[..., None] + o2 * w2[..., None]) / safe[..., None]  # (B, Hq, T, D)
    return o, m + torch.log(total)


def causal_partial(q: torch.Tensor, q_pos: list[int], kv: torch.Tensor, k_pos: list[int],
                   scale: float | None = None):
    """Partial attention of ``q`` (B, Hq, T, D) at ascending positions ``q_pos`` over the keys
    of ``kv`` (2, B, Hkv, S, D) at ascending ``k_pos``, query ``i`` seeing keys ``<= q_pos[i]``.

    Returns ``(o (B,Hq,T,D), lse (B,Hq,T))`` in fp32; a query that sees no key gets
    ``(0, -inf)``. Tiled (:data:`TILE_Q` x :data:`TILE_K`) so the fp32 scores stay small;
    keys in the future of a query tile's last query are skipped and tiles wholly in the
    past need no mask.
    """
    b, hq, t, d = q.shape
    hkv = kv.shape[2]
    group = hq // hkv
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    o = torch.zeros(b, hq, t, d, dtype=torch.float32, device=q.device)
    lse = torch.full((b, hq, t), -math.inf, dtype=torch.float32, device=q.device)
    qp_all = torch.tensor(q_pos, dtype=torch.int64, device=q.device)  # (T,)
    kp_all = torch.tensor(k_pos, dtype=torch.int64, device=q.device)  # (S,)
    for q0 in range(0, t, TILE_Q):
        q1 = min(t, q0 + TILE_Q)
        n = q1 - q0
        qt = q[:, :, q0:q1].float().reshape(b, hkv, group * n, d)  # (B, Hkv, G*n, D)
        acc = (torch.zeros(b, hkv, group * n, d, dtype=torch.float32, device=q.device),
               torch.full((b, hkv, group * n), -math.inf, dtype=torch.float32, device=q.device))
        # keys past the tile's last query are in every query's future: never computed,
        # even where a block's runs leave a gap (a zig-zag block's early and late chunks)
        seen = bisect.bisect_right(k_pos, q_pos[q1 - 1])
        for k0 in range(0, seen, TILE_K):
            k1 = min(seen, k0 + TILE_K)
            kt, vt = kv[0, :, :, k0:k1].float(), kv[1, :, :, k0:k1].float()  # (B, Hkv, m, D)
            # in place from here on: one (G*n, m) fp32 tile alive at a time
            scores = torch.matmul(qt, kt.transpose(-1, -2)).mul_(scale)  # (B, Hkv, G*n, m)
            if k_pos[k1 - 1] > q_pos[q0]:  # some key is in some query's future
                future = kp_all[None, k0:k1] > qp_all[q0:q1, None]  # (n, m)
                scores.masked_fill_(future.repeat(group, 1), -math.inf)
            tile_lse = torch.logsumexp(scores, dim=-1)  # (B, Hkv, G*n)
            finite = torch.where(torch.isinf(tile_lse), torch.zeros_like(tile_lse), tile_lse)
            probs = scores.sub_(finite[..., None]).exp_()  # masked entries exp(-inf) = 0
            acc = merge_prefill_pair(acc, (torch.matmul(probs, vt), tile_lse))
        o[:, :, q0:q1] = acc[0].reshape(b, hq, n, d)
        lse[:, :, q0:q1] = acc[1].reshape(b, hq, n)
    return o, lse


def post_p2p(ctx: RankContext, transport, sends: list, recvs: list) -> list:
    """Post ``sends`` and ``recvs``, each a list of ``(tensor, peer, tag)`` with group-local
    peers; returns ``[(work, peer)]``, sends first. On NCCL all of them go in one
    ``batch_isend_irecv`` group: posted one after the other, a ring's sends would each wait
    on the successor's, queued behind that rank's own send, round the whole ring (a
    deadlock). Between one pair, receives match sends in the order they are listed."""
    ops = [(dist.isend, t.contiguous(), peer, tag) for t, peer, tag in sends] + [
        (dist.irecv, t, peer, tag) for t, peer, tag in recvs]
    if not ops:
        return []
    if transport.batch_p2p:
        works = dist.batch_isend_irecv([
            dist.P2POp(op, t, ctx.global_rank(peer), group=ctx.group, tag=tag)
            for op, t, peer, tag in ops])
    else:
        works = [transport.isend(t, peer, tag) if op is dist.isend
                 else transport.irecv(t, peer, tag) for op, t, peer, tag in ops]
    return [(w, op[2]) for w, op in zip(works, ops, strict=True)]


def _exchange(ctx: RankContext, transport, send: torch.Tensor | None,
              recv: torch.Tensor | None, tag: int) -> list:
    """Post this ring step's send to ``rank + 1`` and its receive from ``rank - 1``."""
    nxt, prv = (ctx.rank + 1) % ctx.world, (ctx.rank - 1) % ctx.world
    return post_p2p(ctx, transport, [(send, nxt, tag)] if send is not None else [],
                    [(recv, prv, tag)] if recv is not None else [])


@dataclass
class RingStats:
    """What one rank's rings moved and held, summed over layers."""

    bytes_sent: int = 0
    peak_block_bytes: int = 0  # the most bytes of ring blocks held at once (one layer)
    document_s: float = 0.0  # building a long context's K/V, which an engine has cached


def ring_attention(ctx: RankContext, layout: PrefillLayout, q: torch.Tensor,
                   own: torch.Tensor, keep: Callable[[int, torch.Tensor], None],
                   stats: RingStats | None = None, scale: float | None = None) -> torch.Tensor:
    """One layer's causal attention of this rank's queries over every earlier position.

    ``q`` (B, Hq, T, D) are this rank's compute queries (``layout.compute(rank)``); ``own``
    (2, B, Hkv, S, D) is this rank's block (``layout.block(rank)``). ``keep(src, block)`` is
    called once with every block as it is attended, ``src`` the rank it belongs to, so the
    caller can store what falls in its storage run. Returns the output (B, Hq, T, D) fp32.
    """
    rank, world = ctx.rank, ctx.world
    transport = transport_for(ctx) if world > 1 else None
    q_pos = layout.positions(rank, queries=True)
    b, hq, t, d = q.shape
    acc = (torch.zeros(b, hq, t, d, dtype=torch.float32, device=q.device),
           torch.full((b, hq, t), -math.inf, dtype=torch.float32, device=q.device))
    current = own
    for step in range(world):
        src = (rank - step) % world
        pending: list = []
        nxt = None
        if step < world - 1:  # forward the current block, receive the next one
            n_in = layout.block_length((rank - step - 1) % world)
            if n_in:
                nxt = current.new_empty(*current.shape[:3], n_in, current.shape[4])
            pending = _exchange(ctx, transport, current if current.shape[3] else None, nxt,
                                PREFILL_TAG + step)
            if stats is not None and current.shape[3]:
                stats.bytes_sent += current.numel() * current.element_size()
        if stats is not None:
            blocks = {id(x): x for x in (own, current, nxt) if x is not None}
            held = sum(x.numel() * x.element_size() for x in blocks.values())
            stats.peak_block_bytes = max(stats.peak_block_bytes, held)
        if current.shape[3]:
            keep(src, current)
            if layout.sees(rank, src):
                acc = merge_prefill_pair(acc, causal_partial(q, q_pos, current,
                                                         layout.positions(src), scale))
        for work, peer in pending:
            wait_work(work, ctx, peer, f"prefill ring step {step}")
        if step < world - 1:
            current = nxt if nxt is not None else own.new_empty(*own.shape[:3], 0, own.shape[4])
    return acc[0]
