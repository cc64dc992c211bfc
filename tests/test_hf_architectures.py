"""Every causal-LM architecture transformers ships, built tiny with random weights: through
``treeattn.hf`` at world 2 each one is either identical to transformers' own ``generate``
(greedy tokens, logits within 1e-4) or refused by :class:`treeattn.hf.HFIntegrationError`
naming its model type, before any token. Never another error, never different tokens.

The outcome of each is the table of docs/hf.md ("Architectures", between its markers); set
``TREEATTN_WRITE_HF_TABLE=1`` to rewrite it from a run. Architectures whose config cannot
be built tiny (or whose model cannot generate in one process) are listed as such.
"""

from __future__ import annotations

import functools
import os
import warnings
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from treeattn.runtime.launch import LaunchOptions, launch  # noqa: E402

pytestmark = pytest.mark.timeout(900)
LOGIT_ATOL = 1e-4
NEW_TOKENS = 4
DOC = Path(__file__).resolve().parents[1] / "docs" / "hf.md"
BEGIN, END = "<!-- architectures: begin -->", "<!-- architectures: end -->"

# Integer config fields set to tiny values wherever a config has them.
TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            max_position_embeddings=128, n_embd=32, n_layer=2, n_head=4, n_positions=128,
            d_model=32, num_layers=2, n_layers=2, num_heads=4, ffn_dim=48, n_inner=48,
            d_ff=48, moe_intermediate_size=16, num_experts=4, num_local_experts=4,
            n_routed_experts=4, num_experts_per_tok=2, shared_expert_intermediate_size=16,
            decoder_layers=2, decoder_attention_heads=4, decoder_ffn_dim=48,
            encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=48,
            first_k_dense_replace=1, n_shared_experts=1, sliding_window=3,
            attention_chunk_size=3, rotary_dim=8, v_head_dim=8)
# Layer patterns with an attention layer among the first two (the defaults start with more
# recurrent layers than a two-layer model has).
PATTERNS = {
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                  mamba_dt_rank=4, mamba_d_state=4),
    "granitemoehybrid": dict(layer_types=["mamba", "attention"], mamba_n_heads=4,
                             mamba_d_head=16, mamba_n_groups=1, mamba_d_state=4,
                             hidden_size=32, mamba_expand=2),
    "bamba": dict(attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1,
                  mamba_d_state=4, hidden_size=32, mamba_expand=2),
    "recurrent_gemma": dict(block_types=["recurrent", "attention"], attention_window_size=3,
                            lru_width=32),
}


def model_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def tiny_config(model_type: str):
    """The architecture's default config with every size in :data:`TINY` it has; a layer
    pattern (``layer_types``) cut to two layers keeping its first two kinds."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    pattern = PATTERNS.get(model_type, {})
    config = CONFIG_MAPPING[model_type](**({"num_hidden_layers": 2, **pattern} if pattern
                                           else {}))
    text = config.get_text_config(decoder=True)
    for name, value in TINY.items():
        now = getattr(text, name, None)
        if (isinstance(now, int) and not isinstance(now, bool)) or (
                name == "head_dim" and hasattr(text, name) and now is None):
            try:
                setattr(text, name, value)
            except (AttributeError, TypeError, ValueError):  # a derived, read-only field
                pass
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):  # inside the tiny vocab
        if isinstance(getattr(text, name, None), int) and getattr(text, name) >= 64:
            setattr(text, name, 1)
    types = getattr(text, "layer_types", None)
    if isinstance(types, list) and len(types) != text.num_hidden_layers:
        kinds = list(dict.fromkeys(types))
        text.layer_types = (kinds * text.num_hidden_layers)[: text.num_hidden_layers]
    return config


def _outcome(model_type: str, ctx) -> tuple[str, str]:
    """(status, detail) of one architecture on this rank: ``identical``, ``refused``,
    ``not tiny`` (transformers itself cannot build or run it so), or a failure."""
    import treeattn.hf
    from treeattn.hf import HFIntegrationError

    try:
        config = tiny_config(model_type)
        treeattn.hf.check_served(config, unlisted=True)
    except HFIntegrationError as exc:
        return "refused", str(exc)
    except Exception as exc:  # noqa: BLE001 - transformers cannot build it tiny
        return "not tiny", f"{type(exc).__name__}"
    try:
        torch.manual_seed(7)
        model = transformers.AutoModelForCausalLM.from_config(
            config, attn_implementation="eager").eval()
        vocab = min(int(model.config.get_text_config(decoder=True).vocab_size), 64)
        ids = torch.randint(3, vocab, (1, 7), generator=torch.Generator().manual_seed(3))
        kw = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                  output_logits=True, return_dict_in_generate=True)
        want = model.generate(ids, **kw)
    except Exception as exc:  # noqa: BLE001 - transformers cannot run it tiny
        return "not tiny", f"{type(exc).__name__}"
    try:
        model.set_attn_implementation("treeattn")
        cache = treeattn.hf.ShardedCache(model.config, "tree", reserve=NEW_TOKENS,
                                         timeout_s=30, unlisted=True)
        got = model.generate(ids, cache=cache, **kw)
    except HFIntegrationError as exc:
        return "refused", str(exc)
    except Exception as exc:  # noqa: BLE001 - the failure this test exists to catch
        return "error", f"{type(exc).__name__}: {str(exc)[:200]}"
    if not torch.equal(got.sequences, want.sequences):
        return "different", "tokens"
    err = float((torch.stack(got.logits) - torch.stack(want.logits)).abs().max())
    if not err < LOGIT_ATOL:
        return "different", f"logits by {err:.2g}"
    return "identical", ", ".join(sorted(set(cache.kinds)))


def _sweep_job(ctx, types: list[str], progress: str | None = None):
    """Every architecture on this rank; rank 0 returns every rank's rows."""
    from treeattn.runtime.group import all_gather_objects

    warnings.filterwarnings("ignore")
    transformers.utils.logging.set_verbosity_error()
    rows = []
    for t in types:
        rows.append((t, *_outcome(t, ctx)))
        if progress and ctx.rank == 0:
            with open(progress, "a") as f:
                f.write(repr(rows[-1]) + "\n")
    return all_gather_objects(ctx, rows)


def table(rows) -> str:
    """The docs table: each architecture's outcome, served first."""
    order = {"identical": 0, "refused": 1, "not tiny": 2}
    lines = ["| model type | through treeattn.hf | layers / reason |", "|---|---|---|"]
    for model_type, status, detail in sorted(rows, key=lambda r: (order.get(r[1], 3), r[0])):
        word = {"identical": "served, identical", "refused": "refused by name",
                "not tiny": "not built tiny here"}.get(status, status)
        if status == "refused":
            detail = detail.split(": ", 1)[-1] if detail.startswith(model_type) else detail
        lines.append(f"| `{model_type}` | {word} | {detail.replace('|', '/')} |")
    return "\n".join(lines)


def test_every_causal_lm_is_identical_or_refused_by_name():
    ranks = launch(functools.partial(_sweep_job, types=model_types()), 2,
                   LaunchOptions(timeout_s=120, threads=1, deadline_s=900))
    rows = ranks[0]
    assert all(r == rows for r in ranks), "the ranks saw different outcomes"
    bad = [r for r in rows if r[1] not in ("identical", "refused", "not tiny")]
    assert not bad, bad
    for model_type, status, detail in rows:
        if status == "refused":
            assert model_type in detail, (model_type, detail)
    from treeattn.hf.support import SERVED_MODEL_TYPES, model_type

    served = {r[0] for r in rows if r[1] == "identical"}
    assert {"llama", "mistral", "gemma2", "gemma3", "gpt_oss", "cohere2", "jamba",
            "lfm2"} <= served
    names = sorted({model_type(tiny_config(t)) for t in served})
    assert set(names) == SERVED_MODEL_TYPES, f"SERVED_MODEL_TYPES should be {names}"
    text = DOC.read_text()
    start, stop = text.index(BEGIN) + len(BEGIN), text.index(END)
    got = "\n" + table(rows) + "\n"
    if os.environ.get("TREEATTN_WRITE_HF_TABLE"):
        from treeattn.atomic import write_text

        write_text(DOC, text[:start] + got + text[stop:])
    else:
        assert text[start:stop] == got, "docs/hf.md's table is stale: rerun with " \
            "TREEATTN_WRITE_HF_TABLE=1"
