"""Sharded (context-parallel) prefill against single-process prefill.

Reference: :func:`treeattn.llm.prefill_check.reference_prefill`, the whole prompt in one
process. Each rank of the pass-KV ring must end with exactly its contiguous slice of every
layer's K/V and the same first-token logits. Tolerance: fp32 throughout; layer 0's K/V are
computed from the same rows by the same projections, and later layers differ from the
reference only by the order in which softmax partials are merged (log-sum-exp over tiles and
ring blocks, against one fused SDPA), so 1e-4 absolute and relative on O(1..10) values is
ample, while a wrong position, mask, shard or merge moves them by O(1).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_llm_generate import _assert_same, _run_distributed

from treeattn.llm.formats.weights import load_model
from treeattn.llm.generate import generate_local
from treeattn.llm.local_cache import causal_attention
from treeattn.llm.prefill import prefill_bytes, sharded_prefill
from treeattn.llm.prefill_check import PrefillJob, reference_prefill
from treeattn.runtime.group import RankContext
from treeattn.runtime.launch import LaunchOptions, launch
from treeattn.runtime.prefill.ring import causal_partial
from treeattn.sim.prefill.layout import PrefillLayout

ATOL = RTOL = 1e-4
pytestmark = pytest.mark.timeout(300)


@settings(max_examples=60, deadline=None)
@given(world=st.integers(1, 6), context=st.integers(0, 40), prompt=st.integers(1, 60))
def test_layout_covers_every_position_once_and_balances_causal_work(world, context, prompt):
    layout = PrefillLayout(world, context, prompt)
    stored = [p for r in range(world) for p in range(*layout.storage(r))]
    assert stored == list(range(context + prompt))  # contiguous, in rank order
    computed = sorted(p for r in range(world) for p in layout.positions(r, queries=True))
    assert computed == list(range(context, context + prompt))
    in_blocks = sorted(p for r in range(world) for p in layout.positions(r))
    assert in_blocks == list(range(context + prompt))  # every K/V travels exactly once
    last = context + prompt - 1
    assert last in layout.positions(layout.last_owner, queries=True)
    # zig-zag: equal causal work when 2W chunks divide the prompt, else within two queries'
    # worth of keys (each rank's two chunks differ from the even ones by at most one token);
    # a contiguous split would differ by ~(2W-1)x
    pairs = [layout.pairs(r) for r in range(world)]
    if prompt % (2 * world) == 0:
        assert max(pairs) == min(pairs)
    assert max(pairs) - min(pairs) <= 2 * (context + prompt)


@settings(max_examples=25, deadline=None)
@given(t=st.integers(1, 40), start=st.integers(0, 30), cuts=st.lists(st.integers(0, 70),
       max_size=3), seed=st.integers(0, 2**16))
def test_causal_partial_blocks_merge_to_causal_attention(t, start, cuts, seed):
    """Attending the keys in arbitrary blocks and merging = one causal attention."""
    from treeattn.runtime.prefill.ring import merge_prefill_pair

    gen = torch.Generator().manual_seed(seed)
    s = start + t
    q = torch.randn(1, 4, t, 8, generator=gen)  # (B, Hq, T, D), 2 query heads per KV head
    kv = torch.randn(2, 1, 2, s, 8, generator=gen)  # (2, B, Hkv, S, D)
    want = causal_attention(q, kv[0], kv[1], start)  # (B, Hq, T, D)
    edges = sorted({0, s, *(c for c in cuts if c < s)})
    q_pos = list(range(start, s))
    acc = (torch.zeros(1, 4, t, 8), torch.full((1, 4, t), float("-inf")))
    for a, b in zip(edges, edges[1:], strict=False):
        acc = merge_prefill_pair(acc, causal_partial(q, q_pos, kv[:, :, :, a:b], list(range(a, b))))
    torch.testing.assert_close(acc[0], want, atol=1e-5, rtol=1e-5)


def _check_shards(everyone, local, logits, context, prompt):
    world = len(everyone)
    layout = PrefillLayout(world, context, len(prompt))
    for out in everyone:
        lo, hi = layout.storage(out["rank"])
        assert out["lengths"] == layout.lengths
        torch.testing.assert_close(out["logits"], logits, atol=ATOL, rtol=RTOL)
        for layer, kv in enumerate(out["kv"]):
            assert kv.shape[3] == hi - lo
            torch.testing.assert_close(kv[0], local.k[layer][:, :, lo:hi], atol=ATOL, rtol=RTOL)
            torch.testing.assert_close(kv[1], local.v[layer][:, :, lo:hi], atol=ATOL, rtol=RTOL)


def test_world_one_runs_in_process_and_equals_the_reference():
    model = load_model("debug").model
    prompt = [(31 * i + 3) % 256 for i in range(29)]
    local, logits = reference_prefill(model, prompt)
    ctx = RankContext(0, 1, 0, torch.device("cpu"), "gloo")
    cache, got = sharded_prefill(ctx, model, prompt, chunk=7)  # the feed-forward in chunks
    out = {"rank": 0, "lengths": cache.lengths, "logits": got,
           "kv": [cache.kv(layer) for layer in range(cache.n_layers)]}
    _check_shards([out], local, logits, 0, prompt)


@pytest.mark.parametrize("algorithm", ["pass-kv", "pass-q"])
@pytest.mark.parametrize("world,n_prompt,context", [
    (2, 23, 0),  # even world, uneven chunks
    (3, 37, 0),  # uneven shards and chunks
    (4, 3, 0),  # a prompt shorter than the world: empty chunks, an empty shard
    (3, 5, 200),  # long-context mode: the document built per shard, K/V known in place
])
def test_every_rank_keeps_exactly_its_shard_and_the_first_logits(world, n_prompt, context,
                                                                 algorithm):
    loaded = load_model("debug")
    prompt = [(37 * i + 11) % 256 for i in range(n_prompt)]
    segment = [(13 * i + 7) % 256 for i in range(50)] if context else []
    local, logits = reference_prefill(loaded.model, prompt, context, segment)
    job = PrefillJob("debug", tuple(prompt), context, tuple(segment), algorithm=algorithm)
    everyone = launch(job, world, LaunchOptions(timeout_s=120, threads=1))
    _check_shards(everyone, local, logits, context, prompt)
    assert sum(out["bytes_sent"] for out in everyone) > 0
    # what travels never exceeds what generate's memory check counts for it
    bound = prefill_bytes(loaded.model.config, context, n_prompt, world, 4,
                          algorithm=algorithm)["blocks"]
    assert all(0 < out["peak_block_bytes"] <= bound for out in everyone)


@pytest.mark.parametrize("world,n_prompt,context,prefill", [
    (4, 3, 0, "pass-kv"), (4, 6, 90, "pass-kv"), (3, 5, 0, "pass-q"), (4, 6, 90, "pass-q")])
def test_generation_after_sharded_prefill_gives_the_same_greedy_tokens(world, n_prompt,
                                                                       context, prefill):
    loaded = load_model("debug")
    prompt = [(41 * i + 2) % 256 for i in range(n_prompt)]
    segment = [(17 * i + 5) % 256 for i in range(40)] if context else []
    ref = generate_local(loaded.model, prompt, 6, context_tokens=context, segment=segment)
    result = _run_distributed("debug", loaded.model, prompt, world, "tree", 6,
                              context_tokens=context, segment=segment, prefill=prefill)
    _assert_same(result["generation"], ref)
    assert result["ranks_agree"]


def test_a_prefill_the_sharded_cache_cannot_use_is_one_line_and_exit_2(capsys):
    from treeattn.cli import main

    for algorithm in ("all-gather-kv",):
        argv = ["generate", "--nproc", "2", "--model", "debug", "--prompt", "hi",
                "--prefill", algorithm]
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: --prefill " + algorithm), err
        assert "cannot fill this layout" in err[0]


def test_a_context_that_does_not_fit_even_sharded_says_both_sizes(monkeypatch, capsys):
    from treeattn.cli import main
    from treeattn.runtime import plans

    monkeypatch.setattr(plans, "available_memory_bytes", lambda cuda=False: (64 << 20, "RAM"))
    argv = ["generate", "--nproc", "4", "--model", "debug", "--prompt", "hi",
            "--context-tokens", "1M"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: generating"), err
    assert "shard" in err[0] and "needs about" in err[0] and "64.0 MiB of RAM" in err[0]


def test_a_mismatched_world_is_refused_before_any_work():
    from treeattn.llm.generate_dist import GenerateRequest, make_schedule, rank_generate
    from treeattn.llm.model import LlamaConfig
    from treeattn.runtime.errors import RuntimeFailure

    schedule = make_schedule("tree", 2, LlamaConfig.from_name("debug"), [3, 3])
    request = GenerateRequest("debug", (1, 2, 3, 4, 5, 6), 2, schedule)
    ctx = RankContext(0, 1, 0, torch.device("cpu"), "gloo")
    with pytest.raises(RuntimeFailure, match="plan is for 2 ranks, but this group has 1"):
        rank_generate(ctx, request)
    model = load_model("debug").model
    with pytest.raises(Exception, match="not the prefill's contiguous split"):
        sharded_prefill(ctx, model, [1, 2, 3], lengths=[2, 1])


@pytest.mark.fresh_ranks  # the cap stays on a rank's process: never on a warm group's
@pytest.mark.timeout(900)
def test_a_context_four_times_what_one_rank_may_hold_generates_under_rlimit_as(
        tmp_path, monkeypatch):
    """Every rank's address space is capped at a quarter of the whole KV cache (so no rank
    could hold the context alone, as the replicated prefill did); the sharded prefill and
    the decode run within it, and the greedy tokens equal one uncapped process's."""
    from treeattn.llm.formats.snapshot import save_snapshot
    from treeattn.llm.formats.tokenizer import byte_tokenizer
    from treeattn.llm.formats.weights import LoadedModel
    from treeattn.llm.generate_dist import GenerateRequest, make_schedule, split_lengths
    from treeattn.llm.model import LlamaConfig, random_model
    from treeattn.llm.prefill_check import CappedGenerate

    monkeypatch.setenv("MALLOC_ARENA_MAX", "2")  # glibc's per-thread arenas reserve 64 MiB
    config = LlamaConfig(dim=64, n_layers=16, n_heads=4, n_kv_heads=2, hidden_dim=128,
                         vocab_size=256)  # many thin layers: one ring block is 1/16 a shard
    model = random_model(config, seed=3)
    world, context, new = 8, 131072 - 5, 4
    prompt = [(23 * i + 9) % 256 for i in range(5)]
    segment = [(13 * i + 7) % 256 for i in range(48)]
    per_token = 2 * config.n_kv_heads * config.head_dim * 4 * config.n_layers
    whole = (context + len(prompt) + new) * per_token  # 512 MiB
    cap = whole // 4
    ref = generate_local(model, prompt, new, context_tokens=context, segment=segment)
    snapshot = save_snapshot(LoadedModel(model, byte_tokenizer(), "thin"), tmp_path)
    schedule = make_schedule("tree", world, config, split_lengths(context + len(prompt), world))
    request = GenerateRequest(str(snapshot), tuple(prompt), new, schedule, None, context,
                              tuple(segment))
    result = launch(CappedGenerate(request, cap), world, LaunchOptions(timeout_s=600, threads=1))
    assert result["generation"].tokens == ref.tokens
    assert result["ranks_agree"]
    # The address-space cap is the bound: an allocation past it fails the rank. Resident
    # growth can pass the cap by pages mapped before it was set (the weights' snapshot,
    # the mailboxes) and faulted in later, so it is held to half the whole cache: far below
    # what one rank prefilling the whole context would need.
    assert cap < whole
    assert max(result["peak_rss_growth_bytes"]) < whole // 2
