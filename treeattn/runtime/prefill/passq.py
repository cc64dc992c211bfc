"""Context-parallel prefill attention that passes the queries instead (pass-Q).

Meta's context-parallel inference (Yang et al. 2024, arXiv 2411.01783) passes the query
blocks round the ring while every rank's K/V stay put. It is the cheaper ring when the keys
outnumber the queries: a prompt appended to a long document or to earlier turns whose K/V
are already in the cache (``context_tokens`` here), where pass-KV would send the whole
document round the ring and pass-Q sends only the new tokens' queries.

Per layer, on rank ``r`` of ``W`` (same :class:`~treeattn.sim.prefill.layout.PrefillLayout`
as pass-KV: zig-zag queries, contiguous storage):

1. **The ring.** Step ``s`` attends the query block of origin ``o = (r - s) mod W`` over
   ``r``'s own block (its document run, then its prompt chunks' K/V) while the block moves
   on to ``r + 1`` and the next arrives from ``r - 1``. The partial ``(o, lse)`` it makes is
   sent straight back to its origin during the next step, so a rank holds at most two
   partials of others' queries (the one on its way home, the one just made); the origin
   merges its ``W`` partials by log-sum-exp as
   they arrive (the first is its own, step 0).
2. **The K/V to their shards.** The K/V of a rank's zig-zag chunks belong to the ranks whose
   contiguous storage runs hold those positions: one point-to-point message per (source,
   owner) pair carries the pieces, in position order. Pass-KV gets this for free (its blocks
   pass every rank); pass-Q pays it, as the simulator prices it.

Every rank knows every block's, chunk's and partial's size from the layout alone, and a
partial that sees no key (queries wholly before a block) is neither computed nor sent, on
both sides. Held at once besides the shard: two query blocks (the one attended and
forwarded, the one arriving), three partials (the one going back while the next is made,
that one, and the one arriving), and one layer's incoming prompt pieces (at most this
rank's prompt storage of one layer).
"""

from __future__ import annotations

import math

import torch

from treeattn.runtime.group import RankContext, wait_work
from treeattn.runtime.prefill.ring import (
    PREFILL_TAG,
    RingStats,
    causal_partial,
    merge_prefill_pair,
    post_p2p,
)
from treeattn.runtime.transport import transport_for
from treeattn.sim.prefill.layout import PrefillLayout, run_pieces

KV_TAG = PREFILL_TAG - 1  # the K/V pieces' tag: below the ring steps', above the mailboxes'


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def passq_attention(ctx: RankContext, layout: PrefillLayout, q: torch.Tensor,
                    own: torch.Tensor, stats: RingStats | None = None,
                    scale: float | None = None) -> torch.Tensor:
    """One layer's causal attention of this rank's queries, the query blocks going round.

    ``q`` (B, Hq, T, D) are this rank's compute queries (``layout.compute(rank)``); ``own``
    (2, B, Hkv, S, D) is its block (``layout.block(rank)``), which never moves. Returns the
    output (B, Hq, T, D) fp32, equal to :func:`treeattn.runtime.prefill.ring.ring_attention`'s.

    A partial travels as its two tensors, ``o`` then ``lse``, as the kernel made them (no
    packed copy); three tags per step keep the block and the two halves apart on gloo.
    """
    rank, world = ctx.rank, ctx.world
    transport = transport_for(ctx) if world > 1 else None
    b, hq, _, d = q.shape
    k_pos = layout.positions(rank)
    size = lambda origin: len(layout.positions(origin, queries=True))  # noqa: E731
    mine = (torch.zeros(*q.shape, dtype=torch.float32, device=q.device),
            torch.full(q.shape[:3], -math.inf, dtype=torch.float32, device=q.device))
    current, back = q, ()  # the query block attended now; the partial going home
    for step in range(world + 1):  # the last pass only brings the last partials home
        origin = (rank - step) % world
        tag = PREFILL_TAG + 3 * step
        sends, recvs, incoming, nxt = [], [], (), None
        if step < world - 1 and size((origin - 1) % world):  # the next query block
            nxt = q.new_empty(b, hq, size((origin - 1) % world), d)
            recvs.append((nxt, (rank - 1) % world, tag))
        if step < world - 1 and current.shape[2]:
            sends.append((current, (rank + 1) % world, tag))
        for i, half in enumerate(back):  # last step's partial, to that step's origin
            sends.append((half, (origin + 1) % world, tag + 1 + i))
        helper = (rank + step - 1) % world  # who attended our queries in the last step
        if step >= 1 and helper != rank and layout.sees(rank, helper):
            incoming = (q.new_empty(b, hq, size(rank), d, dtype=torch.float32),
                        q.new_empty(b, hq, size(rank), dtype=torch.float32))
            recvs += [(half, helper, tag + 1 + i) for i, half in enumerate(incoming)]
        pending = post_p2p(ctx, transport, sends, recvs) if world > 1 else []
        part = ()
        if step < world and layout.sees(origin, rank):
            part = causal_partial(current, layout.positions(origin, queries=True), own,
                                  k_pos, scale)
        if stats is not None:  # everything alive now: blocks, the partial going out, the
            # one just made, the one arriving
            stats.bytes_sent += _nbytes(t for t, _, _ in sends)
            held = _nbytes((nxt, *back, *part, *incoming)) + (
                _nbytes((current,)) if current is not q else 0)
            stats.peak_block_bytes = max(stats.peak_block_bytes, held)
        for work, peer in pending:
            wait_work(work, ctx, peer, f"prefill pass-Q step {step}")
        back = ()
        if part and origin == rank:
            mine = merge_prefill_pair(mine, part)
        elif part:
            back = part
        if incoming:
            mine = merge_prefill_pair(mine, incoming)
        if step < world - 1:
            current = nxt if nxt is not None else q.new_empty(b, hq, 0, d)
    return mine[0]


def send_to_storage(ctx: RankContext, layout: PrefillLayout, mine: torch.Tensor, put,
                    stats: RingStats | None = None) -> None:
    """Move one layer's prompt K/V from the ranks that computed them to the ranks that store
    them. ``mine`` (2, B, Hkv, T, D) are the K/V of this rank's compute chunks;
    ``put(start, kv)`` stores a piece (2, B, Hkv, n, D) at global position ``start`` of this
    rank's storage run."""
    rank, world = ctx.rank, ctx.world
    lo, hi = layout.storage(rank)
    sends, recvs, landing = [], [], []
    for peer in range(world):
        if peer == rank:
            for offset, s, e in run_pieces(layout.compute(rank), lo, hi):
                put(s, mine[:, :, :, offset:offset + e - s])
            continue
        out = run_pieces(layout.compute(rank), *layout.storage(peer))
        if out:
            piece = torch.cat([mine[:, :, :, o:o + e - s] for o, s, e in out], dim=3)
            sends.append((piece, peer, KV_TAG))
        into = run_pieces(layout.compute(peer), lo, hi)
        if into:
            n = sum(e - s for _, s, e in into)
            buf = mine.new_empty(*mine.shape[:3], n, mine.shape[4])  # (2, B, Hkv, n, D)
            recvs.append((buf, peer, KV_TAG))
            landing.append((buf, into))
    if world == 1 or not (sends or recvs):
        return
    pending = post_p2p(ctx, transport_for(ctx), sends, recvs)
    if stats is not None:
        stats.bytes_sent += _nbytes(t for t, _, _ in sends)
        held = _nbytes(t for t, _, _ in sends + recvs)
        stats.peak_block_bytes = max(stats.peak_block_bytes, held)
    for work, peer in pending:
        wait_work(work, ctx, peer, "prefill K/V to their shards")
    for buf, into in landing:
        at = 0
        for _, s, e in into:
            put(s, buf[:, :, :, at:at + e - s])
            at += e - s
