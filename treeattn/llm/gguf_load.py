"""Read a GGUF file into a :class:`ModelConfig`, a state dict and the tokenizer metadata.

The file is parsed by the ``gguf`` package's :class:`gguf.GGUFReader` (memory-mapped); the
tensors are dequantized by :mod:`treeattn.llm.gguf_quants`. Only the ``llama``
architecture is accepted. Q and K stay in GGML's interleaved rope layout, which is the one
:mod:`treeattn.llm.model` uses.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from treeattn.llm.errors import ModelError
from treeattn.llm.gguf_quants import dequantize
from treeattn.llm.model import ModelConfig

SUPPORTED_ARCHITECTURES = ("llama",)

# GGUF tensor name (after "blk.N.") -> name in treeattn.llm.model.Transformer
_LAYER_NAMES = {
    "attn_norm.weight": "attention_norm.weight",
    "attn_q.weight": "attention.wq.weight",
    "attn_k.weight": "attention.wk.weight",
    "attn_v.weight": "attention.wv.weight",
    "attn_output.weight": "attention.wo.weight",
    "ffn_norm.weight": "ffn_norm.weight",
    "ffn_gate.weight": "feed_forward.w1.weight",
    "ffn_up.weight": "feed_forward.w3.weight",
    "ffn_down.weight": "feed_forward.w2.weight",
}
_TOP_NAMES = {
    "token_embd.weight": "tok_embeddings.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "output.weight",
    "rope_freqs.weight": "rope_freqs",
}


def open_gguf(path: str | Path):
    """A :class:`gguf.GGUFReader` for ``path``; a ModelError if it is not a readable GGUF."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except (OSError, PermissionError) as exc:
        raise ModelError(f"cannot read model file {path}: {exc.strerror or exc}") from None
    except Exception as exc:  # the reader raises ValueError/IndexError/... on bad bytes
        raise ModelError(f"{path} is not a valid GGUF file ({type(exc).__name__}: {exc})") from None
    for tensor in reader.tensors:
        if tensor.data.nbytes != tensor.n_bytes:
            raise ModelError(f"{path} is truncated: tensor {tensor.name} is incomplete")
    return reader


def field(reader, key: str, default=None):
    """The decoded value of metadata ``key``, or ``default`` when absent."""
    entry = reader.fields.get(key)
    if entry is None:
        return default
    return entry.contents()


def config_from_gguf(reader, path: str | Path = "") -> ModelConfig:
    """The model configuration from the file's ``general.*`` and ``llama.*`` metadata."""
    arch = field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelError(
            f"unsupported architecture {arch!r} in {path} (supported: llama)"
        )
    names = {t.name for t in reader.tensors}

    def need(key: str):
        value = field(reader, f"llama.{key}")
        if value is None:
            raise ModelError(f"{path} lacks metadata llama.{key}")
        return value

    n_heads = int(need("attention.head_count"))
    embd = reader.tensors[[t.name for t in reader.tensors].index("token_embd.weight")]
    return ModelConfig(
        dim=int(need("embedding_length")),
        n_layers=int(need("block_count")),
        n_heads=n_heads,
        n_kv_heads=int(field(reader, "llama.attention.head_count_kv", n_heads)),
        hidden_dim=int(need("feed_forward_length")),
        vocab_size=int(embd.shape[1]),
        norm_eps=float(field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_base=float(field(reader, "llama.rope.freq_base", 10000.0)),
        max_seq_len=int(field(reader, "llama.context_length", 4096)),
        tie_embeddings="output.weight" not in names,
        name=str(field(reader, "general.name", Path(path).stem)),
    )


def tensor_to_torch(tensor) -> torch.Tensor:
    """Dequantize one :class:`gguf.ReaderTensor` to a float32 tensor in numpy dim order."""
    shape = tuple(int(s) for s in reversed(tensor.shape))  # GGML lists dims innermost first
    values = dequantize(np.asarray(tensor.data), tensor.tensor_type.name)
    return torch.from_numpy(np.ascontiguousarray(values).reshape(shape))


def state_dict_from_gguf(reader, config: ModelConfig) -> dict[str, torch.Tensor]:
    """The model's weights, renamed to :class:`Transformer`'s parameter names, float32."""
    state: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        name = tensor.name
        if name in _TOP_NAMES:
            state[_TOP_NAMES[name]] = tensor_to_torch(tensor)
            continue
        prefix, _, rest = name.partition(".")
        layer, _, suffix = rest.partition(".")
        if prefix != "blk" or suffix not in _LAYER_NAMES or not layer.isdigit():
            raise ModelError(f"unexpected tensor {name} in a llama GGUF file")
        state[f"layers.{layer}.{_LAYER_NAMES[suffix]}"] = tensor_to_torch(tensor)
    if config.tie_embeddings:
        state["output.weight"] = state["tok_embeddings.weight"]
    return state


def tokenizer_metadata(reader) -> dict:
    """The ``tokenizer.*`` metadata as plain Python values."""
    keys = ("model", "pre", "tokens", "merges", "token_type", "bos_token_id",
            "eos_token_id", "add_bos_token")
    meta = {key: field(reader, f"tokenizer.ggml.{key}") for key in keys}
    meta["chat_template"] = field(reader, "tokenizer.chat_template")
    return meta
