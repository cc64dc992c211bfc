"""Long-context mode: fill the KV cache with a long repeated document, cheaply and exactly.

A full causal prefill of ``L`` tokens costs O(L²) attention FLOPs, minutes for L = 32k on two
CPU cores. Here the document is one text *segment* of ``S`` tokens repeated ``⌈L/S⌉`` times,
and every copy is encoded on its own (a block-diagonal mask, as for packed sequences) at its
global positions. With RoPE, attention inside a copy depends only on relative positions, so
every copy's values ``V`` equal the first copy's, and its keys are the first copy's keys
rotated further by the copy's start position. The cache for positions ``lo..hi-1`` is then
one segment prefill plus a gather and a rotation: O(S² + L).

Single-process and distributed runs build their caches with the same function, position by
position, so their caches hold identical values.
"""

from __future__ import annotations

import torch

from treeattn.llm.local_cache import LocalCache, prefill
from treeattn.llm.model import Transformer, apply_rope, rope_cos_sin

# An original filler text; any text works, this one just reads like a document.
DOCUMENT = (
    "The lighthouse keeper kept a ledger of every ship that passed the northern cape. "
    "Each entry listed the hour, the wind, the colour of the hull and the number of masts. "
    "In winter the entries were short, because fog hid most vessels and the keeper wrote "
    "only what the horn told him. In summer the ledger filled quickly: fishing boats left "
    "at dawn, cargo ships crossed at noon, and in the evening small sailing boats raced "
    "back to the harbour before the tide turned. The keeper's daughter later copied the "
    "ledgers into a single book, adding a map of the coast, a table of tides for every "
    "month, and notes on the storms that had wrecked the old pier twice in one decade. "
    "Visitors to the museum in the village can still read the book, which opens with a "
    "list of the lamps used in the tower: oil first, then kerosene, then electric light. "
)
SEGMENT_REPEATS = 6  # the segment is this many copies of DOCUMENT (a few hundred tokens)


def segment_kv(model: Transformer, segment: list[int]):
    """Per-layer K (rotated at positions ``0..S-1``) and V of one encoded segment.

    Returns ``(ks, vs)``: lists over layers of (1, Hkv, S, D) tensors.
    """
    cache = LocalCache(model.config.n_layers)
    prefill(model, segment, cache)
    s = len(segment)
    ks = [k[:, :, :s].clone() for k in cache.k]  # each (1, Hkv, S, D)
    vs = [v[:, :, :s].clone() for v in cache.v]
    return ks, vs


def context_kv(ks, vs, inv_freq: torch.Tensor, lo: int, hi: int):
    """K/V of the repeated document at positions ``lo..hi-1``, per layer (1, Hkv, hi-lo, D)."""
    s, device = ks[0].shape[2], ks[0].device
    pos = torch.arange(lo, hi, device=device)  # (n,)
    src = pos % s  # position inside the segment
    cos, sin = rope_cos_sin(inv_freq.to(device), pos - src)  # (n, D/2): each copy's rotation
    out_k = [apply_rope(k[:, :, src], cos, sin) for k in ks]  # each (1, Hkv, n, D)
    out_v = [v[:, :, src].clone() for v in vs]  # each (1, Hkv, n, D)
    return out_k, out_v


def fill_document(cache, model: Transformer, segment: list[int], length: int) -> None:
    """Store ``length`` tokens of the repeated ``segment`` at positions ``0..length-1``."""
    ks, vs = segment_kv(model, segment)
    ks, vs = context_kv(ks, vs, model.inv_freq, 0, length)
    for layer, (k, v) in enumerate(zip(ks, vs, strict=True)):
        cache.store(layer, k, v, 0)


def document_segment(tokenizer) -> list[int]:
    """The token ids of one segment of the synthetic document."""
    return tokenizer.encode(DOCUMENT * SEGMENT_REPEATS)
