"""The sharded KV cache, its default split and the append policy (no process group needed)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from treeattn.kernels.reference import naive_attention, partial_attention
from treeattn.llm.cache import ShardedKVCache, append_owner
from treeattn.runtime import RuntimeFailure
from treeattn.runtime.plans import shard_lengths, shard_offsets
from treeattn.sim import DecodeWorkload


@given(st.integers(1, 10_000), st.integers(1, 64))
@settings(max_examples=60, deadline=None)
def test_shard_lengths_match_the_simulator(seq_len: int, world: int) -> None:
    if seq_len < world:
        with pytest.raises(RuntimeFailure):
            shard_lengths(seq_len, world)
        return
    lengths = shard_lengths(seq_len, world)
    assert sum(lengths) == seq_len and max(lengths) - min(lengths) <= 1
    if world >= 2:
        assert lengths == DecodeWorkload("debug", seq_len).shards(world)


@given(st.lists(st.integers(0, 50), min_size=1, max_size=8), st.integers(1, 40),
       st.sampled_from(["last", "shortest"]))
@settings(max_examples=40, deadline=None)
def test_appended_tokens_keep_attention_exact(lengths, new_tokens, policy) -> None:
    """Shards + appended tokens, merged, equal attention over all tokens in order."""
    world, b, hkv, d = len(lengths), 1, 2, 4
    g = torch.Generator().manual_seed(sum(lengths) + new_tokens)
    total = sum(lengths) + new_tokens
    k = torch.randn(b, hkv, total, d, generator=g)  # (B, Hkv, T, D)
    v = torch.randn(b, hkv, total, d, generator=g)
    q = torch.randn(b, 4, d, generator=g)  # (B, Hq, D)
    caches = [ShardedKVCache(r, lengths, 1, b, hkv, d, policy=policy) for r in range(world)]
    offsets = shard_offsets(lengths)
    for r, cache in enumerate(caches):
        own = slice(offsets[r], offsets[r] + lengths[r])
        cache.fill(0, k[:, :, own], v[:, :, own])
    for t in range(sum(lengths), total):
        owners = {c.append([(k[:, :, t : t + 1], v[:, :, t : t + 1])]) for c in caches}
        assert len(owners) == 1  # every rank agrees without communicating
    assert all(c.lengths == caches[0].lengths for c in caches)
    assert sum(caches[0].lengths) == total
    if policy == "shortest":
        assert max(caches[0].lengths) - min(caches[0].lengths) <= max(
            1, max(lengths) - min(lengths))
    parts = [partial_attention(q, *c.layer(0)) for c in caches]
    o = torch.stack([p[0] for p in parts])
    lse = torch.stack([p[1] for p in parts])
    from treeattn.kernels import merge_stacked

    got_o, _ = merge_stacked(o, lse)
    ref_o, _ = naive_attention(q, k, v)
    # fp32 partials merged vs float64 oracle
    torch.testing.assert_close(got_o, ref_o, atol=1e-5, rtol=1e-5)


def test_last_policy_keeps_positions_contiguous() -> None:
    cache = ShardedKVCache(2, [3, 3, 2], 2, 1, 1, 2)
    tok = [(torch.full((1, 1, 1, 2), 7.0), torch.full((1, 1, 1, 2), 8.0))] * 2
    assert [cache.append(tok) for _ in range(3)] == [2, 2, 2]
    assert cache.lengths == [3, 3, 5] and cache.capacity >= 5
    k, v = cache.layer(1)
    assert k.shape == (1, 1, 5, 2) and torch.equal(k[0, 0, 2:], torch.full((3, 2), 7.0))
    assert append_owner([4, 2, 2], "shortest") == 1
    with pytest.raises(RuntimeFailure):
        append_owner([1, 1], "random")


@pytest.mark.parametrize("policy", ["last", "shortest"])
def test_staging_a_layer_shows_the_token_only_on_its_owner_until_commit(policy) -> None:
    """Decoding stages each layer's new K/V before that layer's attention; the staged shard
    is the owner's shard plus the token, other ranks' shards are unchanged, and commit
    leaves the same cache as ``append`` (growth included: the shards start full)."""
    lengths, layers = [3, 2, 2], 2
    gen = torch.Generator().manual_seed(0)
    new = [tuple(torch.randn(1, 2, 1, 4, generator=gen) for _ in range(2)) for _ in range(layers)]
    owner = append_owner(lengths, policy)
    for rank in range(3):
        staged, appended = (ShardedKVCache(rank, lengths, layers, 1, 2, 4, policy=policy)
                            for _ in range(2))
        for cache in (staged, appended):
            for layer in range(layers):
                old = torch.full((1, 2, lengths[rank], 4), float(rank + layer))  # (B,Hkv,T,D)
                cache.fill(layer, old, old)
        for layer, (k, v) in enumerate(new):
            shard = staged.stage(layer, k, v)  # (2, B, Hkv, T, D)
            assert shard.shape[3] == lengths[rank] + (rank == owner)
            if rank == owner:
                assert torch.equal(shard[0, :, :, -1:], k) and torch.equal(shard[1, :, :, -1:], v)
            assert staged.lengths == lengths  # not counted yet
        assert staged.commit() == owner == appended.append(new)
        assert staged.lengths == appended.lengths
        for layer in range(layers):
            assert torch.equal(staged.kv(layer), appended.kv(layer))


@pytest.mark.parametrize("policy", ["last", "shortest"])
def test_reserved_room_takes_a_generation_without_growing(policy) -> None:
    """Only the ranks that will store appended tokens reserve room, exactly enough; the
    others keep a shard with no spare room (one contiguous block)."""
    lengths, tokens = [5, 4, 4], 7
    owners = []
    probe = list(lengths)
    for _ in range(tokens):
        owners.append(append_owner(probe, policy))
        probe[owners[-1]] += 1
    for rank in range(3):
        cache = ShardedKVCache(rank, lengths, 1, 1, 1, 2, policy=policy, reserve=tokens)
        assert cache.capacity == lengths[rank] + owners.count(rank)
        assert cache.kv(0).is_contiguous() == (owners.count(rank) == 0)
        storage = cache.tensors()[0].untyped_storage().data_ptr()
        for _ in range(tokens):
            cache.append([(torch.ones(1, 1, 1, 2), torch.ones(1, 1, 1, 2))])
        assert cache.tensors()[0].untyped_storage().data_ptr() == storage  # never regrown
        assert cache.lengths == probe
