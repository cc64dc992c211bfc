"""The sharded KV cache, the append policy and the wire format (no process group needed)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from treeattn.kernels.reference import naive_attention, partial_attention
from treeattn.llm.cache import ShardedKVCache, append_owner
from treeattn.runtime import RuntimeFailure
from treeattn.runtime.plans import shard_lengths, shard_offsets
from treeattn.runtime.wire import (
    AttnDims,
    chunk_bounds,
    kv_message_lengths,
    message_numel,
    pack_partial,
    put_slice,
    take_slice,
    unpack_heads,
    unpack_partial,
)
from treeattn.sim import DecodeWorkload, build_schedule
from treeattn.topo import Topology


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
    from treeattn.kernels import merge_partials

    got_o, _ = merge_partials(o, lse)
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


@given(st.integers(0, 1000), st.integers(1, 9))
@settings(max_examples=80, deadline=None)
def test_chunks_tile_the_buffer(numel: int, count: int) -> None:
    bounds = [chunk_bounds(numel, (i, count)) for i in range(count)]
    assert bounds[0][0] == 0 and bounds[-1][1] == numel
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:], strict=False))
    sizes = [hi - lo for lo, hi in bounds]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_partial_chunks_are_head_ranges() -> None:
    dims = AttnDims(2, 5, 1, 3)
    o = torch.arange(2 * 5 * 3, dtype=torch.float32).view(2, 5, 3)  # (B, Hq, D)
    lse = -torch.arange(10, dtype=torch.float32).view(2, 5)  # (B, Hq)
    flat = pack_partial(o, lse)
    o2, lse2 = unpack_partial(flat, dims)
    assert torch.equal(o2, o) and torch.equal(lse2, lse)
    piece = take_slice(flat, dims, "partial", (1, 2))  # heads 3..4
    assert piece.numel() == message_numel(dims, "partial", (1, 2))
    po, plse = unpack_heads(piece, dims, 2)
    assert torch.equal(po, o[:, 3:]) and torch.equal(plse, lse[:, 3:])
    back = put_slice(torch.zeros_like(flat), dims, "partial", (1, 2), piece)
    bo, blse = unpack_partial(back, dims)
    assert torch.equal(bo[:, 3:], o[:, 3:]) and torch.equal(bo[:, :3], torch.zeros(2, 3, 3))
    assert torch.equal(blse[:, 3:], lse[:, 3:])


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ring_kv_messages_carry_the_senders_block(world: int) -> None:
    lengths = [5, 0, 7, 2][:world]
    topo = Topology.from_spec(f"local:ranks={world}")
    schedule = build_schedule("ring", topo, DecodeWorkload("debug", sum(lengths),
                                                           shard_lengths=tuple(lengths)))
    sizes = kv_message_lengths(schedule, lengths)
    # rank r's i-th receive carries the shard of rank (r - 1 - i) mod p
    for r, steps in enumerate(schedule.steps):
        recvs = [i for i, s in enumerate(steps) if type(s).__name__ == "Recv"]
        assert [sizes[(r, i)] for i in recvs] == [
            lengths[(r - 1 - j) % world] for j in range(world - 1)
        ]


@given(st.floats(1e-6, 1e-3), st.floats(1e8, 1e11))
@settings(max_examples=40, deadline=None)
def test_latency_bandwidth_fit_recovers_exact_data(alpha: float, beta: float) -> None:
    from treeattn.runtime.calibrate import fit_latency_bandwidth

    sizes = [4, 4096, 1 << 20, 1 << 24, 1 << 26]
    a, b = fit_latency_bandwidth(sizes, [alpha + n / beta for n in sizes])
    assert a == pytest.approx(alpha, rel=1e-6) and b == pytest.approx(beta, rel=1e-6)
    with pytest.raises(RuntimeFailure):
        fit_latency_bandwidth(sizes, [alpha] * len(sizes))


def test_geo_mean_error_is_symmetric_in_over_and_under_prediction() -> None:
    from treeattn.runtime.check import geo_mean_error

    points = [{"measured_s": 1.0, "predicted_s": 2.0}, {"measured_s": 2.0, "predicted_s": 1.0},
              {"measured_s": 1.0, "predicted_s": None}]
    assert geo_mean_error(points) == pytest.approx(1.0)
    assert geo_mean_error([{"measured_s": 3.0, "predicted_s": 3.0}]) == 0.0
    assert geo_mean_error([]) is None
