"""Read a GGUF file into a :class:`LlamaConfig`, a state dict and the tokenizer metadata.

The file is parsed by the ``gguf`` package's :class:`gguf.GGUFReader` (memory-mapped); the
tensors are dequantized by :mod:`treeattn.llm.formats.gguf_quants`. Only the ``llama``
architecture is accepted. Q and K stay in GGML's interleaved rope layout, which is the one
:mod:`treeattn.llm.model` uses.
"""

from __future__ import annotations

import mmap
import os
import stat
import struct
from pathlib import Path

import numpy as np
import torch

from treeattn.llm.errors import ModelError
from treeattn.llm.formats.gguf_quants import dequantize
from treeattn.llm.model import LlamaConfig

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


# GGUF metadata value types -> size in bytes (fixed-size types only); 8 string, 9 array
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
_MAX_DIMS = 4  # GGML_MAX_DIMS
_MIN_TENSOR_INFO = 8 + 4 + 4 + 8  # name length, n_dims, type, offset (no name, no dims)
_MIN_KV = 8 + 4 + 1  # key length, value type, the smallest value


def check_regular_file(path: str | Path) -> None:
    """Refuse anything but a regular file *before* opening it: a FIFO would block forever,
    a device could be endless."""
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        raise ModelError(f"cannot read model file {path}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(mode):
        raise ModelError(f"{path} is not a regular file (a FIFO, device or socket?)")


class _Cursor:
    """Bounds-checked little- or big-endian reads over the mapped file."""

    def __init__(self, buf, order: str, path) -> None:
        self.buf, self.order, self.pos, self.path = buf, order, 0, path

    def take(self, fmt: str):
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise ModelError(f"{self.path} is not a valid GGUF file: its header is truncated")
        value = struct.unpack_from(self.order + fmt, self.buf, self.pos)[0]
        self.pos += size
        return value

    def need(self, count: int, each: int, what: str) -> None:
        """Refuse ``count`` items of at least ``each`` bytes that the rest cannot hold."""
        if count * each > len(self.buf) - self.pos:
            raise ModelError(f"{self.path} is not a valid GGUF file: it claims {count} {what}, "
                             f"more than its {len(self.buf)} bytes can hold")

    def skip(self, count: int, each: int, what: str) -> None:
        self.need(count, each, what)
        self.pos += count * each

    def string(self) -> None:
        self.skip(self.take("Q"), 1, "bytes in a string")

    def value(self, kind: int, depth: int = 0) -> None:
        if depth > 8:
            raise ModelError(f"{self.path} nests GGUF arrays more than 8 deep")
        if kind in _SCALAR_BYTES:
            self.skip(1, _SCALAR_BYTES[kind], "bytes")
        elif kind == _STRING:
            self.string()
        elif kind == _ARRAY:
            inner, count = self.take("I"), self.take("Q")
            if inner in _SCALAR_BYTES:
                self.skip(count, _SCALAR_BYTES[inner], "array elements")
                return
            self.need(count, 8, "array elements")  # each string or array needs 8+ bytes
            for _ in range(count):
                self.value(inner, depth + 1)
        else:
            raise ModelError(f"{self.path} has an unknown GGUF value type {kind}")


def check_gguf_counts(path: str | Path) -> None:
    """Walk the GGUF header and refuse counts the file's size cannot back.

    A 14 KB file can claim 10^9 tensors, metadata entries or array elements; the ``gguf``
    reader would loop over all of them. Every count here is checked against the bytes left
    before it is used, so this walk is linear in the file size.
    """
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 24 or f.read(4) != b"GGUF":
            return  # not a GGUF at all: the reader says so
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            order = "<" if struct.unpack_from("<I", buf, 4)[0] < 0x10000 else ">"
            cur = _Cursor(buf, order, path)
            cur.pos = 8
            n_tensors, n_kv = cur.take("Q"), cur.take("Q")
            cur.need(n_kv, _MIN_KV, "metadata entries")
            for _ in range(n_kv):
                cur.string()
                cur.value(cur.take("I"))
            cur.need(n_tensors, _MIN_TENSOR_INFO, "tensors")
            for _ in range(n_tensors):
                cur.string()
                dims = cur.take("I")
                if dims > _MAX_DIMS:
                    raise ModelError(f"{path} has a tensor with {dims} dimensions "
                                     f"(GGML allows {_MAX_DIMS})")
                cur.skip(dims, 8, "dimensions")
                cur.skip(1, 12, "bytes")  # type, offset


def open_gguf(path: str | Path):
    """A :class:`gguf.GGUFReader` for ``path``; a ModelError if it is not a readable GGUF."""
    import gguf

    check_regular_file(path)
    check_gguf_counts(path)
    try:
        reader = gguf.GGUFReader(str(path))
    except (OSError, PermissionError) as exc:
        raise ModelError(f"cannot read model file {path}: {exc.strerror or exc}") from None
    except Exception as exc:  # the reader raises ValueError/IndexError/... on bad bytes
        raise ModelError(f"{path} is not a valid GGUF file ({type(exc).__name__}: {exc})") from None
    reader.treeattn_path = str(path)  # for field()'s messages
    for tensor in reader.tensors:
        if tensor.data.nbytes != tensor.n_bytes:
            raise ModelError(f"{path} is truncated: tensor {tensor.name} is incomplete")
    return reader


def field(reader, key: str, default=None):
    """The decoded value of metadata ``key``, or ``default`` when absent."""
    entry = reader.fields.get(key)
    if entry is None:
        return default
    try:
        return entry.contents()
    except (UnicodeDecodeError, ValueError, IndexError, TypeError) as exc:  # lying bytes
        where = getattr(reader, "treeattn_path", "GGUF file")
        raise ModelError(f"{where}: field {key}: expected a readable value, got bytes that "
                         f"do not decode ({type(exc).__name__})") from None


def config_from_gguf(reader, path: str | Path = "") -> LlamaConfig:
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

    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embd is None or len(embd.shape) != 2:
        raise ModelError(f"{path} lacks a 2-D tensor token_embd.weight")
    try:
        n_heads = int(need("attention.head_count"))
        config_from_meta = LlamaConfig(
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
    except (TypeError, ValueError, OverflowError) as exc:  # a string where a number belongs
        raise ModelError(f"{path} has malformed llama.* metadata ({exc})") from None
    check_against_tensors(config_from_meta, reader, path)
    return config_from_meta


def check_against_tensors(config: LlamaConfig, reader, path) -> None:
    """Refuse metadata the file's own tensors contradict, before anything is built from it.

    A 14 KB file can claim 10^9 blocks: a model of that many layers would be built (and a
    core kept busy for minutes) before any weight is found missing. The block count must be
    the number of ``blk.N`` groups present (0..N-1), and the embedding width that of
    ``token_embd.weight``; every count is then bounded by what the file holds.
    """
    blocks = set()
    for tensor in reader.tensors:
        prefix, _, rest = tensor.name.partition(".")
        index = rest.partition(".")[0]
        if prefix == "blk" and index.isascii() and index.isdigit() and len(index) < 7:
            blocks.add(int(index))
    if config.n_layers != len(blocks) or blocks != set(range(len(blocks))):
        raise ModelError(f"{path}: field llama.block_count: expected the {len(blocks)} blocks "
                         f"its tensors hold (blk.0..blk.{len(blocks) - 1}), got "
                         f"{config.n_layers}")
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    if int(embd.shape[0]) != config.dim:
        raise ModelError(f"{path}: field llama.embedding_length: expected {int(embd.shape[0])} "
                         f"(the width of token_embd.weight), got {config.dim}: the metadata "
                         "and the tensors' dimensions disagree")


def tensor_to_torch(tensor) -> torch.Tensor:
    """Dequantize one :class:`gguf.ReaderTensor` to a float32 tensor in numpy dim order."""
    shape = tuple(int(s) for s in reversed(tensor.shape))  # GGML lists dims innermost first
    values = dequantize(np.asarray(tensor.data), tensor.tensor_type.name)
    return torch.from_numpy(np.ascontiguousarray(values).reshape(shape))


def state_dict_from_gguf(reader, config: LlamaConfig) -> dict[str, torch.Tensor]:
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
