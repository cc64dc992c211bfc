"""GGUF: our dequantizers against the ``gguf`` package's, and loading whole files.

Q8_0/Q4_0/Q4_1/BF16 bytes come from ``gguf.quants.quantize``. ``gguf`` cannot quantize Q4_K or
Q6_K, so those tests build random *valid* blocks: random bytes everywhere, with the fp16 super
scales overwritten by finite values (every other byte pattern is a valid block).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

gguf = pytest.importorskip("gguf")

from gguf.quants import dequantize as gguf_dequantize  # noqa: E402
from gguf.quants import quantize as gguf_quantize  # noqa: E402

from treeattn.llm.errors import ModelError  # noqa: E402
from treeattn.llm.formats.gguf_quants import BLOCKS, dequantize  # noqa: E402
from treeattn.llm.formats.weights import load_model  # noqa: E402
from treeattn.llm.model import LlamaConfig, random_model  # noqa: E402

QT = gguf.GGMLQuantizationType
# byte offsets of the fp16 scales inside one block
K_SCALE_OFFSETS = {"Q4_K": (0, 2), "Q6_K": (208,)}


@settings(max_examples=15, deadline=None)
@given(kind=st.sampled_from(["Q8_0", "Q4_0", "Q4_1", "BF16", "F16"]),
       rows=st.integers(1, 4), blocks=st.integers(1, 4), seed=st.integers(0, 2**16),
       scale=st.sampled_from([1e-3, 1.0, 50.0]))
def test_quantized_types_match_gguf(kind, rows, blocks, seed, scale):
    x = (scale * np.random.default_rng(seed).standard_normal((rows, 32 * blocks))).astype(
        np.float32)
    raw = gguf_quantize(x, QT[kind])
    expected = gguf_dequantize(raw, QT[kind])
    np.testing.assert_array_equal(dequantize(raw, kind), expected)  # same arithmetic: exact


def random_k_blocks(kind: str, rows: int, blocks: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    _, nbytes = BLOCKS[kind]
    raw = rng.integers(0, 256, (rows, blocks, nbytes), dtype=np.uint8)
    for offset in K_SCALE_OFFSETS[kind]:
        scales = rng.uniform(-2, 2, (rows, blocks)).astype(np.float16)
        raw[:, :, offset : offset + 2] = scales.view(np.uint8).reshape(rows, blocks, 2)
    return raw.reshape(rows, blocks * nbytes)


@settings(max_examples=15, deadline=None)
@given(kind=st.sampled_from(["Q4_K", "Q6_K"]), rows=st.integers(1, 3),
       blocks=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_k_quant_types_match_gguf(kind, rows, blocks, seed):
    raw = random_k_blocks(kind, rows, blocks, seed)
    expected = gguf_dequantize(raw, QT[kind])
    np.testing.assert_array_equal(dequantize(raw, kind), expected)


def test_unsupported_type_is_a_model_error():
    with pytest.raises(ModelError, match="unsupported GGUF tensor type Q5_K"):
        dequantize(np.zeros((1, 176), np.uint8), "Q5_K")
    with pytest.raises(ModelError, match="not whole blocks"):
        dequantize(np.zeros((1, 33), np.uint8), "Q8_0")


def write_llama_gguf(path, model, kind: str = "Q8_0", arch: str = "llama") -> None:
    """Write ``model`` as a llama GGUF with a tiny byte-level vocabulary."""
    from gguf import GGUFWriter

    from treeattn.llm.formats.tokenizer import byte_tokenizer

    c = model.config
    writer = GGUFWriter(str(path), arch)
    writer.add_uint32(f"{arch}.block_count", c.n_layers)
    writer.add_uint32(f"{arch}.context_length", c.max_seq_len)
    writer.add_uint32(f"{arch}.embedding_length", c.dim)
    writer.add_uint32(f"{arch}.feed_forward_length", c.hidden_dim)
    writer.add_uint32(f"{arch}.attention.head_count", c.n_heads)
    writer.add_uint32(f"{arch}.attention.head_count_kv", c.n_kv_heads)
    writer.add_float32(f"{arch}.rope.freq_base", c.rope_base)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", c.norm_eps)
    vocab = byte_tokenizer().backend.get_vocab()
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_string("tokenizer.ggml.pre", "smollm")
    writer.add_array("tokenizer.ggml.tokens", sorted(vocab, key=vocab.get))
    writer.add_array("tokenizer.ggml.merges", [])
    names = {"tok_embeddings.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
             "output.weight": "output.weight"}
    layer = {"attention_norm": "attn_norm", "attention.wq": "attn_q", "attention.wk": "attn_k",
             "attention.wv": "attn_v", "attention.wo": "attn_output", "ffn_norm": "ffn_norm",
             "feed_forward.w1": "ffn_gate", "feed_forward.w3": "ffn_up",
             "feed_forward.w2": "ffn_down"}
    for name, tensor in model.state_dict().items():
        if name.startswith("layers."):
            _, i, rest = name.split(".", 2)
            gname = f"blk.{i}.{layer[rest.rsplit('.', 1)[0]]}.weight"
        else:
            gname = names[name]
        x = tensor.numpy().astype(np.float32)
        if x.ndim == 2:
            writer.add_tensor(gname, gguf_quantize(x, QT[kind]), raw_dtype=QT[kind])
        else:
            writer.add_tensor(gname, x)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def debug_gguf(tmp_path_factory):
    model = random_model(LlamaConfig.from_name("debug"), seed=1)
    path = tmp_path_factory.mktemp("gguf") / "debug.gguf"
    write_llama_gguf(path, model)
    return model, path


def test_gguf_file_loads_to_the_dequantized_weights(debug_gguf):
    model, path = debug_gguf
    loaded = load_model(str(path))
    assert loaded.model.config.dim == model.config.dim
    assert loaded.model.config.n_kv_heads == model.config.n_kv_heads
    got = loaded.model.state_dict()
    for name, tensor in model.state_dict().items():
        x = tensor.numpy()
        expected = gguf_dequantize(gguf_quantize(x, QT.Q8_0), QT.Q8_0) if x.ndim == 2 else x
        np.testing.assert_array_equal(got[name].numpy(), expected, err_msg=name)
    assert loaded.tokenizer.decode(loaded.tokenizer.encode("abc 12")) == "abc 12"


def test_truncated_and_corrupt_files_are_model_errors(debug_gguf, tmp_path):
    _, path = debug_gguf
    data = path.read_bytes()
    for name, blob in [("truncated", data[: len(data) // 2]), ("header", data[:20]),
                       ("corrupt", b"GGUF" + bytes(reversed(data[4:200]))),
                       ("notgguf", b"hello world, this is not a model" * 4)]:
        bad = tmp_path / f"{name}.gguf"
        bad.write_bytes(blob)
        with pytest.raises(ModelError) as info:
            load_model(str(bad))
        assert "\n" not in str(info.value) and str(bad) in str(info.value)


def test_unsupported_architecture_is_a_model_error(tmp_path):
    model = random_model(LlamaConfig.from_name("debug"), seed=1)
    path = tmp_path / "gpt.gguf"
    write_llama_gguf(path, model, arch="gpt2")
    with pytest.raises(ModelError, match="unsupported architecture 'gpt2'"):
        load_model(str(path))


def test_loaded_gguf_model_generates_like_its_source(debug_gguf):
    from treeattn.llm.generate import generate_local

    model, path = debug_gguf
    loaded = load_model(str(path))
    prompt = [3, 50, 100, 7, 9]
    ours = generate_local(loaded.model, prompt, 4)
    # the source model with its weights run through Q8_0 gives the same logits
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                x = p.numpy()
                p.copy_(torch.from_numpy(gguf_dequantize(gguf_quantize(x, QT.Q8_0), QT.Q8_0)))
    ref = generate_local(model, prompt, 4)
    assert ours.tokens == ref.tokens
    torch.testing.assert_close(ours.logits[-1], ref.logits[-1], atol=1e-5, rtol=1e-5)
