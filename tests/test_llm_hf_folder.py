"""The own engine reads a Hugging Face folder as transformers does, or refuses it by name.

The reference is transformers itself: a tiny ``LlamaForCausalLM`` saved with
``save_pretrained`` (so ``config.json`` is in transformers 5's own layout, RoPE under
``rope_parameters``) and its first-step logits against the own engine's on the same folder.
Every hostile folder below must end in one :class:`ModelError` naming the problem, before a
token is decoded.
"""

from __future__ import annotations

import json

import pytest
import torch

from treeattn.llm.errors import ModelError
from treeattn.llm.formats.tokenizer import byte_tokenizer
from treeattn.llm.formats.weights import load_model
from treeattn.llm.local_cache import LocalCache, prefill

transformers = pytest.importorskip("transformers")
torch.set_num_threads(1)

LOGIT_ATOL = 1e-5
TOKENS = [5, 77, 3, 200, 14, 9, 31, 42, 250, 1, 0, 128] * 6  # 72 positions: past the 32 below

ROPES = {
    "theta-500k": {"rope_type": "default", "rope_theta": 500000.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
}


def save_tiny_llama(folder, rope: dict, tied: bool = False, seed: int = 0):
    """A tiny random Llama saved by transformers, with a byte-level tokenizer."""
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, max_position_embeddings=128,
        rms_norm_eps=1e-5, tie_word_embeddings=tied, rope_parameters=dict(rope))
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # transformers initialises norms to 1: make them matter
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(0.1 * torch.randn_like(param))
    model.save_pretrained(folder)
    byte_tokenizer().backend.save(str(folder / "tokenizer.json"))
    return model


def transformers_logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([TOKENS])).logits[0, -1].float()  # (V,)


@pytest.mark.parametrize("rope", sorted(ROPES))
@pytest.mark.parametrize("tied", [False, True])
def test_first_logits_match_transformers(tmp_path, rope, tied):
    reference = save_tiny_llama(tmp_path, ROPES[rope], tied)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["tie_word_embeddings"] is tied  # the folder really is what we meant
    loaded = load_model(str(tmp_path))
    got = prefill(loaded.model, TOKENS, LocalCache(2))[0]  # (V,)
    torch.testing.assert_close(got, transformers_logits(reference), atol=LOGIT_ATOL, rtol=0)


def test_legacy_rope_theta_and_rope_scaling_are_read_too(tmp_path):
    """Older folders keep theta at the top level and the scaling under ``rope_scaling``."""
    reference = save_tiny_llama(tmp_path, ROPES["llama3"])
    conf = json.loads((tmp_path / "config.json").read_text())
    params = conf.pop("rope_parameters")
    conf["rope_theta"] = params.pop("rope_theta")
    conf["rope_scaling"] = params
    (tmp_path / "config.json").write_text(json.dumps(conf))
    got = prefill(load_model(str(tmp_path)).model, TOKENS, LocalCache(2))[0]
    torch.testing.assert_close(got, transformers_logits(reference), atol=LOGIT_ATOL, rtol=0)


def edit_config(folder, **changes):
    conf = json.loads((folder / "config.json").read_text())
    for key, value in changes.items():
        if value is ...:
            conf.pop(key, None)
        else:
            conf[key] = value
    (folder / "config.json").write_text(json.dumps(conf))


@pytest.fixture(scope="module")
def good_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    save_tiny_llama(folder, ROPES["theta-500k"])
    return folder


@pytest.fixture
def folder(good_folder, tmp_path):
    for path in good_folder.iterdir():
        (tmp_path / path.name).write_bytes(path.read_bytes())
    return tmp_path


CONFIG_CASES = [
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}},
     "RoPE type 'yarn'"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 0}}, "factor"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                          "partial_rotary_factor": 0.5}}, "partial_rotary_factor"),
    ({"num_attention_heads": 0}, "num_attention_heads"),
    ({"num_hidden_layers": 100_000_000}, "num_hidden_layers"),
    ({"num_hidden_layers": 3}, "3 layers but the weights hold 2"),
    ({"vocab_size": 512}, "model.embed_tokens.weight has shape"),
    ({"attention_bias": True}, "attention_bias"),
    ({"head_dim": 8}, "head_dim 8"),
    ({"model_type": ["llama"]}, "model_type"),
]


@pytest.mark.parametrize("changes,message", CONFIG_CASES)
def test_a_config_the_engine_cannot_honour_is_refused_by_name(folder, changes, message):
    edit_config(folder, **changes)
    with pytest.raises(ModelError, match=message.replace("(", r"\(")):
        load_model(str(folder))


@pytest.mark.parametrize("text,message", [
    ("[1, 2, 3]", "expected a JSON object"),
    ("[" * 10_000 + "]" * 10_000, "nested 10000 deep"),
    ('{"model_type": "llama", "hidden_size": NaN}', "not valid JSON"),
])
def test_unreadable_json_is_refused(folder, text, message):
    (folder / "config.json").write_text(text)
    with pytest.raises(ModelError, match=message):
        load_model(str(folder))


@pytest.mark.parametrize("text", ["[1]", "[" * 10_000 + "]" * 10_000])
def test_a_tokenizer_config_that_is_not_an_object_is_refused(folder, text):
    (folder / "tokenizer_config.json").write_text(text)
    with pytest.raises(ModelError, match="tokenizer config"):
        load_model(str(folder))


def test_weights_that_are_missing_truncated_or_not_finite_are_named(folder):
    from safetensors.torch import load_file, save_file

    def read(path):  # copies: the files are rewritten below, so no tensor may map them
        return {name: tensor.clone() for name, tensor in load_file(str(path)).items()}

    weights = folder / "model.safetensors"
    state = read(weights)
    good = weights.read_bytes()

    weights.write_bytes(good[: len(good) // 2])
    with pytest.raises(ModelError, match="cannot read"):
        load_model(str(folder))

    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, str(weights))
    with pytest.raises(ModelError, match="model.layers.1.mlp.up_proj.weight is missing"):
        load_model(str(folder))

    weights.write_bytes(good)
    state = read(weights)
    state["model.layers.0.self_attn.k_proj.weight"][0, 0] = float("nan")
    save_file(state, str(weights))
    with pytest.raises(ModelError, match="k_proj.weight holds NaN"):
        load_model(str(folder))

    state["model.extra.weight"] = torch.zeros(1)
    state["model.layers.0.self_attn.k_proj.weight"][0, 0] = 0.0
    save_file(state, str(weights))
    with pytest.raises(ModelError, match="unexpected tensor model.extra.weight"):
        load_model(str(folder))

    weights.unlink()
    with pytest.raises(ModelError, match="no \\*.safetensors"):
        load_model(str(folder))


def test_a_tokenizer_larger_than_the_embedding_is_refused(folder):
    from safetensors.torch import load_file, save_file

    state = {name: t.clone() for name, t in load_file(str(folder / "model.safetensors")).items()}
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        state[name] = state[name][:200].contiguous()
    save_file(state, str(folder / "model.safetensors"))
    edit_config(folder, vocab_size=200)
    with pytest.raises(ModelError, match="tokenizer has 2\\d\\d tokens but the embedding only 200"):
        load_model(str(folder))
