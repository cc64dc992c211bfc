"""One process's KV cache: the attention backend of single-process prefill and decoding.

:class:`LocalCache` stores every layer's K/V and answers a multi-token chunk (prefill) with
causal ``scaled_dot_product_attention``, and a one-token decode step with
``treeattn.kernels.partial_attention`` over the whole cache, the very kernel each rank runs on
its shard in the distributed path (:mod:`treeattn.llm.generate_dist`). :func:`prefill` runs a
prompt through the model in chunks. Both generation paths and the long-context fill
(:mod:`treeattn.llm.generate_context`) build on this module.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from treeattn.kernels import partial_attention
from treeattn.llm.errors import ModelError
from treeattn.llm.model import Transformer

PREFILL_CHUNK = 1024  # tokens per prefill forward: bounds the (chunk x context) score matrix


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int):
    """Attention of ``q`` (B, Hq, T, D) at positions ``start..`` over keys ``0..S-1``.

    ``k``, ``v`` are (B, Hkv, S, D) with ``S = start + T``; query ``i`` sees keys ``≤ start+i``.
    The ``G = Hq / Hkv`` query heads of a group are stacked along T, so K and V are read as
    they are, never repeated per query head.
    """
    b, hq, t, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    group = hq // hkv
    q_pos = torch.arange(start, start + t, device=q.device)[:, None]  # (T, 1)
    mask = torch.arange(s, device=q.device)[None, :] <= q_pos  # (T, S)
    qg = q.reshape(b, hkv, group * t, d)  # (B, Hkv, G*T, D): query heads h*G+g, then T
    o = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask.repeat(group, 1))
    return o.reshape(b, hq, t, d)  # (B, Hq, T, D)


@dataclass
class LocalCache:
    """A whole KV cache in one process; implements :class:`AttentionBackend`.

    ``k[l]``/``v[l]`` are (B, Hkv, capacity, D), allocated at ``capacity`` tokens (when
    known) and grown by doubling; ``attention_s`` sums the time spent in decode attention.
    """

    n_layers: int
    capacity: int = 0
    k: list = field(default_factory=list)
    v: list = field(default_factory=list)
    length: int = 0
    attention_s: float = 0.0

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        end = start + k.shape[2]
        if layer >= len(self.k):
            cap = max(end, self.capacity, 16)
            self.k.append(k.new_zeros(*k.shape[:2], cap, k.shape[3]))
            self.v.append(v.new_zeros(*v.shape[:2], cap, v.shape[3]))
        if end > self.k[layer].shape[2]:
            grow = max(end, 2 * self.k[layer].shape[2])
            for store in (self.k, self.v):
                bigger = store[layer].new_zeros(*k.shape[:2], grow, k.shape[3])
                bigger[:, :, :start] = store[layer][:, :, :start]
                store[layer] = bigger
        self.k[layer][:, :, start:end] = k  # (B, Hkv, T, D)
        self.v[layer][:, :, start:end] = v
        if layer == self.n_layers - 1:
            self.length = end

    def attend(self, layer, q, k, v, start):
        self.store(layer, k, v, start)
        end = start + k.shape[2]
        keys, values = self.k[layer][:, :, :end], self.v[layer][:, :, :end]  # (B, Hkv, S, D)
        if q.shape[2] > 1:
            return causal_attention(q, keys, values, start)
        t0 = time.perf_counter()
        o, _ = partial_attention(q[:, :, 0], keys, values)  # (B, Hq, D) fp32
        self.attention_s += time.perf_counter() - t0
        return o.to(q.dtype)[:, :, None]  # (B, Hq, 1, D)


def model_device(model: Transformer) -> torch.device:
    return model.tok_embeddings.weight.device


@torch.no_grad()
def prefill(model: Transformer, tokens: list[int], backend, start: int = 0,
            chunk: int = PREFILL_CHUNK) -> torch.Tensor:
    """Run ``tokens`` through the model in chunks; return the last token's logits (1, V)."""
    if not tokens:
        raise ModelError("the prompt is empty")
    ids = torch.tensor([tokens], dtype=torch.long, device=model_device(model))  # (1, T)
    logits = None
    for lo in range(0, len(tokens), chunk):
        logits = model(ids[:, lo : lo + chunk], start + lo, backend)  # (1, V)
    return logits
