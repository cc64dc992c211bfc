"""Decoding over a fixed-size KV cache, and the decode step captured as one CUDA graph.

At batch 1 a small model's decode step is a few hundred small kernels (SmolLM2: 30 layers of
norms, projections, rotations, attention and MLP). On a GPU the host then spends longer
launching them, one Python call at a time, than the GPU spends running them. A CUDA graph
records the step once and replays it with a single launch. It can only hold a step whose
shapes and addresses never change, so everything that moves from one token to the next is
read from a device tensor instead of from Python:

- each layer's cache is allocated once at its full capacity, (B, Hkv, C, D);
- the new token's K and V are written at the position held in :attr:`StaticCache.position`
  (``index_copy_``), and the rotations read the same tensor
  (``Transformer.forward(positions=...)``);
- the attention reads the whole buffer with ``kv_len = position + 1`` (a device tensor), so the
  kernel's grid and the merge's shapes are fixed; the splits past ``kv_len`` are empty.

:class:`StaticCache` does this eagerly on any device: the tests compare it with
:class:`~treeattn.llm.local_cache.LocalCache` on CPU. :class:`StaticDecoder` replays a captured
graph of the step on CUDA when asked to.
"""

from __future__ import annotations

import time

import torch

from treeattn.kernels import partial_attention
from treeattn.llm.errors import ModelError
from treeattn.llm.generate import Generation, greedy_decode
from treeattn.llm.local_cache import causal_attention, model_device, prefill
from treeattn.llm.model import Transformer
from treeattn.llm.options import body_dtype

WARMUP_STEPS = 2  # eager runs before capture: Triton's autotuning and lazy inits happen here


class StaticCache:
    """Every layer's K/V in buffers of a fixed ``capacity``; an :class:`AttentionBackend`.

    Prefill (any chunk, even of one token) is written and attended at the host-side ``start``
    as in ``LocalCache``. A decode step (:attr:`stepping`) is written at :attr:`position` and
    attends over
    ``kv_len`` = position + 1 tokens of the full buffer, both device tensors, so the step
    never changes shape; :meth:`set_position` moves them before each step.
    """

    def __init__(self, model: Transformer, capacity: int, batch: int = 1) -> None:
        cfg = model.config
        device, dtype = model_device(model), body_dtype(model)
        shape = (batch, cfg.n_kv_heads, capacity, cfg.head_dim)  # (B, Hkv, C, D)
        self.capacity = capacity
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.n_layers)]
        self.position = torch.zeros(1, dtype=torch.long, device=device)  # (1,): next slot
        self.kv_len = torch.ones(batch, dtype=torch.int32, device=device)  # (B,): position + 1
        self.attention_s = 0.0  # unused here: a graph's attention cannot be timed apart
        self.stepping = False  # inside a decode step: positions come from the device tensors

    def set_position(self, position: int) -> None:
        """Place the next one-token step at ``position`` (two tiny device fills, no sync)."""
        if not 0 <= position < self.capacity:
            raise ModelError(f"position {position} is outside the cache's {self.capacity} slots")
        self.position.fill_(position)
        self.kv_len.fill_(position + 1)

    def attend(self, layer, q, k, v, start):
        t = q.shape[2]
        if not self.stepping:  # prefill (a chunk may be one token): positions on the host
            end = start + t
            if end > self.capacity:
                raise ModelError(f"{end} tokens do not fit the cache's {self.capacity} slots")
            self.k[layer][:, :, start:end] = k  # (B, Hkv, T, D)
            self.v[layer][:, :, start:end] = v
            keys, values = self.k[layer][:, :, :end], self.v[layer][:, :, :end]
            return causal_attention(q, keys, values, start)
        self.k[layer].index_copy_(2, self.position, k)  # k (B, Hkv, 1, D) into slot `position`
        self.v[layer].index_copy_(2, self.position, v)
        o, _ = partial_attention(q[:, :, 0], self.k[layer], self.v[layer], kv_len=self.kv_len)
        return o.to(q.dtype)[:, :, None]  # (B, Hq, 1, D)


class StaticDecoder:
    """One-token decode steps of ``model`` over a :class:`StaticCache`.

    With ``graph=True`` (CUDA only) the first :meth:`step` runs the step eagerly
    ``WARMUP_STEPS`` times on a side stream, then captures it; every later step fills the token
    and position tensors and replays the graph. The warm-up runs write the same K/V into the
    same slot as the step they precede, so they change nothing.
    """

    def __init__(self, model: Transformer, capacity: int, graph: bool = False) -> None:
        device = model_device(model)
        if graph and device.type != "cuda":
            raise ModelError(f"a CUDA graph needs the model on a CUDA device, not {device.type}")
        self.model, self.use_graph = model, graph
        self.cache = StaticCache(model, capacity)
        self.token = torch.zeros(1, 1, dtype=torch.long, device=device)  # (1, 1)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None  # (1, V): the graph's output buffer

    @torch.no_grad()
    def prefill(self, tokens: list[int]) -> torch.Tensor:
        """Prefill the prompt eagerly; return the last token's logits (1, V)."""
        return prefill(self.model, tokens, self.cache)

    def _forward(self) -> torch.Tensor:
        self.cache.stepping = True  # read while capturing; a replay runs no Python
        try:
            return self.model(self.token, 0, self.cache, positions=self.cache.position)  # (1,V)
        finally:
            self.cache.stepping = False

    @torch.no_grad()
    def step(self, token: int, position: int) -> torch.Tensor:
        """Decode ``token`` at ``position``; return the next logits (1, V) (graph: its buffer)."""
        self.token.fill_(token)
        self.cache.set_position(position)
        if not self.use_graph:
            return self._forward()
        if self.graph is None:
            self._capture()
        self.graph.replay()
        return self.logits

    def _capture(self) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_STEPS):
                self._forward()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self._forward()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def generate_static(model: Transformer, prompt_ids: list[int], max_new_tokens: int,
                    graph: bool = False, eos_id: int | None = None, on_token=None,
                    choose=None) -> Generation:
    """Decoding over a :class:`StaticCache`, eager or (CUDA) by graph replay.

    The tokens of :func:`treeattn.llm.generate.generate_local` (greedy unless ``choose``,
    logits (1, V) -> token, picks otherwise): only the attention's split of the cache
    differs, so logits agree to rounding. The attention of a replayed graph cannot be timed
    apart from the rest of the step, so ``attention_s`` is NaN (reported as unknown).
    """
    if not prompt_ids or max_new_tokens <= 0:
        raise ModelError("need a non-empty prompt and a positive --max-new-tokens")
    device = model_device(model)
    decoder = StaticDecoder(model, len(prompt_ids) + max_new_tokens, graph=graph)
    t0 = time.perf_counter()
    logits = decoder.prefill(prompt_ids)
    _sync(device)
    t1 = time.perf_counter()
    tokens, seen, _ = greedy_decode(model, decoder.cache, logits, len(prompt_ids),
                                    max_new_tokens, eos_id, on_token, choose, step=decoder.step)
    _sync(device)
    return Generation(tokens, seen, t1 - t0, time.perf_counter() - t1, float("nan"))
