"""One validating reader for a Hugging Face model folder, shared by both engines.

A folder is ``config.json`` + ``*.safetensors`` (+ ``tokenizer.json`` and
``tokenizer_config.json``). Whatever it holds, reading it ends in the model or in one
:class:`~treeattn.llm.errors.ModelError` naming the file and the field, before any weight is
loaded and before any token is decoded:

* JSON files are read bounded (size and nesting, :mod:`treeattn.inputs`) and must be objects.
* Every config field the own engine uses is read with transformers' semantics
  (:func:`llama_config`): RoPE theta and scaling from ``rope_parameters`` (transformers 5) or
  the older ``rope_theta``/``rope_scaling``; the ``default``, ``linear`` and ``llama3`` RoPE
  types are implemented, every other type is refused by name; ``hidden_act`` must be SiLU;
  ``tie_word_embeddings`` must be a JSON boolean; biases and a head size other than
  ``hidden_size / heads`` are refused, since the own engine's Llama has neither.
* The weight files' headers are read before any tensor (:func:`weight_shapes`): a truncated
  or unreadable file, a missing or unexpected tensor, or a shape that disagrees with the config
  is named. Work stays bounded: the config's sizes are checked against the tensors the files
  really hold before anything is allocated, so a config claiming 10⁸ layers is refused at once.
* Tensors are checked finite when loaded (:func:`treeattn.llm.model.check_finite`).
"""

from __future__ import annotations

from pathlib import Path

from treeattn.inputs import Fields, InputError, read_json
from treeattn.llm.errors import ModelError
from treeattn.llm.model import LlamaConfig

CONFIG_LIMIT = 4 << 20  # bytes: real config.json files are a few KiB
TOKENIZER_CONFIG_LIMIT = 64 << 20  # tokenizer_config.json may embed a large vocabulary
MAX_LAYERS, MAX_HEADS, MAX_DIM, MAX_VOCAB = 4096, 4096, 1 << 20, 1 << 24
# transformers' RoPE types (modeling_rope_utils.ROPE_INIT_FUNCTIONS) the own engine computes;
# the rest (dynamic, yarn, longrope, proportional) are refused by name.
ROPE_TYPES = ("default", "linear", "llama3")
SILU_NAMES = ("silu", "swish")  # transformers' ACT2FN maps both to SiLU


def read_json_object(path: Path, what: str, limit: int) -> dict:
    """A JSON object from ``path``, read bounded; ModelError on anything else."""
    try:
        data = read_json(path, what, limit)
    except InputError as exc:
        raise ModelError(str(exc)) from None
    if not isinstance(data, dict):
        raise ModelError(f"{what} {path}: expected a JSON object, got "
                         f"{'a list' if isinstance(data, list) else type(data).__name__}")
    return data


def read_config(folder: Path) -> dict:
    """``config.json`` of ``folder`` as a dict (any architecture), with a string model_type."""
    conf = read_json_object(folder / "config.json", "model config", CONFIG_LIMIT)
    model_type = conf.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise ModelError(f"model config {folder / 'config.json'}: field model_type: expected a "
                         "non-empty string")
    return conf


def read_tokenizer_config(folder: Path) -> dict:
    """``tokenizer_config.json`` of ``folder`` as a dict, or {} when there is none."""
    path = folder / "tokenizer_config.json"
    if not path.exists():
        return {}
    return read_json_object(path, "tokenizer config", TOKENIZER_CONFIG_LIMIT)


def rope_settings(fields: Fields, source: str) -> tuple[float, dict | None]:
    """``(theta, scaling)`` as transformers reads them: ``rope_parameters`` first, then the
    older top-level ``rope_theta`` and ``rope_scaling``. ``scaling`` is None for plain RoPE,
    else a dict with ``rope_type`` (``linear`` or ``llama3``) and that type's numbers."""
    params = fields.obj("rope_parameters", required=False) if fields.data.get(
        "rope_parameters") is not None else None
    legacy = fields.obj("rope_scaling", required=False) if fields.data.get(
        "rope_scaling") is not None else None
    if params is not None and params.has("full_attention"):
        raise ModelError(f"{source}: per-layer-type rope_parameters are not supported by the "
                         "own engine (use --engine hf)")
    block = params if params is not None else legacy
    theta = None
    if params is not None:
        theta = params.number("rope_theta", 1.0, 1e12, required=False, lo_open=True)
    if theta is None:
        theta = fields.number("rope_theta", 1.0, 1e12, required=False, default=10000.0,
                              lo_open=True)
    if block is None:
        return theta, None
    kind = block.data.get("rope_type", block.data.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ModelError(f"{source}: RoPE type {kind!r} is not supported by the own engine "
                         f"(supported: {', '.join(ROPE_TYPES)}; use --engine hf)")
    partial = block.number("partial_rotary_factor", 0.0, 1.0, required=False, default=1.0)
    if partial != 1.0:
        raise ModelError(f"{source}: partial_rotary_factor {partial} is not supported "
                         "(the own engine rotates the whole head)")
    if kind == "default":
        return theta, None
    scaling = {"rope_type": kind,
               "factor": block.number("factor", 0.0, 1e6, lo_open=True)}
    if kind == "llama3":
        low = block.number("low_freq_factor", 0.0, 1e6, lo_open=True)
        high = block.number("high_freq_factor", 0.0, 1e6, lo_open=True)
        if not high > low:
            raise ModelError(f"{source}: llama3 RoPE needs high_freq_factor > low_freq_factor, "
                             f"got {high} and {low}")
        original = block.number("original_max_position_embeddings", 1, 1 << 40,
                                required=False, default=None)
        if original is None:  # transformers falls back to max_position_embeddings
            original = fields.integer("max_position_embeddings", 1, 1 << 40)
        scaling |= {"low_freq_factor": low, "high_freq_factor": high,
                    "original_max_position_embeddings": float(original)}
    return theta, scaling


def llama_config(conf: dict, source: str) -> LlamaConfig:
    """A :class:`LlamaConfig` from a Llama ``config.json``, read with transformers' semantics;
    every field the own engine cannot honour is refused by name."""
    try:
        return _llama_config(Fields(conf, source), source)
    except InputError as exc:
        raise ModelError(str(exc)) from None


def _llama_config(f: Fields, source: str) -> LlamaConfig:
    model_type = f.string("model_type")
    if model_type != "llama":
        raise ModelError(f"unsupported architecture {model_type!r} in {source} (the own "
                         "engine runs llama; use --engine hf)")
    act = f.string("hidden_act", required=False, default="silu")
    if act not in SILU_NAMES:
        raise ModelError(f"{source}: hidden_act {act!r} is not supported by the own engine "
                         "(supported: silu)")
    for flag in ("attention_bias", "mlp_bias"):
        if f.boolean(flag, required=False, default=False):
            raise ModelError(f"{source}: {flag} true is not supported by the own engine "
                             "(its Llama has no biases)")
    dim = f.integer("hidden_size", 1, MAX_DIM)
    heads = f.integer("num_attention_heads", 1, MAX_HEADS)
    kv_heads = f.integer("num_key_value_heads", 1, MAX_HEADS, required=False, default=None)
    kv_heads = heads if kv_heads is None else kv_heads
    head_dim = f.data.get("head_dim")
    if head_dim is not None and (dim % heads or head_dim != dim // heads):
        raise ModelError(f"{source}: head_dim {head_dim} differs from hidden_size / "
                         f"num_attention_heads ({dim} / {heads}); the own engine derives it")
    theta, scaling = rope_settings(f, source)
    return LlamaConfig(
        dim=dim,
        n_layers=f.integer("num_hidden_layers", 1, MAX_LAYERS),
        n_heads=heads,
        n_kv_heads=kv_heads,
        hidden_dim=f.integer("intermediate_size", 1, 1 << 24),
        vocab_size=f.integer("vocab_size", 1, MAX_VOCAB),
        norm_eps=f.number("rms_norm_eps", 0.0, 1.0, required=False, default=1e-6,
                          lo_open=True),
        rope_base=theta,
        max_seq_len=f.integer("max_position_embeddings", 1, 1 << 40, required=False,
                              default=2048),
        tie_embeddings=f.boolean("tie_word_embeddings", required=False, default=False),
        rope_scaling=scaling,
        name=Path(source).parent.name or source,
    )


def weight_files(folder: Path) -> list[Path]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelError(f"{folder} has config.json but no *.safetensors weights")
    for file in files:
        if not file.is_file():
            raise ModelError(f"{file} is not a regular file")
    return files


def weight_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's name and shape from the files' headers, without reading a weight.

    A truncated file, a bad header or a tensor named in two files is a ModelError.
    """
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for file in weight_files(folder):
        try:
            with safe_open(str(file), "pt") as handle:
                for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    if name in shapes:
                        raise ModelError(f"{folder}: tensor {name} appears in two files")
                    shapes[name] = tuple(handle.get_slice(name).get_shape())
        except ModelError:
            raise
        except Exception as exc:  # safetensors raises its own error types and OSError
            why = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc)
            raise ModelError(f"cannot read {file}: {why}") from None
    return shapes


def llama_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """The tensors a transformers Llama checkpoint of ``config`` holds, with their shapes."""
    dim, d, hid, vocab = config.dim, config.head_dim, config.hidden_dim, config.vocab_size
    q, kv = config.n_heads * d, config.n_kv_heads * d
    shapes = {"model.embed_tokens.weight": (vocab, dim), "model.norm.weight": (dim,)}
    for i in range(config.n_layers):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (dim,),
                   p + "post_attention_layernorm.weight": (dim,),
                   p + "self_attn.q_proj.weight": (q, dim),
                   p + "self_attn.k_proj.weight": (kv, dim),
                   p + "self_attn.v_proj.weight": (kv, dim),
                   p + "self_attn.o_proj.weight": (dim, q),
                   p + "mlp.gate_proj.weight": (hid, dim),
                   p + "mlp.up_proj.weight": (hid, dim),
                   p + "mlp.down_proj.weight": (dim, hid)}
    return shapes


def check_llama_weights(folder: Path, config: LlamaConfig,
                        found: dict[str, tuple[int, ...]]) -> None:
    """Every tensor ``config`` needs is in ``found`` with its shape, and nothing else is.

    ``lm_head.weight`` is required when the embeddings are not tied, and ignored when they
    are (transformers ties it to the embedding then). Runs in time linear in the files'
    tensor count: the layer count is checked against the files before the expected names
    are listed.
    """
    layers = {name.split(".")[2] for name in found if name.startswith("model.layers.")}
    if config.n_layers > len(layers):
        raise ModelError(f"{folder}: config.json has {config.n_layers} layers but the weights "
                         f"hold {len(layers)}")
    expected = llama_shapes(config)
    if not config.tie_embeddings:
        expected["lm_head.weight"] = (config.vocab_size, config.dim)
    ignored = {name for name in found if name.endswith("rotary_emb.inv_freq")}
    if config.tie_embeddings:
        ignored.add("lm_head.weight")
    missing = sorted(set(expected) - set(found))
    if missing:
        raise ModelError(f"{folder}: tensor {missing[0]} is missing"
                         + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    extra = sorted(set(found) - set(expected) - ignored)
    if extra:
        raise ModelError(f"{folder}: unexpected tensor {extra[0]} for a llama model"
                         + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""))
    for name, shape in expected.items():
        if found[name] != shape:
            raise ModelError(f"{folder}: tensor {name} has shape {list(found[name])}, the "
                             f"config says {list(shape)}")


def read_llama_folder(folder: Path) -> tuple[LlamaConfig, list[Path]]:
    """The validated config of a Llama folder and its weight files, nothing loaded yet."""
    conf = read_config(folder)
    config = llama_config(conf, str(folder / "config.json"))
    check_llama_weights(folder, config, weight_shapes(folder))
    return config, weight_files(folder)
