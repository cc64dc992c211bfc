"""Model configurations: the attention shapes a decode step depends on.

Values are copied from each model's published ``config.json`` on the Hugging Face Hub:

* ``smollm2-135m``: HuggingFaceTB/SmolLM2-135M/config.json (hidden_size 576,
  intermediate_size 1536, num_hidden_layers 30, num_attention_heads 9, num_key_value_heads 3,
  head_dim 576/9 = 64, vocab_size 49152, tie_word_embeddings true, bfloat16).
* ``llama-3.2-1b``: meta-llama/Llama-3.2-1B/config.json (2048, 8192, 16 layers, 32 heads,
  8 KV heads, head_dim 64, vocab 128256, tied embeddings, bfloat16).
* ``llama-3.1-8b``: meta-llama/Llama-3.1-8B/config.json (4096, 14336, 32 layers, 32 heads,
  8 KV heads, head_dim 128, vocab 128256, bfloat16).
* ``llama-3.1-70b``: meta-llama/Llama-3.1-70B/config.json (8192, 28672, 80 layers, 64 heads,
  8 KV heads, head_dim 128, vocab 128256, bfloat16).
* ``debug``: a tiny fp32 flavour for tests (2 layers, 4 query heads, 2 KV heads, head_dim 16).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from treeattn.sim.errors import SimError

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ModelConfig:
    """The shapes of one decoder-only transformer.

    ``n_heads`` is Hq, ``n_kv_heads`` is Hkv (GQA: ``Hq % Hkv == 0``), ``head_dim`` is D and
    ``dim`` the hidden size. ``dtype_bytes`` is derived from ``dtype``.

    Examples
    --------
    >>> m = ModelConfig.from_name("llama-3.1-8b")
    >>> (m.n_layers, m.n_heads, m.n_kv_heads, m.head_dim, m.dtype_bytes)
    (32, 32, 8, 128, 2)
    >>> ModelConfig.from_name("debug").dtype
    'float32'
    """

    name: str
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    dim: int
    ffn_dim: int
    vocab_size: int
    dtype: str = "bfloat16"
    tie_embeddings: bool = False
    dtype_bytes: int = field(init=False)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise SimError(f"model {self.name}: unknown dtype {self.dtype!r}")
        for attr in ("n_layers", "n_heads", "n_kv_heads", "head_dim", "dim", "vocab_size"):
            if getattr(self, attr) <= 0:
                raise SimError(f"model {self.name}: {attr} must be positive")
        if self.n_heads % self.n_kv_heads:
            raise SimError(f"model {self.name}: n_heads % n_kv_heads != 0 (GQA)")
        object.__setattr__(self, "dtype_bytes", DTYPE_BYTES[self.dtype])

    @classmethod
    def from_name(cls, name: str) -> ModelConfig:
        """The registered configuration called ``name`` (case-insensitive)."""
        key = str(name).strip().lower()
        if key not in MODELS:
            raise SimError(f"unknown model {name!r} (known: {', '.join(MODELS)})")
        return MODELS[key]

    @classmethod
    def debug(cls) -> ModelConfig:
        """The tiny fp32 flavour used by tests."""
        return MODELS["debug"]

    def weight_bytes_per_token(self) -> int:
        """Bytes of weights one decode step reads outside attention's softmax core.

        Q/K/V/O projections and the gated MLP of every layer, plus the output head; the input
        embedding is a row gather and is not counted.
        """
        attn = self.dim * self.head_dim * (2 * self.n_heads + 2 * self.n_kv_heads)
        mlp = 3 * self.dim * self.ffn_dim
        head = self.vocab_size * self.dim
        return (self.n_layers * (attn + mlp) + head) * self.dtype_bytes


MODELS: dict[str, ModelConfig] = {
    m.name: m
    for m in (
        ModelConfig("smollm2-135m", 30, 9, 3, 64, 576, 1536, 49152, tie_embeddings=True),
        ModelConfig("llama-3.2-1b", 16, 32, 8, 64, 2048, 8192, 128256, tie_embeddings=True),
        ModelConfig("llama-3.1-8b", 32, 32, 8, 128, 4096, 14336, 128256),
        ModelConfig("llama-3.1-70b", 80, 64, 8, 128, 8192, 28672, 128256),
        ModelConfig("debug", 2, 4, 2, 16, 64, 128, 256, dtype="float32"),
    )
}
