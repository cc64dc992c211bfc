"""Single-process greedy generation over a local KV cache.

:class:`LocalCache` is the attention backend of one process: it stores every layer's K/V and
answers a multi-token chunk (prefill) with causal ``scaled_dot_product_attention``, and a
one-token decode step with ``treeattn.kernels.partial_attention`` over the whole cache, the
very kernel each rank runs on its shard in the distributed path
(:mod:`treeattn.llm.generate_dist`). :func:`greedy_decode` is the loop both paths share.
"""

from __future__ import annotations

import time
from collections.abc import Callable
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


@dataclass
class Generation:
    """What a generation produced: new token ids, the logits each was picked from, timings.

    ``decode_s`` and ``attention_s`` cover the ``steps`` decode forwards (one fewer than the
    tokens: the first token comes from the prefill's logits); ``attention_steps`` holds each
    forward's attention time (all layers).
    """

    tokens: list[int]
    logits: list[torch.Tensor]
    prefill_s: float
    decode_s: float
    attention_s: float
    attention_steps: list[float] = field(default_factory=list)

    @property
    def steps(self) -> int:
        return max(0, len(self.tokens) - 1)

    @property
    def tokens_per_s(self) -> float:
        return self.steps / self.decode_s if self.steps and self.decode_s > 0 else float("nan")

    @property
    def attention_per_token_s(self) -> float:
        return self.attention_s / self.steps if self.steps else float("nan")

    @property
    def attention_median_s(self) -> float:
        """Median attention time of one decode step: robust to a slow first step."""
        steps = sorted(self.attention_steps)
        return steps[len(steps) // 2] if steps else float("nan")


@torch.no_grad()
def greedy_decode(model, backend, first_logits, start, max_new_tokens, eos_id=None,
                  on_token: Callable[[int], None] | None = None, choose=None):
    """Greedy loop from ``first_logits`` (1, V); the next token sits at position ``start``.

    ``choose(logits) -> int`` picks the token (default: argmax; the distributed path makes
    every rank agree on rank 0's choice). Returns ``(tokens, logits, attention_steps)``, the
    last from the growth of ``backend.attention_s`` over each forward.
    """
    choose = choose or (lambda lg: int(torch.argmax(lg[0])))
    tokens, logits_seen, attention_steps = [], [], []
    logits = first_logits
    for step in range(max_new_tokens):
        token = choose(logits)
        tokens.append(token)
        logits_seen.append(logits[0].clone())
        if on_token is not None:
            on_token(token)
        if token == eos_id or step == max_new_tokens - 1:
            break
        ids = torch.tensor([[token]], dtype=torch.long, device=model_device(model))  # (1, 1)
        before = backend.attention_s
        logits = model(ids, start + step, backend)  # (1, V)
        attention_steps.append(backend.attention_s - before)
    return tokens, logits_seen, attention_steps


def check_request(model: Transformer, prompt_ids: list[int], max_new_tokens: int,
                  context_tokens: int = 0) -> None:
    """Raise ModelError for an empty prompt, a non-positive budget or too long a context."""
    if not prompt_ids:
        raise ModelError("the prompt is empty")
    if max_new_tokens <= 0:
        raise ModelError(f"--max-new-tokens must be positive, got {max_new_tokens}")
    if context_tokens < 0:
        raise ModelError(f"--context-tokens must be positive, got {context_tokens}")
    total = context_tokens + len(prompt_ids) + max_new_tokens
    if not context_tokens and total > model.config.max_seq_len:
        raise ModelError(f"prompt + new tokens = {total} exceed the model's context of "
                         f"{model.config.max_seq_len}")


def generate_local(model: Transformer, prompt_ids: list[int], max_new_tokens: int,
                   eos_id: int | None = None, on_token=None, context_tokens: int = 0,
                   segment: list[int] | None = None) -> Generation:
    """Prefill ``prompt_ids`` (after ``context_tokens`` of document) and decode greedily here.

    With ``context_tokens`` > 0 the cache first holds that many tokens of the repeated
    document ``segment`` (:mod:`treeattn.llm.generate_context`), and the prompt is
    prefilled after it.
    """
    check_request(model, prompt_ids, max_new_tokens, context_tokens)
    total = context_tokens + len(prompt_ids) + max_new_tokens
    backend = LocalCache(model.config.n_layers, capacity=total)
    t0 = time.perf_counter()
    if context_tokens:
        from treeattn.llm.generate_context import fill_document

        fill_document(backend, model, segment, context_tokens)
    logits = prefill(model, prompt_ids, backend, start=context_tokens)
    t1 = time.perf_counter()
    backend.attention_s = 0.0
    start = context_tokens + len(prompt_ids)
    tokens, seen, steps = greedy_decode(model, backend, logits, start, max_new_tokens, eos_id,
                                        on_token)
    t2 = time.perf_counter()
    return Generation(tokens, seen, t1 - t0, t2 - t1, backend.attention_s, steps)
