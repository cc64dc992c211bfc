"""The ``"treeattn"`` attention implementation for transformers, and its mask function.

transformers calls an attention implementation as ``fn(module, query (B, Hq, S, D), key,
value, attention_mask, scaling=..., dropout=..., **kwargs)`` right after the layer's
``cache.update``, with whatever that update returned. With a
:class:`~treeattn.hf.cache.ShardedCache`, the layer that was just updated says which step this
is (``ShardedLayer.mode``):

- **ring** (:func:`treeattn.hf.sharded_prefill`): ``query``/``key``/``value`` are this
  rank's prompt chunks; their causal attention over every earlier position is the pass-KV
  ring (:func:`treeattn.runtime.prefill_ring.ring_attention`), by global positions (the
  mask transformers built for the chunk alone is not used);
- **prefill**: ``key``/``value`` are the whole prompt's (replicated prefill): ordinary SDPA
  with the causal (and padding) mask, exact;
- **decode**: ``key``/``value`` are this rank's shard; the query's attention over every
  rank's shard is :class:`treeattn.ShardedAttention`, by the plan's schedule. A decode step's
  mask is all-true over the real tokens, which are all the cache keeps: at a left-padded
  prefill the mask's last row told the layer which prompt positions are padding, and the
  layer dropped them (``ShardedLayer.drop_padding``), so each sequence attends to its own
  tokens (``kv_len``).

Without a ``ShardedCache`` (e.g. a forward with ``use_cache=False``) it is plain SDPA. The
mask function registered beside it is transformers' SDPA mask: transformers ignores the mask
of an attention implementation that registers none.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from treeattn.hf.cache import HFIntegrationError, active_layer
from treeattn.runtime.prefill_ring import ring_attention

ATTENTION_NAME = "treeattn"


def treeattn_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask, dropout: float = 0.0, scaling: float | None = None,
                       **kwargs):
    """Attention of ``query`` (B, Hq, S, D); returns ``(out (B, S, Hq, D), None)``."""
    if kwargs.get("softcap") is not None:
        raise HFIntegrationError("attention logit soft-capping is not served by treeattn")
    if getattr(module, "sinks", None) is not None or kwargs.get("s_aux") is not None:
        raise HFIntegrationError("attention sinks are not served by treeattn")
    if kwargs.get("sliding_window") or getattr(module, "sliding_window", None):
        raise HFIntegrationError("sliding-window attention layers are not served by treeattn")
    layer = active_layer(getattr(module, "layer_idx", -1))
    if layer is not None and layer.mode == "ring":
        cache = layer.cache
        own = torch.stack([key, value])  # (2, B, Hkv, T, D)
        out = ring_attention(cache.attention.ctx, cache.ring[0], query, own,
                             layer.keep_ring_block, scale=scaling)  # (B, Hq, T, D) fp32
        return out.transpose(1, 2).to(query.dtype).contiguous(), None  # (B, T, Hq, D)
    if layer is None or layer.mode == "prefill":
        real = _real_keys(attention_mask, key.shape[0])
        if layer is not None and real is not None:
            layer.drop_padding(real)  # a left-padded batch: keep the real tokens only
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, **kwargs)
    attn = layer.cache.attention
    if scaling is not None and attn.scale is None:
        attn.scale = float(scaling)  # the model's own score scale, on every rank alike
    q = query[:, :, 0]  # (B, Hq, D)
    out = attn(q, key, value, kv_len=layer.kv_len())  # (B, Hq, D), every rank
    return out[:, None], None  # (B, 1, Hq, D)


def _real_keys(mask, batch: int) -> torch.Tensor | None:
    """(B, S) bool: the keys the prompt's last query attends to, when some are masked (the
    padding of a left-padded batch); None when every key counts."""
    if mask is None or not isinstance(mask, torch.Tensor):
        return None
    attends = mask if mask.dtype == torch.bool else mask == 0
    last = attends[:, 0, -1, :].expand(batch, -1)  # (B, S)
    return None if bool(last.all()) else last


def register() -> None:
    """Register ``"treeattn"`` with transformers' attention and mask interfaces (idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, treeattn_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)



class RankZeroScores:
    """A transformers logits processor that gives every rank rank 0's scores.

    Greedy decoding needs nothing: every algorithm leaves the same merged attention on every
    rank up to the last bit, and argmax ties are vanishingly rare. Sampling draws on each rank
    from its own generator; seeded alike (``torch.manual_seed`` on every rank), ranks draw the
    same token only from bit-identical scores, which this makes sure of (one broadcast of
    (B, vocab) floats per step). Pass it as ``model.generate(..., logits_processor=
    [treeattn.hf.RankZeroScores()])``; with the cache on a process subgroup, pass that group
    (its first member's scores are used).
    """

    def __init__(self, group=None) -> None:
        self.group = group

    def __call__(self, input_ids, scores):
        import torch.distributed as dist

        scores = scores.contiguous()
        src = 0 if self.group is None else dist.get_global_rank(self.group, 0)
        dist.broadcast(scores, src=src, group=self.group)
        return scores
