"""Single-process generation over a local KV cache.

:func:`generate_local` prefills and decodes in one process on a
:class:`~treeattn.llm.local_cache.LocalCache`; :func:`greedy_decode` is the loop it shares
with the distributed path (:mod:`treeattn.llm.generate_dist`). Greedy by default; a
``choose`` callback (a :class:`treeattn.llm.options.Sampler`) samples instead.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from treeattn.llm.errors import ModelError
from treeattn.llm.generate_context import fill_document
from treeattn.llm.local_cache import LocalCache, model_device, prefill
from treeattn.llm.model import Transformer


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
                  on_token: Callable[[int], None] | None = None, choose=None, step=None):
    """Decode loop from ``first_logits`` (1, V); the next token sits at position ``start``.

    ``choose(logits) -> int`` picks the token (default: argmax; a sampler draws instead, and
    the distributed path makes every rank agree on rank 0's choice). ``step(token,
    position) -> logits`` replaces the model's forward over ``backend`` (the CUDA-graph
    decoder of :mod:`treeattn.llm.static_decode`). Returns ``(tokens, logits,
    attention_steps)``, the last from the growth of ``backend.attention_s`` over each
    forward.
    """
    choose = choose or (lambda lg: int(torch.argmax(lg[0])))
    tokens, logits_seen, attention_steps = [], [], []
    logits = first_logits
    for index in range(max_new_tokens):
        token = choose(logits)
        tokens.append(token)
        logits_seen.append(logits[0].clone())
        if on_token is not None:
            on_token(token)
        if token == eos_id or index == max_new_tokens - 1:
            break
        before = backend.attention_s
        if step is None:
            ids = torch.tensor([[token]], dtype=torch.long, device=model_device(model))  # (1, 1)
            logits = model(ids, start + index, backend)  # (1, V)
        else:
            logits = step(token, start + index)  # (1, V)
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
                   segment: list[int] | None = None, choose=None) -> Generation:
    """Prefill ``prompt_ids`` (after ``context_tokens`` of document) and decode here.

    Greedy unless ``choose`` (logits (1, V) -> token) picks otherwise; the model may sit on
    any device and in any dtype (:func:`treeattn.llm.options.place_model`).

    With ``context_tokens`` > 0 the cache first holds that many tokens of the repeated
    document ``segment`` (:mod:`treeattn.llm.generate_context`), and the prompt is
    prefilled after it.
    """
    check_request(model, prompt_ids, max_new_tokens, context_tokens)
    total = context_tokens + len(prompt_ids) + max_new_tokens
    backend = LocalCache(model.config.n_layers, capacity=total)
    t0 = time.perf_counter()
    if context_tokens:
        fill_document(backend, model, segment, context_tokens)
    logits = prefill(model, prompt_ids, backend, start=context_tokens)
    t1 = time.perf_counter()
    backend.attention_s = 0.0
    start = context_tokens + len(prompt_ids)
    tokens, seen, steps = greedy_decode(model, backend, logits, start, max_new_tokens, eos_id,
                                        on_token, choose)
    t2 = time.perf_counter()
    return Generation(tokens, seen, t1 - t0, t2 - t1, backend.attention_s, steps)
