"""Load a model and its tokenizer from a name, a GGUF file or a Hugging Face directory.

``load_model(spec)`` accepts:

* ``"debug"``: the tiny random-weight flavour with a byte-level tokenizer (tests);
* ``"smollm2-135m-instruct"`` (the default, aliases in :mod:`treeattn.llm.formats.fetch`):
  fetched on first use;
* a path to a ``.gguf`` file (``llama`` architecture);
* a Hugging Face checkpoint directory: ``config.json`` + ``*.safetensors`` (+ tokenizer.json);
* a snapshot written by :func:`treeattn.llm.formats.snapshot.save_snapshot` (the ranks of one run).

Every format is read into a name -> tensor dict and built by :func:`treeattn.llm.model.assemble`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from treeattn.llm.errors import ModelError
from treeattn.llm.formats.fetch import DEFAULT_ALIASES, fetch_default_model
from treeattn.llm.formats.hf_folder import read_llama_folder
from treeattn.llm.formats.snapshot import is_snapshot, load_snapshot
from treeattn.llm.formats.tokenizer import Tokenizer
from treeattn.llm.model import LlamaConfig, Transformer, assemble, check_finite, random_model


@dataclass
class LoadedModel:
    """A ready model, its tokenizer, and where it came from."""

    model: Transformer
    tokenizer: Tokenizer
    source: str


def hf_to_interleaved(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder Q/K rows from HF's half-split rope pairs to interleaved pairs.

    Row ``(h, half, i)`` of head ``h`` becomes row ``(h, i, half)``, as llama.cpp's converter
    does, so :func:`treeattn.llm.model.apply_rope` rotates the right pairs.
    """
    out_dim = w.shape[0]
    return w.reshape(n_heads, 2, out_dim // n_heads // 2, -1).transpose(1, 2).reshape(w.shape)


def load_gguf(path: Path) -> LoadedModel:
    from treeattn.llm.formats.gguf_load import (
        config_from_gguf,
        open_gguf,
        state_dict_from_gguf,
        tokenizer_metadata,
    )
    from treeattn.llm.formats.tokenizer import tokenizer_from_gguf

    reader = open_gguf(path)
    config = config_from_gguf(reader, path)
    meta = tokenizer_metadata(reader)
    if len(meta["tokens"] or ()) > config.vocab_size:
        raise ModelError(f"{path}: the tokenizer has {len(meta['tokens'])} tokens but the "
                         f"embedding only {config.vocab_size} rows")
    tokenizer = tokenizer_from_gguf(meta)
    model = assemble(config, state_dict_from_gguf(reader, config), str(path))
    return LoadedModel(model, tokenizer, str(path))


_HF_LAYER = {
    "input_layernorm": "attention_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attention.wq", "self_attn.k_proj": "attention.wk",
    "self_attn.v_proj": "attention.wv", "self_attn.o_proj": "attention.wo",
    "mlp.gate_proj": "feed_forward.w1", "mlp.up_proj": "feed_forward.w3",
    "mlp.down_proj": "feed_forward.w2",
}
_HF_TOP = {"model.embed_tokens.weight": "tok_embeddings.weight",
           "model.norm.weight": "norm.weight", "lm_head.weight": "output.weight"}


def _hf_name(name: str) -> str:
    if name in _HF_TOP:
        return _HF_TOP[name]
    parts = name.split(".")  # model.layers.N.<module...>.weight
    if parts[:2] == ["model", "layers"] and ".".join(parts[3:-1]) in _HF_LAYER:
        return f"layers.{parts[2]}.{_HF_LAYER['.'.join(parts[3:-1])]}.{parts[-1]}"
    raise ModelError(f"unexpected tensor {name} in a llama checkpoint")


def load_hf_dir(path: Path) -> LoadedModel:
    """A Llama folder, validated whole (:mod:`treeattn.llm.formats.hf_folder`) before any
    weight is read."""
    from safetensors.torch import load_file

    from treeattn.llm.formats.tokenizer import tokenizer_from_hf_dir

    config, files = read_llama_folder(path)
    tokenizer = tokenizer_from_hf_dir(path)
    tokens = tokenizer.backend.get_vocab_size()
    if tokens > config.vocab_size:  # a token past the embedding would index out of range
        raise ModelError(f"{path}: the tokenizer has {tokens} tokens but the embedding only "
                         f"{config.vocab_size} rows")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            loaded = load_file(str(file))
        except Exception as exc:
            raise ModelError(f"cannot read {file}: {exc}") from None
        if config.tie_embeddings:  # transformers ties the head to the embedding
            loaded.pop("lm_head.weight", None)
        check_finite(loaded, str(file))  # named as the file names it
        state.update({_hf_name(k): v.float() for k, v in loaded.items()
                      if not k.endswith("rotary_emb.inv_freq")})
    for key, heads in (("wq", config.n_heads), ("wk", config.n_kv_heads)):
        for i in range(config.n_layers):
            name = f"layers.{i}.attention.{key}.weight"
            if name in state:
                state[name] = hf_to_interleaved(state[name], heads)
    model = assemble(config, state, str(path))
    return LoadedModel(model, tokenizer, str(path))


def debug_model(seed: int = 0) -> LoadedModel:
    """The ``debug`` flavour: random weights, a 256-token byte tokenizer, no network."""
    from treeattn.llm.formats.tokenizer import byte_tokenizer

    return LoadedModel(random_model(LlamaConfig.from_name("debug"), seed), byte_tokenizer(),
                       "debug")


def resolve_model(spec: str | None = None) -> str:
    """``"debug"`` or the local path ``spec`` names, fetching the default model if needed."""
    spec = spec or DEFAULT_ALIASES[0]
    if spec == "debug":
        return spec
    if spec in DEFAULT_ALIASES:
        return str(fetch_default_model())
    path = Path(spec).expanduser()
    if path.is_dir() and not (path / "config.json").is_file() and not is_snapshot(path):
        raise ModelError(f"{spec} is a directory without config.json")
    if not path.exists():
        raise ModelError(f"model not found: {spec} (give a .gguf file, a Hugging Face "
                         f"directory, or one of: {DEFAULT_ALIASES[0]}, debug)")
    if not path.is_dir() and not path.is_file():  # stat only: opening a FIFO would block
        raise ModelError(f"{spec} is not a regular file (a FIFO, device or socket?)")
    return str(path)


def load_model(spec: str | None = None, dtype: torch.dtype = torch.float32) -> LoadedModel:
    """Resolve ``spec`` (name or path; None = the default model) and load it in ``dtype``."""
    resolved = resolve_model(spec)
    if resolved == "debug":
        loaded = debug_model()
    elif is_snapshot(Path(resolved)):
        loaded = LoadedModel(*load_snapshot(Path(resolved)))
    elif Path(resolved).is_dir():
        loaded = load_hf_dir(Path(resolved))
    else:
        loaded = load_gguf(Path(resolved))
    loaded.model.to(dtype)
    return loaded
