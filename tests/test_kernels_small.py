"""The numpy path for small fp32 CPU calls (treeattn/testbed/kernels/cpu_small.py) against the
float64 oracle and the exact torch path, the merge algebra on it, and the dispatch that
picks it."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from treeattn import kernels
from treeattn.kernels import merge, partial_attention, reference
from treeattn.kernels.testing import (
    LSE_TOLERANCE,
    O_TOLERANCE,
    make_qkv,
    split_and_merge,
)
from treeattn.testbed.kernels import cpu_small

EXACT = O_TOLERANCE[("torch", torch.float32)]


@pytest.fixture(autouse=True)
def _auto_backend(monkeypatch):
    monkeypatch.delenv("TREEATTN_KERNEL", raising=False)


def assert_close_to(got, want):
    torch.testing.assert_close(got[0], want[0], **EXACT)
    torch.testing.assert_close(got[1], want[1], **LSE_TOLERANCE)


def test_applies_to_small_dense_fp32_only():
    q, k, v = make_qkv(1, 4, 2, 30, 8, torch.float32)
    assert cpu_small.applies(q, k, v, None)
    assert not cpu_small.applies(q, k, v, torch.tensor([20]))  # ragged: exact path
    assert not cpu_small.applies(q, k[:, :, :0], v[:, :, :0], None)  # empty: the identity
    half = [t.bfloat16() for t in (q, k, v)]
    assert not cpu_small.applies(*half, None)  # 16-bit: the fused kernel
    assert not cpu_small.applies(q.bfloat16(), k, v, None)  # mixed dtypes: not this path
    t_max = cpu_small.MAX_KV_ELEMENTS // (2 * 8)  # the most tokens of 2 KV heads of D = 8
    assert cpu_small.applies(*make_qkv(1, 4, 2, t_max, 8, torch.float32), None)
    assert not cpu_small.applies(*make_qkv(1, 4, 2, t_max + 1, 8, torch.float32), None)
    # 16 query heads on one KV head of 512 tokens of D = 128: K is small enough, but each
    # matmul (16 · 512 · 128 multiply-adds) would wake a second BLAS thread
    assert not cpu_small.applies(*make_qkv(1, 16, 1, 512, 128, torch.float32), None)
    assert cpu_small.applies(*make_qkv(1, 4, 1, 512, 128, torch.float32), None)


@pytest.mark.parametrize("hq,hkv,d,t", [(1, 1, 8, 4), (8, 8, 128, 16), (9, 3, 64, 150),
                                        (32, 8, 128, 64), (4, 1, 16, 1)])
def test_small_matches_the_oracle_and_the_exact_path(hq, hkv, d, t):
    q, k, v = make_qkv(2 if hkv < 8 else 1, hq, hkv, t, d, torch.float32, seed=hq + t)
    assert cpu_small.applies(q, k, v, None)
    got = partial_attention(q, k, v)
    assert got[0].dtype == got[1].dtype == torch.float32
    assert got[0].shape == q.shape and got[1].shape == q.shape[:2]
    assert_close_to(got, reference.naive_attention(q, k, v))
    assert_close_to(got, reference.partial_attention(q, k, v))


def test_small_reads_strided_views_and_honours_the_scale():
    q, k, v = make_qkv(1, 6, 3, 40, 16, torch.float32, seed=4)
    store = torch.stack([k, v])  # (2, B, Hkv, T, D): a packed block, as the executor has
    view_k, view_v = store[0][:, :, 5:30], store[1][:, :, 5:30]
    assert not view_k.is_contiguous()
    transposed = q.transpose(1, 2).contiguous().transpose(1, 2)  # (B, Hq, D), D-stride Hq
    want = reference.naive_attention(q, k[:, :, 5:30], v[:, :, 5:30], scale=0.3)
    assert_close_to(partial_attention(transposed, view_k, view_v, scale=0.3), want)


def test_one_token_is_that_token_and_its_score():
    q, k, v = make_qkv(3, 4, 2, 1, 16, torch.float32, seed=7)
    o, lse = partial_attention(q, k, v)
    torch.testing.assert_close(o, v[:, :, 0].repeat_interleave(2, dim=1), **EXACT)
    score = (q * k[:, :, 0].repeat_interleave(2, dim=1)).sum(-1) / 4.0  # scale 1/sqrt(16)
    torch.testing.assert_close(lse, score, **LSE_TOLERANCE)


def test_merge_matches_the_exact_path_and_keeps_the_identity_neutral():
    q, k, v = make_qkv(2, 8, 4, 20, 32, torch.float32, seed=9)
    a = partial_attention(q, k[:, :, :7], v[:, :, :7])
    b = partial_attention(q, k[:, :, 7:], v[:, :, 7:])
    assert cpu_small.merge_applies(a, b)
    assert_close_to(merge(a, b), reference.merge(a, b))
    identity = (torch.zeros_like(a[0]), torch.full_like(a[1], float("-inf")))
    left, right = merge(a, identity), merge(identity, a)
    assert torch.equal(left[0], a[0]) and torch.equal(left[1], a[1])
    assert torch.equal(right[0], a[0]) and torch.equal(right[1], a[1])
    both = merge(identity, identity)
    assert torch.equal(both[0], identity[0]) and torch.isneginf(both[1]).all()


def test_merge_applies_to_small_fp32_partials_only():
    small = (torch.zeros(1, 8, 128), torch.zeros(1, 8))
    assert cpu_small.merge_applies(small, small)
    heads = cpu_small.MAX_MERGE_ELEMENTS // 128 + 1
    large = (torch.zeros(1, heads, 128), torch.zeros(1, heads))
    assert not cpu_small.merge_applies(large, large)
    half = (small[0].bfloat16(), small[1])
    assert not cpu_small.merge_applies(half, small)


def test_dispatch_sends_small_calls_to_numpy_and_the_oracle_setting_to_torch(monkeypatch):
    monkeypatch.setenv("TREEATTN_KERNEL", "fused")  # the CPU chain whose merges are numpy's
    calls = []
    attend, fold = cpu_small.partial_attention_small, cpu_small.merge_small
    monkeypatch.setattr(cpu_small, "partial_attention_small",
                        lambda *a: calls.append("attention") or attend(*a))
    monkeypatch.setattr(cpu_small, "merge_small", lambda *a: calls.append("merge") or fold(*a))
    q, k, v = make_qkv(1, 4, 2, 30, 8, torch.float32)
    part = partial_attention(q, k, v)
    merge(part, part)
    partial_attention(q, k, v, kv_len=torch.tensor([20]))  # ragged: exact path
    assert calls == ["attention", "merge"]
    monkeypatch.setenv("TREEATTN_KERNEL", "torch")  # the oracle path, forced
    got = partial_attention(q, k, v)
    want = reference.partial_attention(q, k, v)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    merged, want_merged = merge(got, got), reference.merge(want, want)
    assert torch.equal(merged[0], want_merged[0]) and torch.equal(merged[1], want_merged[1])
    assert calls == ["attention", "merge"]


@settings(max_examples=40, deadline=None)
@given(t=st.integers(1, 400), n_chunks=st.integers(1, 6), seed=st.integers(0, 10_000),
       heads=st.sampled_from([(1, 1), (4, 2), (6, 3), (8, 1)]), d=st.sampled_from([8, 32, 64]))
def test_any_split_merged_in_any_order_gives_whole_attention(t, n_chunks, seed, heads, d):
    """Sequence parallelism on the numpy path: shards (some empty, which take the exact
    path's identity) merged in a random tree equal attention over the whole."""
    q, k, v = make_qkv(1, heads[0], heads[1], t, d, torch.float32, seed=seed)
    rng = random.Random(seed)
    got = split_and_merge(q, k, v, n_chunks, rng)
    assert_close_to(got, reference.naive_attention(q, k, v))


def _packed(partial) -> torch.Tensor:
    return torch.cat([partial[0].reshape(-1), partial[1].reshape(-1)])


@pytest.mark.parametrize("backend", ["auto", "fused", "torch"])
@pytest.mark.parametrize("b,hq,d", [(1, 1, 8), (2, 8, 32), (1, 128, 128), (1, 256, 128)])
def test_packed_merge_is_the_merge_of_the_unpacked_partials(monkeypatch, backend, b, hq, d):
    """The runtime's packed form (o then lse, flat): the C merge (auto), the numpy path for
    small partials (fused), the unpack-merge-pack path above its limit (256 heads of 128) or
    with the oracle forced;
    an identity on either side leaves the other exactly as it was."""
    monkeypatch.setenv("TREEATTN_KERNEL", backend)
    q, k, v = make_qkv(b, hq, hq, 12, d, torch.float32, seed=hq + d)
    left = partial_attention(q, k[:, :, :5], v[:, :, :5])
    right = partial_attention(q, k[:, :, 5:], v[:, :, 5:])
    got = kernels.merge_packed(_packed(left), _packed(right), b * hq)
    want = _packed(reference.merge(left, right))
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got, _packed(reference.naive_attention(q, k, v)),
                               atol=2e-5, rtol=1e-5)
    identity = _packed((torch.zeros_like(left[0]), torch.full_like(left[1], float("-inf"))))
    assert torch.equal(kernels.merge_packed(identity, _packed(left), b * hq), _packed(left))
    both = kernels.merge_packed(identity, identity, b * hq)
    assert torch.equal(both[: b * hq * d], identity[: b * hq * d])
    assert torch.isneginf(both[b * hq * d:]).all()


@pytest.mark.parametrize("a,b,rows", [
    (torch.zeros(18), torch.zeros(18), 4),  # 18 - 4 = 14 is not a multiple of 4 rows
    (torch.zeros(18), torch.zeros(27), 2),  # different sizes
    (torch.zeros(18, dtype=torch.float64), torch.zeros(18, dtype=torch.float64), 2),
    (torch.zeros(2, 9), torch.zeros(2, 9), 2),  # not flat
    (torch.zeros(4), torch.zeros(4), 4),  # no room for o
])
def test_packed_merge_refuses_what_is_not_a_pair_of_packed_partials(a, b, rows):
    with pytest.raises(kernels.KernelError, match="packed partials must be"):
        kernels.merge_packed(a, b, rows)
