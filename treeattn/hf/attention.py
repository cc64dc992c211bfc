"""The ``"treeattn"`` attention implementation for transformers, and its mask function.

transformers calls an attention implementation as ``fn(module, query (B, Hq, S, D), key,
value, attention_mask, scaling=..., dropout=..., **kwargs)`` right after the layer's
``cache.update``, with whatever that update returned. With a
:class:`~treeattn.hf.cache.ShardedCache`, the layer that was just updated says which step this
is (``ShardedLayer.mode``):

- **ring** (:func:`treeattn.hf.sharded_prefill`): ``query``/``key``/``value`` are this
  rank's prompt chunks; their causal attention over every earlier position is the pass-KV
  ring (:func:`treeattn.runtime.prefill.ring.ring_attention`), by global positions (the
  mask transformers built for the chunk alone is not used);
- **prefill**: ``key``/``value`` are the whole prompt's (replicated prefill): ordinary SDPA
  with the causal (and padding) mask, exact;
- **append** (a second turn): ``key``/``value`` are the new tokens'; their queries attend
  to every rank's earlier shard and, on the first rank, to themselves, merged across ranks;
- **decode**: ``key``/``value`` are this rank's shard; the query's attention over every
  rank's shard is :class:`treeattn.ShardedAttention`, by the plan's schedule. A decode step's
  mask is all-true over the real tokens, which are all the cache keeps: at a left-padded
  prefill the mask's last row told the layer which prompt positions are padding, and the
  layer dropped them (``ShardedLayer.drop_padding``), so each sequence attends to its own
  tokens (``kv_len``).

A sliding-window or chunked layer (:class:`~treeattn.hf.window.WindowLayer`) is whole on
every rank and attended locally with transformers' mask (in a sharded prefill, over the keys
its queries see, gathered round the ring). Logit soft-capping and attention sinks take the
model's own eager attention where the K/V are whole, and a capped partial merged by
log-sum-exp (the sink joining after the merge) where they are sharded. Every call claims the
cache update just before it (:func:`~treeattn.hf.claims.claim`): once per update, or refused.

Without a ``ShardedCache`` (e.g. a forward with ``use_cache=False``) it is plain SDPA. The
mask function registered beside it is transformers' SDPA mask: transformers ignores the mask
of an attention implementation that registers none.
"""

from __future__ import annotations

import sys

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from treeattn.hf.cache import ShardedLayer
from treeattn.hf.claims import claim
from treeattn.hf.support import HFIntegrationError
from treeattn.hf.window import WindowLayer
from treeattn.runtime.prefill.ring import ring_attention

ATTENTION_NAME = "treeattn"


def treeattn_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask, dropout: float = 0.0, scaling: float | None = None,
                       **kwargs):
    """Attention of ``query`` (B, Hq, S, D); returns ``(out (B, S, Hq, D), None)``."""
    layer = claim(module, key)
    if isinstance(layer, WindowLayer) and layer.mode == "ring":
        return _window_ring(layer, module, query, key, value, dropout, scaling, kwargs)
    if not isinstance(layer, ShardedLayer):  # no cache, or a bounded layer: whole here
        return local_attention(module, query, key, value, attention_mask, dropout, scaling,
                               kwargs)
    softcap, sinks = _softcap(kwargs), _sinks(module, kwargs)
    if layer.mode == "ring" and (softcap is not None or sinks is not None):
        return _ring_capped(layer, query, key, value, scaling, softcap, sinks)
    if layer.mode == "ring":
        cache = layer.cache
        own = torch.stack([key, value])  # (2, B, Hkv, T, D)
        out = ring_attention(cache.attention.ctx, cache.ring[0], query, own,
                             layer.keep_ring_block, scale=scaling)  # (B, Hq, T, D) fp32
        return out.transpose(1, 2).to(query.dtype).contiguous(), None  # (B, T, Hq, D)
    if layer.mode == "prefill":
        real = _real_keys(attention_mask, key.shape[0])
        if real is not None:
            layer.drop_padding(real)  # a left-padded batch: keep the real tokens only
        return local_attention(module, query, key, value, attention_mask, dropout, scaling,
                               kwargs)
    if layer.mode == "append":
        return _append(layer, query, key, value, scaling, softcap, sinks)
    _check_decode_mask(layer, attention_mask)
    attn = layer.cache.attention
    if scaling is not None and attn.scale is None:
        attn.scale = float(scaling)  # the model's own score scale, on every rank alike
    q = query[:, :, 0]  # (B, Hq, D)
    if softcap is None and sinks is None and attn.world > 1:
        out = attn(q, key, value, kv_len=layer.kv_len())  # (B, Hq, D), every rank
        return out[:, None], None  # (B, 1, Hq, D)
    scale = attn.scale if attn.scale is not None else q.shape[-1] ** -0.5
    o, lse = _partial(q, key, value, scale, softcap, layer.kv_len())
    if attn.world > 1:  # a group of one holds the whole cache: its partial is the answer
        o, lse = attn.reduce(o, lse, lse_base="e", scale=scale)  # (B, Hq, D), (B, Hq)
    if sinks is not None:  # a sink logit per head joins the softmax's denominator
        sink = sinks.float().reshape(1, -1).to(lse.device)  # (1, Hq)
        o = o * torch.exp(lse - torch.logaddexp(lse, sink))[..., None]
    return o.to(query.dtype)[:, None], None  # (B, 1, Hq, D)


def _window_ring(layer: WindowLayer, module, query, key, value, dropout, scaling, kwargs):
    """A bounded layer in the sharded prefill: this rank's queries (B, Hq, T, D) over the
    keys they see, gathered from every rank (:meth:`WindowLayer.gather`), by transformers'
    mask rule, attended locally."""
    positions, kv = layer.gather(torch.stack([key, value]))  # (2, B, Hkv, m, D)
    ring = layer.cache.ring[0]
    q_pos = torch.tensor(ring.positions(layer.cache.rank, queries=True), device=query.device)
    k_pos = torch.tensor(positions, device=query.device)
    mask = layer.sees(q_pos, k_pos)[None, None].expand(query.shape[0], 1, -1, -1)  # (B,1,T,m)
    return local_attention(module, query, kv[0], kv[1], mask, dropout, scaling, kwargs)


def _ring_capped(layer: ShardedLayer, query, key, value, scaling, softcap, sinks):
    """A full layer's sharded prefill with soft-capped logits or sinks: the pass-KV ring
    carries the blocks (and the layer keeps its positions of each), and this rank's queries
    (B, Hq, T, D) attend to each block they see as it passes, by global positions, merged by
    log-sum-exp; a sink then joins each query's denominator."""
    cache = layer.cache
    layout, rank = cache.ring[0], cache.rank
    b, hq, t, d = query.shape
    scale = scaling if scaling is not None else d ** -0.5
    q_pos = torch.tensor(layout.positions(rank, queries=True), device=query.device)  # (T,)
    acc = [torch.zeros(b, hq, t, d, dtype=torch.float32, device=query.device),
           torch.full((b, hq, t), float("-inf"), dtype=torch.float32, device=query.device)]

    def keep(src: int, block: torch.Tensor) -> None:
        layer.keep_ring_block(src, block)
        if t and layout.sees(rank, src):
            k_pos = torch.tensor(layout.positions(src), device=query.device)  # (S,)
            o, lse = _block_partial(query, block[0], block[1], q_pos, k_pos, scale, softcap)
            acc[:] = _merge(acc[0], acc[1], o, lse)

    ring_attention(cache.attention.ctx, layout, query[:, :, :0], torch.stack([key, value]),
                   keep)
    o, lse = acc
    if sinks is not None:
        sink = sinks.float().reshape(1, -1, 1).to(lse.device)  # (1, Hq, 1)
        o = o * torch.exp(lse - torch.logaddexp(lse, sink))[..., None]
    return o.transpose(1, 2).to(query.dtype).contiguous(), None  # (B, T, Hq, D)


def _append(layer: ShardedLayer, query, key, value, scaling, softcap, sinks):
    """A second turn: the new tokens' queries (B, Hq, S, D) over every rank's earlier shard
    (all of it in their past) and, on the group's first rank only, over the new tokens
    themselves (causally; every rank holds them whole), merged across the ranks."""
    cache = layer.cache
    attn = cache.attention
    b, hq, s, d = query.shape
    scale = scaling if scaling is not None else d ** -0.5
    new_pos = torch.arange(s, device=query.device) + layer.total - s  # (S,)
    k_old, v_old = (t[:, :, : layer.before] for t in layer.shard())  # (B, Hkv, n, D)
    past = torch.zeros(k_old.shape[2], dtype=torch.long, device=query.device)
    o, lse = _block_partial(query, k_old, v_old, new_pos, past, scale, softcap)
    if cache.rank == 0:
        o2, lse2 = _block_partial(query, key, value, new_pos, new_pos, scale, softcap)
        o, lse = _merge(o, lse, o2, lse2)
    if attn.world > 1:  # each query a row of the merge: (B * S, Hq, D)
        flat_o = o.permute(0, 2, 1, 3).reshape(b * s, hq, d)
        flat_lse = lse.permute(0, 2, 1).reshape(b * s, hq)
        flat_o, flat_lse = attn.reduce(flat_o, flat_lse, lse_base="e", scale=scale)
        o = flat_o.reshape(b, s, hq, d).permute(0, 2, 1, 3)
        lse = flat_lse.reshape(b, s, hq).permute(0, 2, 1)
    if sinks is not None:
        sink = sinks.float().reshape(1, -1, 1).to(lse.device)  # (1, Hq, 1)
        o = o * torch.exp(lse - torch.logaddexp(lse, sink))[..., None]
    return o.transpose(1, 2).to(query.dtype).contiguous(), None  # (B, S, Hq, D)


def _block_partial(q, k, v, q_pos, k_pos, scale: float, softcap: float | None):
    """Causal partial of ``q`` (B, Hq, T, D) at ``q_pos`` over ``k``, ``v`` (B, Hkv, S, D)
    at ``k_pos``, logits soft-capped: ``o`` (B, Hq, T, D), ``lse`` (B, Hq, T) fp32."""
    b, hq, t, d = q.shape
    hkv = k.shape[1]
    qg = q.float().reshape(b, hkv, hq // hkv, t, d)  # (B, Hkv, G, T, D)
    scores = torch.einsum("bhgtd,bhsd->bhgts", qg, k.float()) * scale  # (B, Hkv, G, T, S)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    seen = k_pos[None, :] <= q_pos[:, None]  # (T, S)
    scores = scores.masked_fill(~seen, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # (B, Hkv, G, T)
    weights = torch.exp(scores - lse[..., None]).nan_to_num(0.0)
    o = torch.einsum("bhgts,bhsd->bhgtd", weights, v.float())
    return o.reshape(b, hq, t, d), lse.reshape(b, hq, t)


def _merge(o1, lse1, o2, lse2):
    """Two partials of the same queries merged by log-sum-exp (a side may be empty: -inf)."""
    lse = torch.logaddexp(lse1, lse2)
    w1 = torch.exp(lse1 - lse).nan_to_num(0.0)[..., None]
    w2 = torch.exp(lse2 - lse).nan_to_num(0.0)[..., None]
    return o1 * w1 + o2 * w2, lse


def _softcap(kwargs):
    value = kwargs.get("softcap")
    return float(value) if value else None


def _sinks(module, kwargs):
    sinks = kwargs.get("s_aux")
    return sinks if sinks is not None else getattr(module, "sinks", None)


def local_attention(module, query, key, value, attention_mask, dropout, scaling, kwargs):
    """Attention over K/V whole on this rank, as transformers computes it: SDPA, or the
    model's own eager attention where it soft-caps the logits or adds sinks (SDPA does
    neither), with the boolean mask made additive."""
    if _softcap(kwargs) is None and _sinks(module, kwargs) is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, **kwargs)
    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if eager is None:
        raise HFIntegrationError(f"{type(module).__name__} soft-caps its logits or adds sinks "
                                 "without an eager attention of its own")
    s, n = query.shape[2], key.shape[2]
    if attention_mask is None:  # SDPA's causal shortcut: the keys end at the queries
        attention_mask = torch.ones(s, n, dtype=torch.bool, device=query.device).tril(n - s)
        attention_mask = attention_mask[None, None]
    if attention_mask.dtype == torch.bool:
        low = torch.finfo(query.dtype).min
        attention_mask = torch.zeros(attention_mask.shape, dtype=query.dtype,
                                     device=query.device).masked_fill(~attention_mask, low)
    return eager(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                 **kwargs)


def _partial(q, k, v, scale: float, softcap: float | None, kv_len):
    """This rank's partial of ``q`` (B, Hq, D) over its shard ``k``, ``v`` (B, Hkv, T, D),
    logits soft-capped (``softcap * tanh(s / softcap)``, Gemma 2's); ``kv_len`` (B,): valid
    keys per sequence. Returns ``o`` (B, Hq, D) and natural-log ``lse`` (B, Hq), fp32; a
    rank without keys gives (0, -inf)."""
    b, hq, d = q.shape
    hkv, t = k.shape[1], k.shape[2]
    qg = q.float().reshape(b, hkv, hq // hkv, d)  # (B, Hkv, G, D)
    scores = torch.einsum("bhgd,bhtd->bhgt", qg, k.float()) * scale  # (B, Hkv, G, T)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if kv_len is not None:
        valid = torch.arange(t, device=k.device)[None, :] < kv_len.to(k.device)[:, None]  # (B, T)
        scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # (B, Hkv, G)
    weights = torch.exp(scores - lse[..., None]).nan_to_num(0.0)  # (B, Hkv, G, T)
    o = torch.einsum("bhgt,bhtd->bhgd", weights, v.float())  # (B, Hkv, G, D)
    return o.reshape(b, hq, d), lse.reshape(b, hq)


def _check_decode_mask(layer: ShardedLayer, mask) -> None:
    """The decode step's mask must say what the prefill said: per sequence, the real tokens
    the layer holds (the mask given to ``generate`` matches the prefill's)."""
    total = layer.total
    if mask is None or not isinstance(mask, torch.Tensor):
        if any(r != total for r in layer.real):
            raise HFIntegrationError(
                f"{layer.cache.name}: the prompt was prefilled with padding, and generate got "
                "no attention_mask: pass generate the prefill's mask")
        return
    attends = mask if mask.dtype == torch.bool else mask == 0
    if attends.shape[-1] != total:
        raise HFIntegrationError(f"{layer.cache.name}: a mask of {attends.shape[-1]} "
                                 f"positions at a decode step over {total}")
    counts = attends[:, 0, -1, :].expand(len(layer.real), -1).sum(-1).tolist()  # (B,)
    if counts != layer.real:
        raise HFIntegrationError(
            f"{layer.cache.name}: the attention_mask given to generate marks {counts} real "
            f"tokens, and the prefill kept {layer.real}: pass generate the prefill's mask")


def _real_keys(mask, batch: int) -> torch.Tensor | None:
    """(B, S) bool: the keys the prompt's last query attends to, when some are masked (the
    padding of a left-padded batch); None when every key counts."""
    if mask is None or not isinstance(mask, torch.Tensor):
        return None
    attends = mask if mask.dtype == torch.bool else mask == 0
    last = attends[:, 0, -1, :].expand(batch, -1)  # (B, S)
    return None if bool(last.all()) else last


def register() -> None:
    """Register ``"treeattn"`` with transformers' attention and mask interfaces, and as a
    named refusal in the attention tables of the models that keep their own (so that loading
    one with ``attn_implementation="treeattn"`` says why, not ``KeyError``). Idempotent."""
    import importlib

    AttentionInterface.register(ATTENTION_NAME, treeattn_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
    for name, (module, table) in OWN_ATTENTION_TABLES.items():
        classes = getattr(importlib.import_module(module), table, None)
        if isinstance(classes, dict):
            classes.setdefault(ATTENTION_NAME, _Refused(name))


# Models that pick their attention class from a table of their own, by implementation name.
OWN_ATTENTION_TABLES = {
    "falcon": ("transformers.models.falcon.modeling_falcon", "FALCON_ATTENTION_CLASSES"),
    "gpt_neo": ("transformers.models.gpt_neo.modeling_gpt_neo", "GPT_NEO_ATTENTION_CLASSES"),
}


class _Refused:
    """Stands for treeattn in a model's own attention table: building it refuses the model."""

    def __init__(self, model_type: str) -> None:
        self.model_type = model_type

    def __call__(self, *args, **kwargs):
        from treeattn.hf.support import REFUSED_MODEL_TYPES

        raise HFIntegrationError(f"{self.model_type} is not served by treeattn: "
                                 f"{REFUSED_MODEL_TYPES[self.model_type]}")



class RankZeroScores:
    """A transformers logits processor that gives every rank rank 0's scores.

    Not needed for rank-consistent decoding: every algorithm leaves the same merged attention
    on every rank up to the last bit, and the cache gives every rank rank 0's random state at
    each forward (``ShardedCache.share_rng``), so ranks sample alike. This makes the scores
    themselves the same by construction too (one broadcast of (B, vocab) floats per step).
    Pass it as ``model.generate(..., logits_processor=[treeattn.hf.RankZeroScores()])``;
    with the cache on a process subgroup, pass that group (its first member's scores are
    used).
    """

    def __init__(self, group=None) -> None:
        self.group = group

    def __call__(self, input_ids, scores):
        import torch.distributed as dist

        scores = scores.contiguous()
        src = 0 if self.group is None else dist.get_global_rank(self.group, 0)
        dist.broadcast(scores, src=src, group=self.group)
        return scores
