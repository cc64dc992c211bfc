"""A compact Llama-family transformer whose attention over the KV cache is pluggable.

RMSNorm, rotary embeddings (with Llama 3 rope scaling), grouped-query attention, a SwiGLU
MLP, and tied or untied embeddings, in the spirit of gpt-fast's ``model.py``.

The model owns no KV cache. Every attention layer hands its new queries, keys and values to a
*backend* (see :class:`AttentionBackend`), which stores the K/V and returns the attention
output: a local cache calling ``treeattn.kernels.partial_attention``
(:class:`treeattn.llm.local_cache.LocalCache`), or the sharded cache whose decode step runs
the plan's schedule across ranks (:mod:`treeattn.llm.generate_dist`).

RoPE here rotates *interleaved* pairs ``(x[2i], x[2i+1])``, GGML's layout. GGUF files store
Q/K that way already; Hugging Face checkpoints rotate half-split pairs ``(x[i], x[i + D/2])``
and are permuted on load (:func:`treeattn.llm.formats.weights.hf_to_interleaved`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from treeattn.llm.errors import ModelError
from treeattn.schedule.workload import MODELS, ModelConfig


@dataclass
class LlamaConfig:
    """Shape and numerics of a Llama-family model; ``head_dim`` is derived."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    hidden_dim: int
    vocab_size: int
    norm_eps: float = 1e-5
    rope_base: float = 10000.0
    max_seq_len: int = 8192
    tie_embeddings: bool = True
    # RoPE scaling as transformers names it: {"rope_type": "linear", "factor"} or Llama 3's
    # {"rope_type": "llama3", factor, low_freq_factor, high_freq_factor,
    # original_max_position_embeddings} (a dict without rope_type is llama3, as GGUF gives it).
    # None means plain RoPE.
    rope_scaling: dict | None = None
    name: str = "custom"
    head_dim: int = field(init=False)

    def __post_init__(self) -> None:
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "hidden_dim", "vocab_size",
                     "max_seq_len"):
            if getattr(self, name) < 1:
                raise ModelError(f"bad model config: {name} is {getattr(self, name)}, "
                                 "must be positive")
        # NaN compares False with everything, so test for the good range, not the bad one
        if not (math.isfinite(self.norm_eps) and self.norm_eps > 0):
            raise ModelError(f"bad model config: rms_epsilon (norm_eps) is {self.norm_eps}, "
                             "must be a finite positive number")
        if not (math.isfinite(self.rope_base) and self.rope_base > 1):
            raise ModelError(f"bad model config: rope.freq_base (rope_base) is "
                             f"{self.rope_base}, must be a finite number above 1")
        if self.dim % self.n_heads or self.n_heads % self.n_kv_heads:
            raise ModelError(
                f"bad model shape: dim {self.dim}, {self.n_heads} heads, "
                f"{self.n_kv_heads} KV heads (need dim % heads == 0 and heads % kv_heads == 0)"
            )
        self.head_dim = self.dim // self.n_heads
        if self.head_dim % 2:
            raise ModelError(f"head dim {self.head_dim} is odd; RoPE needs it even")

    @classmethod
    def from_name(cls, name: str) -> LlamaConfig:
        """A registered configuration; ``"debug"`` is a tiny one for tests."""
        if name not in CONFIGS:
            raise ModelError(f"unknown model config {name!r} (known: {', '.join(CONFIGS)})")
        return replace(CONFIGS[name])

    @classmethod
    def from_shape(cls, shape: ModelConfig, **numerics) -> LlamaConfig:
        """The config of a model in THE shape registry (:data:`treeattn.schedule.workload.MODELS`,
        which the planner reads too), plus the numerics shapes do not carry (RoPE base,
        epsilon, context length)."""
        config = cls(dim=shape.dim, n_layers=shape.n_layers, n_heads=shape.n_heads,
                     n_kv_heads=shape.n_kv_heads, hidden_dim=shape.ffn_dim,
                     vocab_size=shape.vocab_size, tie_embeddings=shape.tie_embeddings,
                     name=shape.name, **numerics)
        if config.head_dim != shape.head_dim:
            raise ModelError(f"model {shape.name}: head dim {config.head_dim} from the hidden "
                             f"size, {shape.head_dim} in the registry")
        return config


# The numerics of each model the LLM stack knows by name; its shapes come from the registry.
_NUMERICS = {
    "debug": {"max_seq_len": 4096},
    "smollm2-135m": {"rope_base": 100000.0, "max_seq_len": 8192},
}
CONFIGS = {name: LlamaConfig.from_shape(MODELS[name], **numerics)
           for name, numerics in _NUMERICS.items()}


class AttentionBackend(Protocol):
    """Where a layer's K/V go and how its queries attend over the cache.

    ``attend(layer, q, k, v, start)`` gets the new tokens' rotated queries ``q`` (B, Hq, T, D)
    and keys/values ``k``, ``v`` (B, Hkv, T, D) at positions ``start .. start+T-1``. It stores
    ``k``, ``v`` in the cache and returns the causal attention output (B, Hq, T, D).
    """

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int
    ) -> torch.Tensor: ...


def rope_inv_freq(config: LlamaConfig) -> torch.Tensor:
    """Per-pair rotation frequencies (D/2,), with linear or Llama 3 scaling when configured."""
    d = config.head_dim
    inv_freq = 1.0 / config.rope_base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    scaling = config.rope_scaling
    if not scaling:
        return inv_freq.float()
    factor = float(scaling["factor"])
    if scaling.get("rope_type", "llama3") == "linear":  # every frequency slowed by `factor`
        return (inv_freq / factor).float()
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    original = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    # long wavelengths are slowed by `factor`, short ones kept, the band between blended
    smooth = ((original / wavelen) - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > original / low, inv_freq / factor, blended)
    out = torch.where(wavelen < original / high, inv_freq, out)
    return out.float()


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """cos and sin of the rotation angles, each (T, D/2) in fp32 (angles formed in fp64)."""
    angles = positions.double()[:, None] * inv_freq.double()[None, :]  # (T, D/2)
    return torch.cos(angles).float(), torch.sin(angles).float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs of ``x`` (B, H, T, D) by angles with cos/sin (T, D/2)."""
    pairs = x.float().unflatten(-1, (-1, 2))  # (B, H, T, D/2, 2)
    a, b = pairs[..., 0], pairs[..., 1]
    out = torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1)  # (B, H, T, D/2, 2)
    return out.flatten(-2).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.to(x.dtype) * self.weight


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        d, hq, hkv = config.head_dim, config.n_heads, config.n_kv_heads
        self.n_heads, self.n_kv_heads, self.head_dim = hq, hkv, d
        self.wq = nn.Linear(config.dim, hq * d, bias=False)
        self.wk = nn.Linear(config.dim, hkv * d, bias=False)
        self.wv = nn.Linear(config.dim, hkv * d, bias=False)
        self.wo = nn.Linear(hq * d, config.dim, bias=False)

    def forward(self, x, cos, sin, layer: int, backend: AttentionBackend, start: int):
        bsz, t, _ = x.shape
        q = self.wq(x).view(bsz, t, self.n_heads, self.head_dim).transpose(1, 2)  # (B,Hq,T,D)
        k = self.wk(x).view(bsz, t, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B,Hkv,T,D)
        v = self.wv(x).view(bsz, t, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B,Hkv,T,D)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = backend.attend(layer, q, k, v, start)  # (B, Hq, T, D)
        return self.wo(o.transpose(1, 2).reshape(bsz, t, self.n_heads * self.head_dim))


class FeedForward(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.hidden_dim, bias=False)  # gate
        self.w3 = nn.Linear(config.dim, config.hidden_dim, bias=False)  # up
        self.w2 = nn.Linear(config.hidden_dim, config.dim, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = FeedForward(config)

    def forward(self, x, cos, sin, layer, backend, start):
        h = x + self.attention(self.attention_norm(x), cos, sin, layer, backend, start)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """The Llama-family decoder. ``forward`` returns the logits of the last token only."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # fp32 rotation frequencies: a plain attribute, so model.to(bf16) cannot round them
        self.inv_freq = rope_inv_freq(config)

    def forward(
        self, tokens: torch.Tensor, start: int, backend: AttentionBackend,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run ``tokens`` (B, T) at positions ``start..`` and return logits (B, vocab) fp32.

        Positions past ``config.max_seq_len`` are allowed (long-context runs); the caller
        decides whether that is sensible (:func:`treeattn.llm.generate.check_request`).
        ``positions`` (T,), a tensor on the model's device, replaces ``start`` for the
        rotations: a captured CUDA graph reads the position from it at every replay
        (:mod:`treeattn.llm.static_decode`), where a Python int would be frozen in.
        """
        bsz, t = tokens.shape
        if positions is None:
            positions = torch.arange(start, start + t, device=tokens.device)
        cos, sin = rope_cos_sin(self.inv_freq.to(tokens.device), positions)  # (T, D/2) each
        # the embedding and head may stay fp32 while the blocks run in bf16/fp16
        # (treeattn.llm.options.place_model); in an all-fp32 model both casts are no-ops
        x = self.tok_embeddings(tokens).to(self.norm.weight.dtype)  # (B, T, dim)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, i, backend, start)
        last = self.norm(x[:, -1]).to(self.output.weight.dtype)  # (B, dim)
        return self.output(last).float()  # (B, vocab)


def random_model(config: LlamaConfig, seed: int = 0) -> Transformer:
    """A model with seeded random weights (the ``debug`` flavour), scaled to stay well-mixed."""
    gen = torch.Generator().manual_seed(seed)
    model = Transformer(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
            else:
                std = 1.0 if param.dim() == 1 else param.shape[-1] ** -0.5
                param.copy_(std * torch.randn(param.shape, generator=gen))
    return model.eval()


def check_finite(state: dict[str, torch.Tensor], source: str) -> None:
    """Raise ModelError naming the first tensor with a NaN or infinite value.

    A model with one NaN weight runs and prints empty text; this costs one pass over the
    weights (``isfinite(t).all()`` per tensor, a fraction of a second for 135M parameters).
    """
    for name, tensor in state.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise ModelError(f"{source}: tensor {name} holds NaN or infinite values")


def assemble(config: LlamaConfig, state: dict[str, torch.Tensor], source: str) -> Transformer:
    """The one way a checkpoint becomes a model: GGUF, safetensors and snapshots all end here.

    ``state`` maps :class:`Transformer` parameter names to tensors (it is consumed). Two extra
    entries set the rotation frequencies: ``inv_freq`` (a snapshot's exact fp32 values) or
    ``rope_freqs`` (GGUF's Llama 3 per-pair divisors of :func:`rope_inv_freq`). The weights
    are assigned, not copied, so a memory-mapped file stays shared.
    """
    inv_freq = state.pop("inv_freq", None)
    rope_freqs = state.pop("rope_freqs", None)
    check_finite(state, source)
    with torch.device("meta"):
        model = Transformer(config)
    try:
        missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    except RuntimeError as exc:  # size mismatches, listed over many lines
        detail = next((ln.strip() for ln in str(exc).splitlines() if "size mismatch" in ln),
                      str(exc).strip().splitlines()[0] if str(exc).strip() else "")
        raise ModelError(f"{source}: weights do not match the model's dimensions "
                         f"({detail[:300]})") from None
    missing = [m for m in missing if not (config.tie_embeddings and m == "output.weight")]
    if missing or unexpected:
        names = ", ".join((missing or unexpected)[:3])
        raise ModelError(f"{source}: weights do not match a llama model ({names} ...)")
    if config.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight
    if inv_freq is None:
        inv_freq = rope_inv_freq(config)
        if rope_freqs is not None:
            inv_freq = inv_freq / rope_freqs.float()
    model.inv_freq = inv_freq
    return model.eval()
