"""Sharded prefill: the prompt's K/V computed across ranks straight into the decode cache.

No rank ever holds the whole context. Rank ``r`` runs the model on its zig-zag pair of
prompt chunks only (:class:`treeattn.sim.prefill.layout.PrefillLayout`: balanced causal
work), and each layer's attention over everything before its queries is a pass-KV ring
(:func:`treeattn.runtime.prefill.ring.ring_attention`). While the blocks go round, every rank
keeps the pieces that fall in its contiguous storage run, so at the end it holds exactly its
:class:`~treeattn.llm.cache.ShardedKVCache` shard of every layer, in the layout decode uses.
With ``algorithm="pass-q"`` the query blocks go round instead
(:func:`treeattn.runtime.prefill.passq.passq_attention`: cheaper when a long document's K/V
are already in place and a short prompt follows) and each layer's prompt K/V are then sent
to the ranks that store them.
The rank whose queries include the last position computes the first token's logits and
broadcasts them, so every rank returns them.

Long-context mode (``context_tokens`` > 0): the document's K/V are built locally by each rank
for its own storage run only (:func:`treeattn.llm.generate_context.context_kv`, the same
values as the single-process fill), and travel in the ring beside the prompt's.

Memory per rank beyond the weights: its shard, plus at most three ring blocks of one layer
(each at most one shard's layer plus one zig-zag pair of prompt K/V), plus activations of
its ``~P/W`` prompt tokens (the feed-forward runs :data:`PREFILL_CHUNK` tokens at a time).
Measured in ``benchmarks/prefill_memory.py``.

:func:`sharded_prefill` is the entry point for any caller that has a process group and a
:class:`~treeattn.llm.model.Transformer` (``treeattn generate``, or a Hugging Face wrapper).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from treeattn.llm.cache import ShardedKVCache
from treeattn.llm.errors import ModelError
from treeattn.llm.generate_context import context_kv, segment_kv
from treeattn.llm.local_cache import PREFILL_CHUNK, model_device
from treeattn.llm.model import Transformer, rope_cos_sin
from treeattn.runtime.group import RankContext, wait_work
from treeattn.runtime.prefill.passq import passq_attention, send_to_storage
from treeattn.runtime.prefill.ring import (
    PREFILL_ALGORITHMS,
    TILE_K,
    TILE_Q,
    RingStats,
    ring_attention,
    run_positions,
)
from treeattn.sim.prefill.layout import PrefillLayout, run_pieces

DOCUMENT_PIECE = 4096  # positions of the document rotated at once
RING_BLOCKS = 3  # a rank's own block, the one attended and forwarded, the one arriving


def prefill_bytes(config, context: int, prompt: int, world: int, element: int,
                  reserve: int = 0, algorithm: str = "pass-kv") -> dict[str, int]:
    """What one rank holds during :func:`sharded_prefill`, by part, in bytes (weights apart).

    ``shard``: the largest rank's cache (all layers, with ``reserve`` appended tokens on the
    rank that stores them); ``blocks``, for ``pass-kv``: :data:`RING_BLOCKS` ring blocks of
    one layer, each at most one layer of the largest shard plus one zig-zag pair of prompt
    K/V; for ``pass-q``: the rank's own block (which stays), two query blocks, three fp32
    partials and one layer's incoming prompt K/V (at most a shard's layer); ``activations``:
    the hidden states, one layer's Q/K/V and one feed-forward chunk of the rank's queries
    (fp32 scores tiles are bounded by the ring's tiles and counted with them).
    """
    layout = PrefillLayout(world, context, prompt)
    per_token = 2 * config.n_kv_heads * config.head_dim * element  # one layer's K and V
    biggest = max(layout.lengths) + reserve
    pair = max(len(layout.positions(r, queries=True)) for r in range(world))
    block = (max(layout.lengths) + pair) * per_token
    if algorithm == "pass-q":
        query = pair * config.n_heads * config.head_dim * element
        partial = pair * config.n_heads * (config.head_dim + 1) * 4
        blocks = block + 2 * query + 3 * partial + max(layout.lengths) * per_token
    else:
        blocks = RING_BLOCKS * block
    heads = (config.n_heads + 2 * config.n_kv_heads) * config.head_dim
    activations = (pair * (2 * config.dim + heads) * element
                   + min(pair, PREFILL_CHUNK) * 3 * config.hidden_dim * element
                   + pair * config.n_heads * (config.head_dim + 1) * 4)  # fp32 output
    tiles = 3 * config.n_heads * TILE_Q * TILE_K * 4  # the score tile and logsumexp's two
    return {"shard": biggest * config.n_layers * per_token, "blocks": blocks,
            "activations": activations + tiles}


class _RingBackend:
    """The attention backend of one rank's prefill: every layer's attention is one ring,
    of K/V blocks (``pass-kv``) or of query blocks (``pass-q``)."""

    def __init__(self, ctx: RankContext, layout: PrefillLayout, cache: ShardedKVCache,
                 stats: RingStats, algorithm: str = "pass-kv") -> None:
        self.ctx, self.layout, self.cache, self.stats = ctx, layout, cache, stats
        self.algorithm = algorithm
        self.storage = layout.storage(ctx.rank)
        doc = layout.document(ctx.rank)
        self.doc_len = doc[1] - doc[0]

    def attend(self, layer, q, k, v, start):
        mine = torch.stack([k, v])  # (2, B, Hkv, T, D)
        if self.doc_len:  # the document part of this rank's storage, then its prompt K/V
            doc = self.cache.kv(layer)[:, :, :, : self.doc_len]  # (2, B, Hkv, n, D) view
            own = torch.cat([doc, mine], dim=3)  # (2, B, Hkv, n + T, D)
        else:
            own = mine
        if self.algorithm == "pass-q":
            o = passq_attention(self.ctx, self.layout, q, own, self.stats)
            lo = self.storage[0]
            send_to_storage(self.ctx, self.layout, mine,
                            lambda at, piece: self.cache.put(layer, at - lo, piece), self.stats)
        else:
            o = ring_attention(self.ctx, self.layout, q, own,
                               lambda src, block: self._keep(layer, src, block), self.stats)
        return o.to(q.dtype)  # (B, Hq, T, D)

    def _keep(self, layer: int, src: int, block: torch.Tensor) -> None:
        """Store the prompt pieces of ``src``'s block that lie in this rank's storage run
        (document runs are their own rank's, stored already)."""
        lo, hi = self.storage
        for offset, s, e in run_pieces(self.layout.block(src), max(lo, self.layout.context), hi):
            self.cache.put(layer, s - lo, block[:, :, :, offset : offset + e - s])


def _fill_document(cache: ShardedKVCache, model: Transformer, layout: PrefillLayout,
                   rank: int, segment: list[int]) -> None:
    """This rank's storage run of the repeated document, layer by layer."""
    lo, hi = layout.document(rank)
    if hi <= lo:
        return
    if not segment:
        raise ModelError("long-context prefill needs the document's segment tokens")
    ks, vs = segment_kv(model, segment)
    for layer in range(cache.n_layers):  # in pieces: the rotation's temporaries stay small
        for a in range(lo, hi, DOCUMENT_PIECE):
            b = min(hi, a + DOCUMENT_PIECE)
            k, v = context_kv([ks[layer]], [vs[layer]], model.inv_freq, a, b)
            cache.put(layer, a - lo, torch.stack([k[0], v[0]]))  # (2, 1, Hkv, b-a, D)


def _broadcast_logits(ctx: RankContext, logits: torch.Tensor, src: int) -> torch.Tensor:
    if ctx.world > 1:
        work = dist.broadcast(logits, src=src, async_op=True)
        wait_work(work, ctx, src, "first-token logits")
    return logits


@torch.no_grad()
def sharded_prefill(ctx: RankContext, model: Transformer, prompt_ids: list[int], *,
                    context_tokens: int = 0, segment: list[int] | tuple = (), reserve: int = 0,
                    algorithm: str = "pass-kv", stats: RingStats | None = None,
                    chunk: int = PREFILL_CHUNK,
                    lengths: list[int] | None = None) -> tuple[ShardedKVCache, torch.Tensor]:
    """Prefill ``context_tokens`` of document then ``prompt_ids`` across the group.

    Every rank calls it with the same arguments. Returns ``(cache, logits)``: this rank's
    :class:`ShardedKVCache` (contiguous shard lengths ``split_even(C + P, world)``, room for
    ``reserve`` appended tokens) and the last position's logits (1, V) fp32, the same on every
    rank. ``stats`` (a :class:`RingStats`) receives the bytes sent and the peak block bytes.
    ``lengths``, when given, are the shard lengths the caller's decode expects (a plan's): a
    mismatch is refused before any work. Raises :class:`ModelError` for bad input.
    """
    if algorithm not in PREFILL_ALGORITHMS:
        raise ModelError(f"the runtime's prefill runs {', '.join(PREFILL_ALGORITHMS)}, "
                         f"not {algorithm!r}")
    if not prompt_ids:
        raise ModelError("the prompt is empty")
    layout = PrefillLayout(ctx.world, context_tokens, len(prompt_ids))
    if lengths is not None and list(lengths) != layout.lengths:
        raise ModelError(f"the decode layout's shards {list(lengths)[:8]} are not the prefill's "
                         f"contiguous split {layout.lengths[:8]} of {layout.total} tokens over "
                         f"{ctx.world} ranks")
    cfg, device = model.config, model_device(model)
    dtype = model.norm.weight.dtype  # the blocks' dtype: the cache's
    cache = ShardedKVCache(ctx.rank, layout.lengths, cfg.n_layers, 1, cfg.n_kv_heads,
                           cfg.head_dim, dtype=dtype, device=device, reserve=reserve)
    stats = stats if stats is not None else RingStats()
    if context_tokens:
        t0 = time.perf_counter()
        _fill_document(cache, model, layout, ctx.rank, list(segment))
        stats.document_s = time.perf_counter() - t0
    mine = layout.positions(ctx.rank, queries=True)
    ids = torch.tensor([[prompt_ids[p - context_tokens] for p in mine]], dtype=torch.long,
                       device=device)  # (1, T)
    pos = run_positions(layout.compute(ctx.rank), device)  # (T,)
    cos, sin = rope_cos_sin(model.inv_freq.to(device), pos)  # (T, D/2) each
    x = model.tok_embeddings(ids).to(dtype)  # (1, T, dim)
    backend = _RingBackend(ctx, layout, cache, stats, algorithm)
    for i, block in enumerate(model.layers):  # Block.forward, the feed-forward in chunks
        h = x + block.attention(block.attention_norm(x), cos, sin, i, backend, 0)
        for a in range(0, h.shape[1], chunk):
            part = h[:, a : a + chunk]  # (1, n, dim)
            h[:, a : a + chunk] = part + block.feed_forward(block.ffn_norm(part))
        x = h
    owner = layout.last_owner
    if ctx.rank == owner:
        last = model.norm(x[:, -1]).to(model.output.weight.dtype)  # (1, dim)
        logits = model.output(last).float().contiguous()  # (1, V)
    else:
        logits = torch.empty(1, cfg.vocab_size, dtype=torch.float32, device=device)
    return cache, _broadcast_logits(ctx, logits, owner)
