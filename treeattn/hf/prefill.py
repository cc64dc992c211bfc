"""Sharded prefill for transformers models: the prompt never whole on one rank.

:func:`sharded_prefill` fills a :class:`~treeattn.hf.cache.ShardedCache` with all but the
last token of the prompt, each rank running the model on its own zig-zag pair of prompt
chunks only (:class:`treeattn.sim.prefill.layout.PrefillLayout`: balanced causal work), with
``position_ids`` the chunks' global positions, so RoPE is as in one process. Every layer's
attention is the pass-KV ring of :func:`treeattn.runtime.prefill_ring.ring_attention`; while
the blocks go round, each rank keeps the positions its cache layout names (contiguous or
interleaved), so at the end it holds exactly its shard of every layer and nothing else.

The last prompt token is left for ``model.generate``: given the same ``input_ids`` and the
filled cache, transformers runs only the positions the cache does not hold yet, so its first
forward is one decode step through the sharded attention, and its logits are the first
token's. Exact: the ring's partials are merged by log-sum-exp, as one process's softmax.

A rank whose compute chunks are empty (a prompt shorter than twice the world) runs no model
forward; it still passes every layer's ring blocks on and keeps its positions.

Refused by name: a padded batch (its real tokens differ per sequence: let ``generate`` run
its replicated prefill, which drops the padding), and a cache that already holds tokens.
"""

from __future__ import annotations

import torch

from treeattn.hf.cache import HFIntegrationError, ShardedCache
from treeattn.runtime.prefill_ring import ring_attention
from treeattn.sim.prefill.layout import PrefillLayout


def _heads(config) -> tuple[int, int, int]:
    """(query heads, KV heads, head dim) of a transformers config."""
    text = getattr(config, "get_text_config", lambda: config)()
    hq = int(text.num_attention_heads)
    hkv = int(getattr(text, "num_key_value_heads", None) or hq)
    d = int(getattr(text, "head_dim", None) or text.hidden_size // hq)
    return hq, hkv, d


@torch.no_grad()
def sharded_prefill(model, input_ids: torch.Tensor, cache: ShardedCache,
                    attention_mask: torch.Tensor | None = None) -> int:
    """Prefill ``input_ids`` (B, L) but its last token into ``cache`` across the group.

    Every rank calls it with the same arguments (collective); then
    ``model.generate(input_ids, cache=cache, ...)`` continues from the cache.
    Returns the positions prefilled (L - 1). The model must use
    ``attn_implementation="treeattn"``.
    """
    if input_ids.dim() != 2:
        raise HFIntegrationError(f"input_ids must be (batch, length), got "
                                 f"{tuple(input_ids.shape)}")
    if attention_mask is not None and not bool(attention_mask.all()):
        raise HFIntegrationError("sharded prefill takes prompts without padding; for a padded "
                                 "batch let model.generate run its replicated prefill")
    if cache.get_seq_length():
        raise HFIntegrationError(f"the cache already holds {cache.get_seq_length()} positions")
    implementation = getattr(model.config, "_attn_implementation", None)
    if implementation != "treeattn":
        raise HFIntegrationError(f"the model attends with {implementation!r}: load it with "
                                 "attn_implementation=\"treeattn\"")
    batch, length = input_ids.shape
    prompt = length - 1
    if prompt < 1:
        return 0
    ctx = cache.attention.ctx
    layout = PrefillLayout(ctx.world, 0, prompt)
    mine = layout.positions(ctx.rank, queries=True)
    dtype = next(model.parameters()).dtype
    cache.begin_ring(layout, prompt)
    try:
        if mine:
            device = input_ids.device
            positions = torch.tensor(mine, dtype=torch.long, device=device)  # (T,)
            model(input_ids=input_ids[:, positions],  # (B, T): this rank's chunks only
                  position_ids=positions[None].expand(batch, -1), cache=cache,
                  use_cache=True, logits_to_keep=1)
        else:  # no queries here: pass every layer's blocks on, keep this rank's positions
            hq, hkv, d = _heads(model.config)
            q = torch.empty(batch, hq, 0, d, dtype=dtype, device=input_ids.device)
            own = torch.empty(2, batch, hkv, 0, d, dtype=dtype, device=input_ids.device)
            for layer in cache.layers:
                ring_attention(ctx, layout, q, own, layer.keep_ring_block)
        cache.end_ring()
    except BaseException:
        cache.reset()  # half a prefill is no cache
        raise
    return prompt
