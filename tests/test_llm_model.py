"""The Llama model against an independent naive implementation in Hugging Face's layout.

The reference below is written from the published Llama equations, not from our model: it
rotates half-split pairs with ``rotate_half`` (HF's layout), so it also checks that loading a
checkpoint permutes Q/K into our interleaved layout correctly, and it implements Llama 3 rope
scaling with a per-frequency scalar loop.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from treeattn.llm.errors import ModelError
from treeattn.llm.formats.weights import load_model
from treeattn.llm.local_cache import LocalCache, prefill
from treeattn.llm.model import LlamaConfig, apply_rope, random_model, rope_cos_sin

torch.set_num_threads(1)

# fp32 everywhere; the two implementations order their sums differently, so allow a few ulps
# of the logits' magnitude (logits here are O(1)-O(10)).
ATOL, RTOL = 1e-4, 1e-4


def llama3_inv_freq_ref(dim, base, factor, low, high, original):
    """Llama 3.1 rope scaling, one frequency at a time."""
    out = []
    for i in range(0, dim, 2):
        freq = 1.0 / base ** (i / dim)
        wavelen = 2 * math.pi / freq
        if wavelen < original / high:
            out.append(freq)
        elif wavelen > original / low:
            out.append(freq / factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append((1 - smooth) * freq / factor + smooth * freq)
    return torch.tensor(out, dtype=torch.float64)


def naive_hf_llama(w: dict, conf: dict, tokens: list[int]) -> torch.Tensor:
    """Logits (T, V) of a Llama checkpoint ``w`` in HF naming, full causal softmax."""
    dim, hq, hkv = conf["hidden_size"], conf["num_attention_heads"], conf["num_key_value_heads"]
    d, eps, t = dim // hq, conf["rms_norm_eps"], len(tokens)
    s = conf.get("rope_scaling")
    if s:
        inv = llama3_inv_freq_ref(d, conf["rope_theta"], s["factor"], s["low_freq_factor"],
                                  s["high_freq_factor"], s["original_max_position_embeddings"])
    else:
        inv = 1.0 / conf["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.arange(t, dtype=torch.float64)[:, None] * inv[None]  # (T, D/2)
    cos, sin = torch.cat([ang.cos()] * 2, -1).float(), torch.cat([ang.sin()] * 2, -1).float()

    def rot(x):  # rotate_half on (H, T, D)
        return torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1)

    def norm(x, g):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * g

    x = w["model.embed_tokens.weight"][tokens]  # (T, dim)
    mask = torch.full((t, t), float("-inf")).triu(1)
    for i in range(conf["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = norm(x, w[p + "input_layernorm.weight"])
        q = (h @ w[p + "self_attn.q_proj.weight"].T).view(t, hq, d).transpose(0, 1)
        k = (h @ w[p + "self_attn.k_proj.weight"].T).view(t, hkv, d).transpose(0, 1)
        v = (h @ w[p + "self_attn.v_proj.weight"].T).view(t, hkv, d).transpose(0, 1)
        q, k = q * cos + rot(q) * sin, k * cos + rot(k) * sin
        k, v = k.repeat_interleave(hq // hkv, 0), v.repeat_interleave(hq // hkv, 0)
        att = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(d) + mask, -1)  # (Hq, T, T)
        x = x + (att @ v).transpose(0, 1).reshape(t, dim) @ w[p + "self_attn.o_proj.weight"].T
        h = norm(x, w[p + "post_attention_layernorm.weight"])
        gate = torch.nn.functional.silu(h @ w[p + "mlp.gate_proj.weight"].T)
        x = x + (gate * (h @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    return norm(x, w["model.norm.weight"]) @ head.T


def write_hf_checkpoint(path, conf: dict, seed: int = 0) -> dict:
    """A random Llama checkpoint (config.json, model.safetensors, tokenizer.json) in ``path``."""
    from safetensors.torch import save_file

    from treeattn.llm.formats.tokenizer import byte_tokenizer

    gen = torch.Generator().manual_seed(seed)
    dim, hid, v = conf["hidden_size"], conf["intermediate_size"], conf["vocab_size"]
    d = dim // conf["num_attention_heads"]
    shapes = {"model.embed_tokens.weight": (v, dim), "model.norm.weight": (dim,)}
    if not conf["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (v, dim)
    for i in range(conf["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (dim,), p + "post_attention_layernorm.weight":
                   (dim,), p + "self_attn.q_proj.weight": (dim, dim),
                   p + "self_attn.k_proj.weight": (conf["num_key_value_heads"] * d, dim),
                   p + "self_attn.v_proj.weight": (conf["num_key_value_heads"] * d, dim),
                   p + "self_attn.o_proj.weight": (dim, dim), p + "mlp.gate_proj.weight":
                   (hid, dim), p + "mlp.up_proj.weight": (hid, dim),
                   p + "mlp.down_proj.weight": (dim, hid)}
    w = {}
    for name, shape in shapes.items():
        if len(shape) == 1:
            w[name] = 1 + 0.1 * torch.randn(shape, generator=gen)
        else:
            w[name] = torch.randn(shape, generator=gen) * shape[1] ** -0.5
    save_file(w, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(conf))
    byte_tokenizer().backend.save(str(path / "tokenizer.json"))
    return w


def hf_conf(**overrides) -> dict:
    conf = dict(model_type="llama", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, vocab_size=256, rms_norm_eps=1e-5,
                rope_theta=10000.0, max_position_embeddings=512, tie_word_embeddings=False)
    return conf | overrides


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


@pytest.mark.parametrize("tied,scaling", [(False, None), (True, LLAMA3)])
def test_hf_checkpoint_matches_naive_reference(tmp_path, tied, scaling):
    conf = hf_conf(tie_word_embeddings=tied, rope_scaling=scaling)
    weights = write_hf_checkpoint(tmp_path, conf)
    loaded = load_model(str(tmp_path))
    tokens = [5, 77, 3, 200, 14, 9, 31, 42, 250, 1, 0, 128] * 8  # 96 positions: beyond 64
    expected = naive_hf_llama(weights, conf, tokens)[-1]  # (V,)
    got = prefill(loaded.model, tokens, LocalCache(conf["num_hidden_layers"]))[0]  # (V,)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=RTOL)


def test_llama3_scaling_matches_scalar_reference():
    scaling = dict(LLAMA3, original_max_position_embeddings=8192)
    conf = LlamaConfig(dim=128, n_layers=1, n_heads=1, n_kv_heads=1, hidden_dim=8, vocab_size=8,
                       rope_base=500000.0, rope_scaling=scaling)
    from treeattn.llm.model import rope_inv_freq

    expected = llama3_inv_freq_ref(128, 500000.0, 8.0, 1.0, 4.0, 8192).float()
    torch.testing.assert_close(rope_inv_freq(conf), expected)


@settings(max_examples=20, deadline=None)
@given(pos=st.integers(0, 100_000), seed=st.integers(0, 2**16))
def test_rope_rotates_interleaved_pairs_like_complex_multiplication(pos, seed):
    x = torch.randn(1, 2, 1, 16, generator=torch.Generator().manual_seed(seed))
    inv = 1.0 / 10000.0 ** (torch.arange(0, 16, 2).float() / 16)
    cos, sin = rope_cos_sin(inv, torch.tensor([pos]))
    got = apply_rope(x, cos, sin)
    z = torch.view_as_complex(x.unflatten(-1, (-1, 2)).contiguous())  # (1, 2, 1, 8)
    angle = pos * inv.double()
    rotated = z.to(torch.complex128) * torch.polar(torch.ones_like(angle), angle)
    expected = torch.view_as_real(rotated).flatten(-2).float()
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_decode_steps_match_one_prefill():
    """Token-by-token decode (partial_attention kernel) = one causal prefill (SDPA)."""
    model = random_model(LlamaConfig.from_name("debug"), seed=3)
    tokens = list(range(40, 80))
    full = prefill(model, tokens, LocalCache(2))
    cache = LocalCache(2)
    logits = prefill(model, tokens[:5], cache)
    for pos in range(5, len(tokens)):
        logits = model(torch.tensor([[tokens[pos]]]), pos, cache)
    torch.testing.assert_close(logits, full, atol=ATOL, rtol=RTOL)


def test_chunked_prefill_matches_one_chunk():
    model = random_model(LlamaConfig.from_name("debug"), seed=4)
    tokens = [7 * i % 256 for i in range(50)]
    one = prefill(model, tokens, LocalCache(2), chunk=1024)
    chunked = prefill(model, tokens, LocalCache(2), chunk=7)
    torch.testing.assert_close(chunked, one, atol=ATOL, rtol=RTOL)


def test_bad_shapes_and_names_are_model_errors(tmp_path):
    with pytest.raises(ModelError, match="heads"):
        LlamaConfig(dim=64, n_layers=1, n_heads=6, n_kv_heads=4, hidden_dim=8, vocab_size=8)
    with pytest.raises(ModelError, match="unknown model config"):
        LlamaConfig.from_name("llama-99b")
    with pytest.raises(ModelError, match="model not found"):
        load_model(str(tmp_path / "nope.gguf"))
    (tmp_path / "config.json").write_text(json.dumps(hf_conf(model_type="mistral")))
    with pytest.raises(ModelError, match="unsupported architecture"):
        load_model(str(tmp_path))


def test_tokenizer_and_chat_template(tmp_path):
    from treeattn.llm.formats.tokenizer import Tokenizer, byte_tokenizer

    tok = byte_tokenizer()
    text = "héllo, wörld ✓ 123\n\ttab"
    assert tok.decode(tok.encode(text)) == text
    assert len(tok.encode("abc")) == 3
    chat = Tokenizer(tok.backend, chat_template=(
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"))
    assert chat.render_chat("hi") == "<user>hi<assistant>"
    with pytest.raises(ModelError, match="no chat template"):
        tok.render_chat("hi")
    evil = Tokenizer(tok.backend, chat_template="{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(Exception):  # noqa: B017 - the sandbox refuses; any error is fine
        evil.render_chat("hi")


def test_bos_is_added_once():
    from treeattn.llm.formats.tokenizer import Tokenizer, byte_tokenizer

    backend = byte_tokenizer().backend
    bos = backend.token_to_id("A")
    tok = Tokenizer(backend, bos_id=bos, add_bos=True)
    assert tok.encode("bc")[0] == bos and len(tok.encode("bc")) == 3
    assert tok.encode("Abc") == [bos, *tok.encode("bc")[1:]]  # a template's own BOS is kept


def test_hf_directory_tokenizer_config_gives_eos_and_chat_template(tmp_path):
    write_hf_checkpoint(tmp_path, hf_conf())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": {"content": "!"}, "bos_token": "#",
        "chat_template": "{{ bos_token }}{% for m in messages %}{{ m['content'] }}"
                         "{{ eos_token }}{% endfor %}"}))
    tok = load_model(str(tmp_path)).tokenizer
    assert tok.eos_id == tok.backend.token_to_id("!")
    assert tok.render_chat("hi") == "#hi!"
