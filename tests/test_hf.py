"""transformers' own ``generate`` with ``attn_implementation="treeattn"`` and a
``ShardedCache``, against transformers' single-process ``generate`` of the same model.

Reference: the same model, same weights (seeded), default SDPA attention and DynamicCache, in
each rank's process. fp32 throughout; the only difference is the order in which attention's
partials are merged, so greedy tokens must be identical and the logits of every step within
``LOGIT_ATOL`` (1e-4 absolute on O(1) logits; a wrong shard, position or merge moves them by
far more). Small random configs: Llama with grouped-query attention, Qwen2 with attention
bias; SmolLM2 from the default GGUF.
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


def tiny_config(kind: str):
    common = dict(vocab_size=160, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  max_position_embeddings=512)
    if kind == "llama":  # GQA: 4 query heads share 2 KV heads
        return transformers.LlamaConfig(num_attention_heads=4, num_key_value_heads=2, **common)
    if kind == "qwen2":  # attention bias on q, k, v; 6 query heads over 3 ranks' shards
        return transformers.Qwen2Config(num_attention_heads=6, num_key_value_heads=3,
                                        use_sliding_window=False, **common)
    raise ValueError(kind)


def tiny_model(kind: str):
    torch.manual_seed(1234)  # the same weights on every rank
    config = tiny_config(kind)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    return model.eval()


def _generate(model, ids, **kw):
    out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS,
                         output_logits=True, return_dict_in_generate=True, **kw)
    return out.sequences, torch.stack(out.logits)


def _compare_job(ctx, kind: str, runs: list[tuple[str, str, int]], batch: int = 1,
                 pads: tuple[int, ...] = ()):
    """Each run against transformers' single-process generate; ``pads[b]``: left padding of
    sequence b (a batch of prompts of different lengths)."""
    import treeattn.hf

    model = tiny_model(kind)
    g = torch.Generator().manual_seed(99)
    ids = torch.randint(0, model.config.vocab_size, (batch, 13), generator=g)
    kw = {}
    if pads:
        mask = torch.ones_like(ids)
        for b, pad in enumerate(pads):
            mask[b, :pad] = 0
            ids[b, :pad] = 0  # the pad token
        kw["attention_mask"] = mask
    want_ids, want_logits = _generate(model, ids, **kw)
    model.set_attn_implementation("treeattn")
    report = []
    for algorithm, layout, interleave in runs:
        cache = treeattn.hf.ShardedCache(model.config, algorithm, layout=layout,
                                         interleave_size=interleave, reserve=NEW_TOKENS)
        got_ids, got_logits = _generate(model, ids, cache=cache, **kw)
        assert torch.equal(got_ids, want_ids), (algorithm, layout, got_ids, want_ids)
        err = float((got_logits - want_logits).abs().max())
        assert err < LOGIT_ATOL, (algorithm, layout, err)
        assert cache.get_seq_length() == ids.shape[1] + NEW_TOKENS - 1
        report.append((algorithm, layout, err, cache.layers[0].local))
    return report


def _refused(fn) -> str:
    """The message of the HFIntegrationError ``fn()`` raises (every rank raises alike)."""
    from treeattn.hf import HFIntegrationError

    try:
        fn()
    except HFIntegrationError as exc:
        return str(exc)
    raise AssertionError("nothing was refused")


def _world2_job(ctx):
    """Llama (GQA) with every partial-merging algorithm and both layouts, a batch of two,
    a left-padded batch of three prompts of different lengths, and a refusal, in one
    process group."""
    import treeattn.hf

    runs = [(a, "contiguous", 1) for a in ("tree", "butterfly", "oneshot", "helix", "dcp")]
    runs += [("tree", "interleaved", 1), ("auto", "interleaved", 4)]
    report = _compare_job(ctx, "llama", runs)
    batch = _compare_job(ctx, "llama", [("tree", "interleaved", 1)], batch=2)
    padded = _compare_job(ctx, "llama", [("tree", "contiguous", 1), ("dcp", "interleaved", 2)],
                          batch=3, pads=(0, 5, 2))
    model = tiny_model("llama")
    model.set_attn_implementation("treeattn")
    ids = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(3))
    cache = treeattn.hf.ShardedCache(model.config, "tree")
    cache.rank = 1 - cache.rank  # as if made on the other rank
    other = _refused(lambda: model.generate(ids, max_new_tokens=2, do_sample=False,
                                            cache=cache))
    sampled = _sampling(ctx, model)
    (got_ids, got_logits), (want_ids, want_logits) = second_turn(
        model, ids, treeattn.hf.ShardedCache(model.config, "dcp", layout="interleaved"))
    assert torch.equal(got_ids, want_ids)
    assert float((got_logits - want_logits).abs().max()) < LOGIT_ATOL
    return {"report": report, "batch": batch, "padded": padded, "other": other,
            "sampled": sampled, "silent": _silent_cases(ctx), "seeds": _seeds(ctx, model)}


def second_turn(model, ids, cache, reference: str = "sdpa"):
    """A first turn of 4 tokens on ``cache``, then a second (its output and three more ids)
    on the same cache; returns the second turn's (ids, logits), and transformers' own for
    the same ids in one process from scratch with ``reference`` attention."""
    first = model.generate(ids, cache=cache, max_new_tokens=4, do_sample=False)
    more = torch.cat([first, ids[:, :3]], dim=1)
    got = _generate(model, more, cache=cache)
    model.set_attn_implementation(reference)
    want = _generate(model, more)
    model.set_attn_implementation("treeattn")
    return got, want


def _seeds(ctx, model) -> str:
    """Sampling with a different seed on each rank and no RankZeroScores: every rank draws
    rank 0's tokens (the cache gives every rank rank 0's random state at each forward),
    those of transformers in one process seeded as rank 0."""
    import torch.distributed as dist

    import treeattn.hf

    ids = torch.randint(0, 100, (1, 10), generator=torch.Generator().manual_seed(9))
    kw = dict(max_new_tokens=12, min_new_tokens=12, do_sample=True, temperature=1.5)
    model.set_attn_implementation("sdpa")
    torch.manual_seed(100)
    want = model.generate(ids, **kw)
    model.set_attn_implementation("treeattn")
    torch.manual_seed(100 + ctx.rank)
    got = model.generate(ids, cache=treeattn.hf.ShardedCache(model.config, "tree"), **kw)
    everyone = [None] * ctx.world
    dist.all_gather_object(everyone, got.tolist())
    assert all(g == everyone[0] for g in everyone) and torch.equal(got, want)
    return "alike"


def _silent_cases(ctx) -> dict[str, str]:
    """What once decoded wrong tokens without an error, each now refused on every rank before
    generate returns: the refusal messages by case."""
    import treeattn.hf

    model = tiny_model("llama")
    ids = torch.randint(0, 160, (2, 11), generator=torch.Generator().manual_seed(6))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    new = functools.partial(treeattn.hf.ShardedCache, model.config, "tree")
    kw = dict(max_new_tokens=4, do_sample=False)
    out = {}
    # a model whose attention is not treeattn's, given a ShardedCache (replicated prefill)
    out["sdpa"] = _refused(lambda: model.generate(ids, cache=new(), **kw))
    model.set_attn_implementation("treeattn")
    # the prefill's mask not given to generate, and the other way round
    cache = new()
    treeattn.hf.sharded_prefill(model, ids, cache, attention_mask=mask)
    out["mask"] = _refused(lambda: model.generate(ids, cache=cache, **kw))
    cache = new()
    treeattn.hf.sharded_prefill(model, ids, cache)
    out["mask2"] = _refused(lambda: model.generate(ids, cache=cache, attention_mask=mask, **kw))
    # generate given other ids than the prefill's
    cache = new()
    treeattn.hf.sharded_prefill(model, ids, cache)
    out["ids"] = _refused(lambda: model.generate(ids.flip(1), cache=cache, **kw))
    # different ids on each rank: the ranks' new keys differ at the first decode step
    out["rank_ids"] = _refused(lambda: model.generate((ids + ctx.rank) % 160, cache=new(),
                                                      **kw))
    # a second turn on the cache of a left-padded batch
    cache = new()
    first = model.generate(ids, cache=cache, attention_mask=mask, **kw)
    more = torch.cat([first, ids[:, :3]], dim=1)
    more_mask = torch.cat([mask, torch.ones(2, 7, dtype=mask.dtype)], dim=1)
    out["turn"] = _refused(lambda: model.generate(more, cache=cache, attention_mask=more_mask,
                                                  **kw))
    # a mask of the wrong length
    out["mask_len"] = _refused(lambda: treeattn.hf.sharded_prefill(
        model, ids, new(), attention_mask=torch.ones(2, 10, dtype=torch.long)))
    # a cache made for another config
    other = tiny_config("llama")
    other.num_hidden_layers = 1
    small = treeattn.hf.ShardedCache(other, "tree")
    out["config"] = _refused(lambda: model.generate(ids, cache=small, **kw))
    return out


def _sampling(ctx, model):
    """Seeded sampling (temperature, top-k, top-p) with rank 0's scores on every rank: the
    ranks draw the same tokens, and those of transformers in one process with that seed."""
    import torch.distributed as dist

    import treeattn.hf

    ids = torch.randint(0, 100, (1, 10), generator=torch.Generator().manual_seed(8))
    kw = dict(max_new_tokens=16, min_new_tokens=16, do_sample=True, temperature=0.9, top_k=40,
              top_p=0.95)
    model.set_attn_implementation("sdpa")
    torch.manual_seed(21)
    want = model.generate(ids, **kw)
    model.set_attn_implementation("treeattn")
    torch.manual_seed(21)
    got = model.generate(ids, cache=treeattn.hf.ShardedCache(model.config, "butterfly"),
                         logits_processor=[treeattn.hf.RankZeroScores()], **kw)
    everyone = [None] * ctx.world
    dist.all_gather_object(everyone, got.tolist())
    assert all(g == everyone[0] for g in everyone)
    assert torch.equal(got, want)
    return got.tolist()


def test_llama_gqa_world2_like_one_process_and_refusals():
    out = launch(_world2_job, 2, LaunchOptions(timeout_s=120, threads=1))
    assert len(out["report"]) == 7 and len(out["batch"]) == 1
    assert out["report"][0][3] == 7  # contiguous: rank 0 keeps its 7 prompt tokens only
    assert len(out["padded"]) == 2 and len(out["sampled"][0]) == 26
    assert "this ShardedCache was made for rank 1 of 2, and is used by rank 0 of 2" \
        in out["other"]
    silent = out["silent"]
    assert "did not attend through treeattn" in silent["sdpa"]
    assert "attention_mask differs from the one sharded_prefill had" in silent["mask"]
    assert "attention_mask differs from the one sharded_prefill had" in silent["mask2"]
    assert "do not begin with the 10 prefilled positions" in silent["ids"]
    assert "the ranks decode different tokens" in silent["rank_ids"]
    assert out["seeds"] == "alike"
    assert "a 4-token forward on a cache holding 14 positions (a second turn) is served " \
        "for models without recurrent layers and batches without padding" in silent["turn"]
    assert "made for 1 layers of llama" in silent["config"]
    assert "attention_mask (2, 10) does not match input_ids (2, 11)" in silent["mask_len"]


def test_qwen2_bias_world3_like_one_process():
    runs = [("tree", "contiguous", 1), ("dcp", "interleaved", 1), ("butterfly", "contiguous", 1),
            ("ring", "interleaved", 2)]
    out = launch(functools.partial(_compare_job, kind="qwen2", runs=runs), 3,
                 LaunchOptions(timeout_s=120, threads=1))
    assert len(out) == len(runs)


def _sharded_prefill_job(ctx, kind: str, lengths: tuple[int, ...],
                         runs: list[tuple[str, str, int]]):
    """:func:`treeattn.hf.sharded_prefill` then ``generate``: each rank's shard of every
    layer equals the single-process cache's K/V at the positions it owns, and the tokens and
    logits equal transformers' single-process generate; a batch of two, prompts of
    ``lengths`` (fewer prefilled positions than ranks leave ranks without queries)."""
    import treeattn.hf

    model = tiny_model(kind)
    report = []
    for length in lengths:
        model.set_attn_implementation("sdpa")
        ids = torch.randint(0, model.config.vocab_size, (2, length),
                            generator=torch.Generator().manual_seed(length))
        want_ids, want_logits = _generate(model, ids)
        with torch.no_grad():
            ref = model(ids[:, :-1], use_cache=True).past_key_values  # DynamicCache
        model.set_attn_implementation("treeattn")
        for algorithm, layout, interleave in runs:
            cache = treeattn.hf.ShardedCache(model.config, algorithm, layout=layout,
                                             interleave_size=interleave, reserve=NEW_TOKENS)
            assert treeattn.hf.sharded_prefill(model, ids, cache) == length - 1
            owned = [p for p in range(length - 1) if cache.owner(p, length - 1) == ctx.rank]
            for i, layer in enumerate(cache.layers):
                k, v = layer.shard()  # (B, Hkv, local, D) each
                assert torch.allclose(k, ref.layers[i].keys[:, :, owned], atol=1e-5)
                assert torch.allclose(v, ref.layers[i].values[:, :, owned], atol=1e-5)
            got_ids, got_logits = _generate(model, ids, cache=cache)
            assert torch.equal(got_ids, want_ids), (algorithm, layout, length)
            err = float((got_logits - want_logits).abs().max())
            assert err < LOGIT_ATOL, (algorithm, layout, length, err)
            report.append((length, algorithm, layout, len(owned), err))
    return report


def _padded_prefill_job(ctx, pads: tuple[int, ...], layout: str):
    """A left-padded batch through :func:`treeattn.hf.sharded_prefill`: each sequence's shard
    equals the single-process cache at its real positions this rank owns; tokens and logits
    as transformers' single-process generate with the same mask."""
    import treeattn.hf

    model = tiny_model("llama")
    ids = torch.randint(0, 160, (len(pads), 13), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    for b, pad in enumerate(pads):
        mask[b, :pad], ids[b, :pad] = 0, 0
    want_ids, want_logits = _generate(model, ids, attention_mask=mask)
    with torch.no_grad():  # positions from the mask, as generate numbers them
        positions = (mask[:, :-1].cumsum(-1) - 1).clamp(min=0)
        ref = model(ids[:, :-1], attention_mask=mask[:, :-1], position_ids=positions,
                    use_cache=True).past_key_values
    model.set_attn_implementation("treeattn")
    cache = treeattn.hf.ShardedCache(model.config, "tree", layout=layout, reserve=NEW_TOKENS)
    assert treeattn.hf.sharded_prefill(model, ids, cache, attention_mask=mask) == 12
    held = []
    for b, pad in enumerate(pads):
        real = 12 - pad  # real tokens prefilled
        owned = [pad + i for i in range(real) if cache.owner(i, real) == ctx.rank]
        k, v = cache.layers[1].shard()
        n = cache.layers[1].counts[b]
        assert n == len(owned)
        assert torch.allclose(k[b, :, :n], ref.layers[1].keys[b, :, owned], atol=1e-5)
        assert torch.allclose(v[b, :, :n], ref.layers[1].values[b, :, owned], atol=1e-5)
        held.append(n)
    got_ids, got_logits = _generate(model, ids, cache=cache, attention_mask=mask)
    assert torch.equal(got_ids, want_ids)
    assert float((got_logits - want_logits).abs().max()) < LOGIT_ATOL
    return held


def test_sharded_prefill_of_a_left_padded_batch():
    held = launch(functools.partial(_padded_prefill_job, pads=(0, 5, 2, 11), layout="contiguous"),
                  2, LaunchOptions(timeout_s=120, threads=1))
    assert held == [6, 4, 5, 1]  # rank 0: the first half of 12, 7, 10 and 1 real tokens


def test_sharded_prefill_world2_like_one_process():
    runs = [("tree", "contiguous", 1), ("butterfly", "interleaved", 2)]
    out = launch(functools.partial(_sharded_prefill_job, kind="llama", lengths=(13, 2),
                                   runs=runs), 2, LaunchOptions(timeout_s=120, threads=1))
    assert [(r[0], r[3]) for r in out] == [(13, 6), (13, 6), (2, 1), (2, 1)]  # rank 0's


def test_sharded_prefill_world3_short_prompts_like_one_process():
    runs = [("dcp", "contiguous", 1), ("tree", "interleaved", 1)]
    out = launch(functools.partial(_sharded_prefill_job, kind="qwen2", lengths=(11, 3),
                                   runs=runs), 3, LaunchOptions(timeout_s=120, threads=1))
    assert len(out) == 4


def _subgroup_job(ctx):
    """World 4 as two context-parallel groups, {0, 2} and {1, 3} (tensor parallelism would
    span the other axis): each group prefills and decodes its own prompt over its subgroup."""
    import torch.distributed as dist

    import treeattn.hf

    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # every rank makes both
    mine = groups[ctx.rank % 2]
    model = tiny_model("llama")
    ids = torch.randint(0, 160, (1, 12), generator=torch.Generator().manual_seed(ctx.rank % 2))
    want_ids, want_logits = _generate(model, ids)
    model.set_attn_implementation("treeattn")
    cache = treeattn.hf.ShardedCache(model.config, "tree", group=mine, reserve=NEW_TOKENS)
    treeattn.hf.sharded_prefill(model, ids, cache)
    got_ids, got_logits = _generate(model, ids, cache=cache)
    assert torch.equal(got_ids, want_ids)
    assert float((got_logits - want_logits).abs().max()) < LOGIT_ATOL
    return cache.rank, cache.world, cache.layers[0].local


def test_the_cache_runs_on_a_process_subgroup():
    assert launch(_subgroup_job, 4, LaunchOptions(timeout_s=120, threads=1)) == (0, 2, 6)


@pytest.mark.parametrize("config,feature", [
    (lambda: transformers.DeepseekV3Config(), "deepseek_v3 .*multi-head latent attention"),
    (lambda: transformers.BloomConfig(), "bloom .*ALiBi"),
    (lambda: transformers.DiffLlamaConfig(), "diffllama .*twice per cache update"),
    (lambda: transformers.BartConfig(), "bart .*cross-attention"),
    (lambda: transformers.FalconMambaConfig(), "falcon_mamba .*no layer keeps K/V"),
    (lambda: transformers.NemotronConfig(), "nemotron is not in treeattn's list of served"),
    (lambda: {"model_type": "llama"}, "config must be the model's transformers config"),
])
def test_unsupported_model_features_are_refused_by_name(config, feature):
    from treeattn.hf import HFIntegrationError, ShardedCache

    with pytest.raises(HFIntegrationError, match=feature):
        ShardedCache(config(), "tree")  # refused before any process group is needed


@pytest.mark.parametrize("config,name", [
    (lambda: transformers.FalconConfig(num_hidden_layers=1, hidden_size=16,
                                       num_attention_heads=2, vocab_size=32), "falcon"),
    (lambda: transformers.GPTNeoConfig(num_layers=2, hidden_size=16, num_heads=2,
                                       vocab_size=32, attention_types=[[["global"], 2]]),
     "gpt_neo"),
])
def test_models_with_their_own_attention_table_are_refused_when_loaded(config, name):
    """Falcon and GPT-Neo look attention up in tables of their own: loading one with
    attn_implementation="treeattn" is a named refusal, not a KeyError."""
    from treeattn.hf import HFIntegrationError

    with pytest.raises(HFIntegrationError, match=f"{name} is not served by treeattn"):
        transformers.AutoModelForCausalLM.from_config(config(), attn_implementation="treeattn")


def test_the_layout_owner_rule():
    from treeattn.hf import owner_of

    assert [owner_of(p, 7, 3, "contiguous") for p in range(9)] == [0, 0, 0, 1, 1, 2, 2, 2, 2]
    assert [owner_of(p, 7, 3, "interleaved", 2) for p in range(9)] == [0, 0, 1, 1, 2, 2, 0, 0, 1]
