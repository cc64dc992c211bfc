"""A loaded model, saved for the ranks of one run: fp32 safetensors + a small JSON.

Parsing and dequantizing a GGUF costs seconds per process (the reader walks every
vocabulary string). The launcher has already done it once, so it writes what it loaded to a
temporary directory and every rank memory-maps that instead. The snapshot holds the exact
tensors the launcher computed, so all ranks and the single-process reference run the very
same weights. It lives only as long as the run.
"""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

from treeattn.llm.errors import ModelError
from treeattn.llm.formats.tokenizer import Tokenizer
from treeattn.llm.model import LlamaConfig, Transformer, assemble

MARKER = "treeattn-snapshot.json"
WEIGHTS = "model.safetensors"


def is_snapshot(path: Path) -> bool:
    return (path / MARKER).is_file()


def save_snapshot(loaded, path: Path) -> Path:
    """Write ``loaded`` (a :class:`treeattn.llm.formats.weights.LoadedModel`) under ``path``."""
    from safetensors.torch import save_file

    model, tok = loaded.model, loaded.tokenizer
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_embeddings:
        state.pop("output.weight")  # shared with the embedding; safetensors wants one copy
    state["inv_freq"] = model.inv_freq.contiguous()
    path.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path / WEIGHTS))
    config = {f.name: getattr(model.config, f.name) for f in fields(model.config) if f.init}
    meta = {"config": config, "source": loaded.source, "tokenizer": tok.backend.to_str(),
            "bos_id": tok.bos_id, "eos_id": tok.eos_id, "chat_template": tok.chat_template,
            "add_bos": tok.add_bos}
    (path / MARKER).write_text(json.dumps(meta))
    return path


def load_snapshot(path: Path) -> tuple[Transformer, Tokenizer, str]:
    """The model, tokenizer and source saved by :func:`save_snapshot`.

    :func:`treeattn.llm.formats.weights.load_model` wraps them in its ``LoadedModel``; this module
    does not import :mod:`treeattn.llm.formats.weights`, so the two do not form an import cycle.
    """
    from safetensors.torch import load_file
    from tokenizers import Tokenizer as HFTokenizer

    try:
        meta = json.loads((path / MARKER).read_text())
        state = load_file(str(path / WEIGHTS))
    except Exception as exc:
        raise ModelError(f"cannot read the model snapshot in {path}: {exc}") from None
    model = assemble(LlamaConfig(**meta["config"]), state, str(path))
    tok = Tokenizer(HFTokenizer.from_str(meta["tokenizer"]), meta["bos_id"], meta["eos_id"],
                    meta["chat_template"], meta["add_bos"])
    return model, tok, meta["source"]
