"""What the transformers integration serves, per model type and per layer, and what it refuses.

A decoder's layers come in kinds, read from its config by transformers' own
``get_layer_types_and_kwargs`` (the layer types its ``DynamicCache`` is built from):

- ``"full"`` (``full_attention``): attends to the whole cache, which grows with the context;
  sharded along the sequence (:class:`treeattn.hf.cache.ShardedLayer`);
- ``"window"`` (``sliding_attention``, ``chunked_attention``): attends to at most the last
  ``sliding_window`` (or the current ``attention_chunk_size``) tokens; its bounded K/V is kept
  whole on every rank by transformers' own sliding-window layer and attended locally;
- ``"recurrent"`` (``linear_attention``, ``conv``: Mamba, gated-delta-net, short-conv
  layers): a fixed-size state, kept on every rank by transformers' own layer;
- ``"none"`` (``dummy``): no cache (a layer reusing another's, or one without attention).

:func:`check_served` refuses by name, before any token, what would otherwise give an error
deep inside transformers or a wrong answer: position biases added to the scores (ALiBi),
cross-attention, multi-head latent attention, attention that is not transformers' attention
interface called once per cache update, and layer types without a kind above.
"""

from __future__ import annotations

from treeattn.runtime.errors import RuntimeFailure


class HFIntegrationError(RuntimeFailure):
    """A model, cache or call the transformers integration does not serve (named)."""


LAYER_KINDS = {"full_attention": "full", "sliding_attention": "window",
               "chunked_attention": "window", "linear_attention": "recurrent",
               "conv": "recurrent", "dummy": "none"}

# Model types refused whatever their config says, with the reason (checked by
# tests/test_hf_architectures.py over every decoder transformers can build tiny).
REFUSED_MODEL_TYPES = {
    "bloom": "ALiBi position biases are added to the attention scores",
    "mpt": "ALiBi position biases are added to the attention scores",
    "falcon": "its attention is dispatched by its own table (and may add ALiBi biases), not "
              "transformers' attention interface",
    "gpt_neo": "its attention is dispatched by its own table, not transformers' attention "
               "interface",
    "diffllama": "each layer calls attention twice per cache update (differential attention)",
    "xglm": "its attention does not go through transformers' attention interface",
    "jetmoe": "its mixture-of-attention-heads layer does not keep its K/V in the cache "
              "layer transformers hands it",
    "reformer": "LSH and local attention keep their own buckets, not a K/V cache",
    "rwkv": "an RWKV state, not transformers' cache",
    "xlstm": "an xLSTM state, not transformers' cache",
    "mllama": "cross-attention layers attend to the image, not the text cache",
    "doge": "its dynamic mask is computed in the layer from every cached value",
    "minimax": "it keeps a cache of its own (lightning attention)",
    "openai-gpt": "it keeps no K/V cache",
}


# The decoders' model types tests/test_hf_architectures.py finds identical to transformers'
# own generate (it checks this list against its run).
SERVED_MODEL_TYPES = frozenset({
    "afmoe", "apertus", "apertus1p5_text", "arcee", "aria_text", "bamba", "beam", "bert",
    "bert-generation", "biogpt", "bitnet", "camembert", "codegen", "cohere", "cohere2",
    "cohere2_moe", "ctrl", "cwm", "data2vec-text", "electra", "emu3_text_model", "ernie",
    "ernie4_5", "ernie4_5_moe", "exaone", "exaone4", "exaone_moe", "flex_olmo", "flint",
    "gemma", "gemma2", "gemma3_text", "glm", "glm4", "glm4_moe", "gpt2", "gpt_bigcode",
    "gpt_neox", "gpt_oss", "gptj", "granite", "granite_swa", "granitemoe", "granitemoe_swa",
    "granitemoehybrid", "granitemoeshared", "helium", "hunyuan_v1_dense", "hunyuan_v1_moe",
    "hy_v3", "hyperclovax", "internlm3", "iquestcoder", "jais2", "jamba", "kolibri1",
    "laguna", "lara_mini", "lfm2", "lfm3", "llama", "llama4_text", "mellum", "mimo_v2_flash",
    "minimax_m2", "minimax_m3_vl_text", "ministral", "ministral3", "mistral", "mixtral",
    "modernbert-decoder", "moshi", "nanochat", "nemotron_h", "olmo", "olmo2", "olmo3",
    "olmo_hybrid", "olmoe", "opt", "persimmon", "phi", "phi3", "phi4_multimodal", "phimoe",
    "qwen2", "qwen2_moe", "qwen3", "qwen3_5_moe_text", "qwen3_5_text", "qwen3_moe",
    "qwen3_next", "recurrent_gemma", "roberta", "roberta-prelayernorm", "roc_bert",
    "sarvam_moe", "seed_oss", "smollm3", "solar_open", "stablelm", "starcoder2", "vaultgemma",
    "xlm-roberta", "xlm-roberta-xl",
})


def text_config(config):
    """The decoder's config of a (possibly multimodal) config."""
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if get is not None else config


def model_type(config) -> str:
    return str(getattr(text_config(config), "model_type", None)
               or getattr(config, "model_type", "unknown"))


def layer_kinds(config) -> list[str]:
    """Each layer's kind (``"full"``, ``"window"``, ``"recurrent"``, ``"none"``), from the
    layer types transformers builds its own cache from; refuses a type without a kind."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    text, name = text_config(config), model_type(config)
    try:
        types, _ = get_layer_types_and_kwargs(text)
    except Exception as exc:  # noqa: BLE001 - transformers' own failure, named
        raise HFIntegrationError(f"{name}: transformers cannot tell its layer types "
                                 f"({type(exc).__name__}: {exc})") from exc
    kinds = []
    for i, layer_type in enumerate(types):
        if layer_type not in LAYER_KINDS:
            raise HFIntegrationError(f"{name}: layer {i} is {layer_type!r}, which treeattn does "
                                     "not serve (served: full, sliding-window and chunked "
                                     "attention, linear-attention, Mamba and conv layers)")
        kinds.append(LAYER_KINDS[layer_type])
    return kinds


def check_served(config, unlisted: bool = False) -> list[str]:
    """Refuse, naming the model type and the reason, a model treeattn does not serve; returns
    each layer's kind (:func:`layer_kinds`). A model type outside :data:`SERVED_MODEL_TYPES`
    (the ones found identical to transformers) is refused too, unless ``unlisted``."""
    from transformers import PretrainedConfig

    if not isinstance(config, PretrainedConfig):
        raise HFIntegrationError(f"config must be the model's transformers config "
                                 f"(model.config), got {type(config).__name__}")
    text, name = text_config(config), model_type(config)
    if name in REFUSED_MODEL_TYPES:
        raise HFIntegrationError(f"{name} is not served by treeattn: "
                                 f"{REFUSED_MODEL_TYPES[name]}")
    if getattr(config, "is_encoder_decoder", False) or getattr(text, "add_cross_attention",
                                                                  False) \
            or getattr(text, "cross_attention_layers", None):
        raise HFIntegrationError(f"{name} is not served by treeattn: cross-attention")
    if getattr(text, "kv_lora_rank", None):
        raise HFIntegrationError(f"{name} is not served by treeattn: multi-head latent "
                                 "attention (MLA, kv_lora_rank is set) has no sharded cache")
    for flag in ("alibi", "use_alibi", "position_embedding_type"):
        value = getattr(text, flag, None)
        if value is True or (isinstance(value, str) and value.lower() in ("alibi", "relative_key",
                                                                          "relative_key_query")):
            raise HFIntegrationError(f"{name} is not served by treeattn: position biases "
                                     f"added to the attention scores ({flag}={value!r})")
    kinds = layer_kinds(config)
    if "full" not in kinds and "window" not in kinds:
        raise HFIntegrationError(f"{name} is not served by treeattn: no layer keeps K/V, so "
                                 "there is nothing to shard (use transformers' own cache)")
    if name not in SERVED_MODEL_TYPES and not unlisted:
        raise HFIntegrationError(f"{name} is not in treeattn's list of served model types "
                                 "(docs/hf.md, Architectures); ShardedCache(..., "
                                 "unlisted=True) runs it unvetted")
    return kinds

