"""Layers that do not grow with the context, through ``treeattn.hf``: sliding-window and
chunked layers (bounded K/V, whole on every rank) and recurrent layers (Mamba, gated
delta-net, short conv: transformers' own state) beside sharded full-attention layers.

Against transformers' own ``generate`` of the same weights in one process (eager attention,
its ``DynamicCache`` built from the config): 32 greedy tokens identical and every step's
logits within 1e-4, at worlds 2 and 3, windows and chunks shorter than the 13-token prompt.
One process group per world for every model.
"""

from __future__ import annotations

import functools

import pytest
import torch

transformers = pytest.importorskip("transformers")

from treeattn.runtime.launch import LaunchOptions, launch  # noqa: E402

pytestmark = pytest.mark.timeout(600)
LOGIT_ATOL = 1e-4
NEW_TOKENS = 32
PROMPT = 13
COMMON = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=8,
              max_position_embeddings=256)


def tiny_config(kind: str):
    """Tiny configs whose bounded layers see fewer tokens than the prompt."""
    t = transformers
    if kind == "mistral":  # every layer a 5-token window
        return t.MistralConfig(sliding_window=5, **COMMON)
    if kind == "qwen2_window":  # layer 0 full, layer 1 a window
        return t.Qwen2Config(use_sliding_window=True, sliding_window=4, max_window_layers=1,
                             **COMMON)
    if kind == "gemma2":  # soft-capped logits on both kinds, final logits soft-capped
        return t.Gemma2Config(sliding_window=4, attn_logit_softcapping=5.0,
                              final_logit_softcapping=3.0, query_pre_attn_scalar=8, **COMMON)
    if kind == "gemma3":
        return t.Gemma3TextConfig(sliding_window=4, layer_types=["sliding_attention",
                                                                 "full_attention"], **COMMON)
    if kind == "gpt_oss":  # attention sinks on every layer
        kw = {**COMMON, "intermediate_size": 32}
        return t.GptOssConfig(sliding_window=4, num_local_experts=4, num_experts_per_tok=2,
                              layer_types=["sliding_attention", "full_attention"], **kw)
    if kind == "cohere2":
        return t.Cohere2Config(sliding_window=4, layer_types=["sliding_attention",
                                                              "full_attention"], **COMMON)
    if kind == "llama4":  # a 4-token chunk on layer 0, a NoPE full layer 1
        kw = {k: v for k, v in COMMON.items() if k != "intermediate_size"}
        return t.Llama4TextConfig(attention_chunk_size=4, no_rope_layers=[1, 0],
                                  intermediate_size=64, intermediate_size_mlp=64,
                                  num_local_experts=2, interleave_moe_layer_step=2, **kw)
    if kind == "jamba":  # a Mamba layer, then attention
        return t.JambaConfig(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                             num_experts=2, mamba_d_state=4, mamba_dt_rank=4,
                             use_mamba_kernels=False, **COMMON)
    if kind == "lfm2":  # a short-conv layer, then attention
        kw = {k: v for k, v in COMMON.items() if k != "head_dim"}
        return t.Lfm2Config(full_attn_idxs=[1], **kw)
    if kind == "qwen3_next":  # a gated delta-net layer, then gated full attention
        return t.Qwen3NextConfig(layer_types=["linear_attention", "full_attention"],
                                 num_experts=2, num_experts_per_tok=1, moe_intermediate_size=32,
                                 shared_expert_intermediate_size=32, linear_num_key_heads=2,
                                 linear_num_value_heads=2, linear_key_head_dim=8,
                                 linear_value_head_dim=8, linear_conv_kernel_dim=2, **COMMON)
    if kind == "granitemoehybrid":
        return t.GraniteMoeHybridConfig(layer_types=["mamba", "attention"], mamba_d_state=4,
                                        mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1,
                                        mamba_expand=2, num_local_experts=2,
                                        num_experts_per_tok=1, **COMMON)
    raise ValueError(kind)


# sharded_prefill: windows and chunks straddle the ranks' zig-zag chunks (2-3 tokens each)
SHARDED_PREFILL = ("mistral", "qwen2_window", "gemma2", "gemma3", "gpt_oss", "cohere2",
                   "llama4")
SECOND_TURN = ("gemma2", "gpt_oss", "llama4")
KINDS = ("mistral", "qwen2_window", "gemma2", "gemma3", "gpt_oss", "cohere2", "llama4",
         "jamba", "lfm2", "qwen3_next", "granitemoehybrid")


def tiny_model(kind: str):
    torch.manual_seed(1234)  # the same weights on every rank
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(kind),
                                                          attn_implementation="eager")
    return model.eval()


def _generate(model, ids, **kw):
    out = model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                         do_sample=False, output_logits=True, return_dict_in_generate=True,
                         **kw)
    return out.sequences, torch.stack(out.logits)


def second_turn(model, ids, cache):
    """A first turn of 4 tokens on ``cache``, then a second (its output and three more ids)
    on the same cache; returns its (ids, logits) and transformers' own (eager, one process,
    from scratch) for the same ids."""
    first = model.generate(ids, cache=cache, max_new_tokens=4, do_sample=False)
    more = torch.cat([first, ids[:, :3]], dim=1)
    got = _generate(model, more, cache=cache)
    model.set_attn_implementation("eager")
    want = _generate(model, more)
    model.set_attn_implementation("treeattn")
    return got, want


def _all_kinds_job(ctx, algorithm: str):
    """Every kind of tiny model: replicated prefill then 32 greedy tokens; rank 0 reports
    (kind, max |logit diff|, layer kinds, bytes held per kind)."""
    import treeattn.hf

    report = []
    for kind in KINDS:
        model = tiny_model(kind)
        ids = torch.randint(0, 96, (1, PROMPT), generator=torch.Generator().manual_seed(5))
        want_ids, want_logits = _generate(model, ids)
        model.set_attn_implementation("treeattn")
        cache = treeattn.hf.ShardedCache(model.config, algorithm, reserve=NEW_TOKENS)
        got_ids, got_logits = _generate(model, ids, cache=cache)
        assert torch.equal(got_ids, want_ids), kind
        err = float((got_logits - want_logits).abs().max())
        assert err < LOGIT_ATOL, (kind, err)
        memory = cache.memory_bytes()
        if kind in SECOND_TURN:  # a second turn on the same cache
            (turn_ids, turn_logits), (ref_ids, ref_logits) = second_turn(
                model, ids, treeattn.hf.ShardedCache(model.config, algorithm))
            assert torch.equal(turn_ids, ref_ids), ("second turn", kind)
            err = max(err, float((turn_logits - ref_logits).abs().max()))
            assert err < LOGIT_ATOL, ("second turn", kind, err)
        if kind in SHARDED_PREFILL:
            cache = treeattn.hf.ShardedCache(model.config, algorithm, reserve=NEW_TOKENS)
            assert treeattn.hf.sharded_prefill(model, ids, cache) == PROMPT - 1
            got_ids, got_logits = _generate(model, ids, cache=cache)
            assert torch.equal(got_ids, want_ids), ("sharded", kind)
            err = max(err, float((got_logits - want_logits).abs().max()))
            assert err < LOGIT_ATOL, ("sharded", kind, err)
        else:
            cache = treeattn.hf.ShardedCache(model.config, algorithm)
            try:
                treeattn.hf.sharded_prefill(model, ids, cache)
                raise AssertionError(f"{kind}: sharded_prefill was not refused")
            except treeattn.hf.HFIntegrationError as exc:
                memory["refused"] = str(exc)
        report.append((kind, err, cache.kinds, memory))
    return report


@pytest.mark.parametrize("world,algorithm", [(2, "tree"), (3, "butterfly")])
def test_bounded_and_recurrent_layers_like_one_process(world, algorithm):
    report = launch(functools.partial(_all_kinds_job, algorithm=algorithm), world,
                    LaunchOptions(timeout_s=300, threads=1))
    assert [r[0] for r in report] == list(KINDS)
    kinds = {r[0]: r[2] for r in report}
    assert kinds["mistral"] == ["window", "window"] and kinds["llama4"] == ["window", "full"]
    assert kinds["jamba"] == ["recurrent", "full"] and kinds["lfm2"] == ["recurrent", "full"]
    memory = {r[0]: r[3] for r in report}
    assert memory["gemma3"]["window"] == 2 * 1 * 2 * 3 * 8 * 4  # K and V, 3 = window - 1
    assert memory["jamba"]["recurrent"] > 0
    assert "recurrent (Mamba, linear-attention, conv) layers" in memory["lfm2"]["refused"]
