"""torch's fused CPU kernel for dense KV (treeattn/testbed/kernels/cpu_fused.py) against the float64
oracle, the exact torch path, and the merge algebra; and the dispatch that picks it."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from treeattn.kernels import partial_attention, reference
from treeattn.kernels.testing import (
    FUSED_HALF_LSE_TOLERANCE,
    LSE_TOLERANCE,
    O_TOLERANCE,
    make_qkv,
    split_and_merge,
)
from treeattn.testbed.kernels import cpu_fused

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(autouse=True)
def _fused_backend(monkeypatch):
    """The CPU chain without treeattn's C kernel, which would take one-thread calls."""
    monkeypatch.setenv("TREEATTN_KERNEL", "fused")


def assert_fused_close(got, want, dtype):
    torch.testing.assert_close(got[0], want[0], **O_TOLERANCE[("fused", dtype)])
    lse_tolerance = LSE_TOLERANCE if dtype == torch.float32 else FUSED_HALF_LSE_TOLERANCE
    torch.testing.assert_close(got[1], want[1], **lse_tolerance)



def test_applies_to_dense_nonempty_16bit_kv_and_to_grouped_fp32_kv():
    q, k, v = make_qkv(1, 4, 2, 5, 8, torch.bfloat16)
    assert cpu_fused.applies(q, k, None)
    assert cpu_fused.applies(q, k.float(), None)  # fp32, 2 query heads per KV head
    assert not cpu_fused.applies(q[:, :2], k.float(), None)  # fp32 MHA: exact path
    assert cpu_fused.applies(q[:, :2], k, None)  # bf16 MHA: fused
    assert not cpu_fused.applies(q.half(), k.half(), None)  # fp16: the exact path is faster
    assert not cpu_fused.applies(q, k, torch.tensor([3]))  # ragged: exact path
    assert not cpu_fused.applies(q, k.double(), None)  # not a KV cache dtype: exact path
    assert not cpu_fused.applies(q, k[:, :, :0], None)  # empty shard: the identity


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,d", [(8, 8, 128), (9, 3, 64), (32, 8, 128), (4, 1, 64)])
def test_fused_matches_the_oracle_for_any_gqa_ratio(dtype, hq, hkv, d):
    q, k, v = make_qkv(2, hq, hkv, 1300, d, dtype, seed=hq + d)  # several of its KV blocks
    got = partial_attention(q, k, v)
    assert got[0].dtype == torch.float32 and got[1].dtype == torch.float32
    assert_fused_close(got, reference.naive_attention(q, k, v), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_reads_strided_views_of_a_larger_cache(dtype):
    """A decode cache hands out ``[:, :, :length]`` views of a larger capacity, and the
    KV of a packed (2, B, Hkv, T, D) block; a D-strided view is copied first."""
    q, k, v = make_qkv(1, 6, 3, 400, 64, dtype, seed=4)
    store = torch.stack([k, v])  # (2, B, Hkv, T, D)
    view_k, view_v = store[0][:, :, :250], store[1][:, :, :250]
    assert not view_k.is_contiguous()
    want = reference.naive_attention(q, k[:, :, :250].contiguous(), v[:, :, :250].contiguous())
    assert_fused_close(partial_attention(q, view_k, view_v), want, dtype)
    wide = torch.zeros(1, 3, 250, 128, dtype=dtype)  # D-strided: every other element
    wide[..., ::2] = k[:, :, :250]
    assert_fused_close(partial_attention(q, wide[..., ::2], v[:, :, :250]), want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_reads_a_query_that_is_not_unit_stride_along_d(dtype):
    q, k, v = make_qkv(2, 8, 2, 300, 64, dtype, seed=5)
    want = reference.naive_attention(q, k, v)
    transposed = q.transpose(1, 2).contiguous().transpose(1, 2)  # (B, Hq, D), D-stride Hq
    assert transposed.stride(-1) != 1
    assert_fused_close(partial_attention(transposed, k, v), want, dtype)
    wide = torch.zeros(2, 8, 128, dtype=dtype)  # every other element along D
    wide[..., ::2] = q
    assert_fused_close(partial_attention(wide[..., ::2], k, v), want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_token_shard_is_that_token_exactly_up_to_rounding(dtype):
    q, k, v = make_qkv(3, 4, 2, 1, 16, dtype, seed=7)
    o, lse = partial_attention(q, k, v)
    want_o = v[:, :, 0].float().repeat_interleave(2, dim=1)  # (B, Hq, D): the only value
    torch.testing.assert_close(o, want_o, **O_TOLERANCE[("fused", dtype)])
    assert_fused_close((o, lse), reference.naive_attention(q, k, v), dtype)


def test_dispatch_routes_dense_kv_to_fused_and_the_rest_to_the_exact_path(monkeypatch):
    calls = []
    real = cpu_fused.partial_attention_fused
    monkeypatch.setattr(cpu_fused, "partial_attention_fused",
                        lambda *a: calls.append(a[1].dtype) or real(*a))
    q, k, v = make_qkv(1, 4, 2, 30, 8, torch.bfloat16)
    partial_attention(q, k, v)
    partial_attention(q, k, v, kv_len=torch.tensor([20]))  # ragged: exact
    big = make_qkv(1, 4, 2, 5000, 8, torch.float32)  # K over the small path's limit
    partial_attention(*big)  # fp32 GQA: fused
    partial_attention(big[0][:, :2], big[1], big[2])  # fp32 MHA: exact
    assert calls == [torch.bfloat16, torch.float32]
    monkeypatch.setenv("TREEATTN_KERNEL", "torch")  # the oracle path, forced
    got = partial_attention(q, k, v)
    assert calls == [torch.bfloat16, torch.float32]
    want = reference.partial_attention(q, k, v)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    monkeypatch.setenv("TREEATTN_KERNEL", "fused")
    partial_attention(q, k, v)
    assert calls == [torch.bfloat16, torch.float32, torch.bfloat16]


def test_empty_shard_is_the_identity_through_the_public_api():
    q, k, v = make_qkv(2, 4, 2, 0, 8, torch.bfloat16)
    o, lse = partial_attention(q, k, v)
    assert torch.equal(o, torch.zeros(2, 4, 8)) and torch.isneginf(lse).all()


@settings(max_examples=25, deadline=None)
@given(t=st.integers(1, 700), n_chunks=st.integers(1, 6), seed=st.integers(0, 10_000),
       dtype=st.sampled_from(DTYPES))
def test_any_split_merged_in_any_order_gives_whole_attention(t, n_chunks, seed, dtype):
    """Sequence parallelism with the fused kernel: shards (some empty) merged in a random
    tree equal the whole, within the tolerance of one kernel call in that dtype."""
    q, k, v = make_qkv(1, 6, 2, t, 32, dtype, seed=seed)
    rng = random.Random(seed)
    got = split_and_merge(q, k, v, n_chunks, rng)
    assert_fused_close(got, reference.naive_attention(q, k, v), dtype)
