"""Torch path of treeattn.kernels: reference = naive oracle, merge algebra, edges, dispatch.

The Triton kernels are tested under the interpreter in ``test_kernels_triton.py``.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from treeattn import kernels
from treeattn.kernels import KernelError, merge, merge_stacked, partial_attention, reference
from treeattn.kernels.testing import (
    LSE_TOLERANCE,
    O_TOLERANCE,
    cut_points,
    make_qkv,
    merge_random_tree,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(autouse=True)
def _torch_backend(monkeypatch):
    monkeypatch.setenv("TREEATTN_KERNEL", "torch")


@pytest.fixture
def small_chunks(monkeypatch):
    """Make the reference cut T into 4-token segments (and 16-bit upcast blocks) so that the
    segment merging and block boundaries are exercised."""
    monkeypatch.setattr(reference, "_SCORE_CAP_ELEMS", 1)
    monkeypatch.setattr(reference, "_CHUNK_ELEMS_16BIT", 1)
    monkeypatch.setattr(reference, "_MIN_CHUNK_T", 4)


def assert_partial_close(got, want, dtype, backend="torch"):
    torch.testing.assert_close(got[0], want[0], **O_TOLERANCE[(backend, dtype)])
    torch.testing.assert_close(got[1], want[1], **LSE_TOLERANCE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2), (8, 1)])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("t", [1, 37, 70])
def test_reference_matches_naive(dtype, hq, hkv, d, t, small_chunks):
    q, k, v = make_qkv(2, hq, hkv, t, d, dtype, seed=t + d)
    kv_len = torch.tensor([t, (2 * t) // 3])
    for lens in (None, kv_len):
        got = partial_attention(q, k, v, kv_len=lens)
        assert got[0].dtype == got[1].dtype == torch.float32
        assert got[0].shape == (2, hq, d) and got[1].shape == (2, hq)
        assert_partial_close(got, reference.naive_attention(q, k, v, kv_len=lens), dtype)


def test_default_chunking_matches_naive_across_chunks():
    # B*Hkv*D = 8 -> 2**18 / 8 = 32768-token upcast blocks for 16-bit; one score segment.
    q, k, v = make_qkv(1, 2, 1, 2 * 32768 + 300, 8, torch.bfloat16, seed=1)
    got = partial_attention(q, k, v, scale=0.5)
    assert_partial_close(got, reference.naive_attention(q, k, v, scale=0.5), torch.bfloat16)


# (score cap in floats, 16-bit block in elements, minimum tokens): how the reference walks T.
# "two-pass": one segment, the 16-bit upcast in 3-token blocks; "segmented": the score buffer
# capped so T is cut into 5-token segments merged online, with 2-token blocks inside them.
WALKS = {
    "two-pass": (1 << 25, 1, 3),
    "segmented": (1, 1, 5),
}


def _walk(monkeypatch, name: str) -> None:
    cap, blk, min_t = WALKS[name]
    monkeypatch.setattr(reference, "_SCORE_CAP_ELEMS", cap)
    monkeypatch.setattr(reference, "_CHUNK_ELEMS_16BIT", blk)
    monkeypatch.setattr(reference, "_MIN_CHUNK_T", min_t)


@pytest.mark.parametrize("walk", list(WALKS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,d", [(8, 8, 128), (9, 3, 64), (4, 1, 16)])
def test_two_pass_and_segmented_walks_match_naive(walk, dtype, hq, hkv, d, monkeypatch):
    _walk(monkeypatch, walk)
    q, k, v = make_qkv(3, hq, hkv, 23, d, dtype, seed=hq + d)
    for lens in (None, torch.tensor([23, 0, 11]), torch.tensor([5, 17, 1])):
        got = partial_attention(q, k, v, kv_len=lens)
        assert_partial_close(got, reference.naive_attention(q, k, v, kv_len=lens), dtype)


def test_segment_and_block_lengths_follow_the_caps(monkeypatch):
    monkeypatch.setattr(reference, "_SCORE_CAP_ELEMS", 1000)
    monkeypatch.setattr(reference, "_CHUNK_ELEMS_16BIT", 640)
    monkeypatch.setattr(reference, "_MIN_CHUNK_T", 2)
    assert reference._segment_len(2, 5) == 100  # 1000 floats / (B*Hq)
    assert reference._block_len(2, 5, 8) == 8  # 640 elements / (B*Hkv*D)
    assert reference._segment_len(1000, 1000) == 2 and reference._block_len(99, 9, 9) == 2


@settings(max_examples=60, deadline=None)
@given(
    b=st.integers(1, 3),
    hkv=st.integers(1, 3),
    g=st.integers(1, 4),
    d=st.sampled_from([8, 16, 64]),
    t=st.integers(0, 48),
    dtype=st.sampled_from(DTYPES),
    seg=st.integers(1, 60),
    blk=st.integers(1, 20),
    lens=st.lists(st.integers(-2, 52), min_size=3, max_size=3),
    masked=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_any_walk_matches_naive(b, hkv, g, d, t, dtype, seg, blk, lens, masked, seed):
    # Segments of `seg` tokens and upcast blocks of `blk` tokens, with or without kv_len
    # (out-of-range values are clamped), against the float64 oracle.
    q, k, v = make_qkv(b, hkv * g, hkv, t, d, dtype, seed=seed)
    kv_len = torch.tensor(lens[:b]) if masked else None
    saved = (reference._SCORE_CAP_ELEMS, reference._CHUNK_ELEMS_16BIT, reference._MIN_CHUNK_T)
    try:
        reference._SCORE_CAP_ELEMS = seg * b * hkv * g
        reference._CHUNK_ELEMS_16BIT = blk * b * hkv * d
        reference._MIN_CHUNK_T = 1
        got = partial_attention(q, k, v, kv_len=kv_len)
    finally:
        reference._SCORE_CAP_ELEMS, reference._CHUNK_ELEMS_16BIT, reference._MIN_CHUNK_T = saved
    clamped = None if kv_len is None else kv_len.clamp(0, t)
    want = reference.naive_attention(q, k, v, kv_len=clamped)
    empty = torch.zeros(b, dtype=torch.bool) if clamped is None else clamped == 0
    if t == 0:
        empty[:] = True
    assert torch.equal(got[0][empty], torch.zeros_like(got[0][empty]))
    assert torch.isneginf(got[1][empty]).all()
    assert_partial_close((got[0][~empty], got[1][~empty]), (want[0][~empty], want[1][~empty]),
                         dtype)  # fmt: skip


def test_segmented_walk_is_deterministic_and_close_to_one_segment(monkeypatch):
    q, k, v = make_qkv(2, 6, 2, 300, 32, torch.float32, seed=11)
    kv_len = torch.tensor([300, 123])
    whole = partial_attention(q, k, v, kv_len=kv_len)
    _walk(monkeypatch, "segmented")
    first = partial_attention(q, k, v, kv_len=kv_len)
    second = partial_attention(q, k, v, kv_len=kv_len)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    assert_partial_close(first, whole, torch.float32)


def test_scale_is_applied():
    q, k, v = make_qkv(1, 2, 2, 9, 16, torch.float32, seed=3)
    got = partial_attention(q, k, v, scale=0.1)
    s = torch.einsum("bhd,bhtd->bht", q.double(), k.double()) * 0.1  # (B, H, T)
    torch.testing.assert_close(got[1].double(), torch.logsumexp(s, -1), atol=1e-5, rtol=1e-6)
    o = torch.einsum("bht,bhtd->bhd", torch.softmax(s, -1), v.double())  # (B, H, D)
    torch.testing.assert_close(got[0].double(), o, atol=1e-5, rtol=1e-5)


@settings(max_examples=40, deadline=None)
@given(
    t=st.integers(0, 40),
    n_chunks=st.integers(1, 6),
    gqa=st.sampled_from([(2, 2), (4, 1), (6, 3)]),
    seed=st.integers(0, 2**16),
    many=st.booleans(),
)
def test_chunked_partials_merge_to_full_attention(t, n_chunks, gqa, seed, many):
    rng = random.Random(seed)
    q, k, v = make_qkv(2, gqa[0], gqa[1], t, 8, torch.float32, seed=seed)
    bounds = cut_points(t, n_chunks, rng)
    parts = [
        partial_attention(q, k[:, :, a:b], v[:, :, a:b])
        for a, b in zip(bounds[:-1], bounds[1:], strict=True)
    ]
    got = merge_random_tree(parts, rng, merge, merge_stacked if many else None)
    want = reference.naive_attention(q, k, v)
    if t == 0:
        assert torch.equal(got[0], torch.zeros_like(got[0]))
        assert torch.isneginf(got[1]).all()
    else:
        assert_partial_close(got, want, torch.float32)


def test_empty_shard_is_identity_without_nan():
    q, k, v = make_qkv(2, 4, 2, 0, 16, torch.bfloat16)
    o, lse = partial_attention(q, k, v)
    assert torch.equal(o, torch.zeros(2, 4, 16)) and torch.isneginf(lse).all()


def test_single_token_returns_its_value():
    q, k, v = make_qkv(1, 4, 2, 1, 16, torch.float32, seed=5)
    o, lse = partial_attention(q, k, v, scale=0.25)
    torch.testing.assert_close(o, v[:, :, 0].repeat_interleave(2, dim=1))
    s = (q * k[:, :, 0].repeat_interleave(2, dim=1)).sum(-1) * 0.25  # (B, Hq)
    torch.testing.assert_close(lse, s)


def test_kv_len_zero_row_is_identity_and_other_rows_unaffected(small_chunks):
    q, k, v = make_qkv(3, 4, 2, 20, 16, torch.float16, seed=6)
    o, lse = partial_attention(q, k, v, kv_len=torch.tensor([0, 20, 7]))
    assert torch.equal(o[0], torch.zeros_like(o[0])) and torch.isneginf(lse[0]).all()
    full = partial_attention(q[1:2], k[1:2], v[1:2])
    torch.testing.assert_close(o[1], full[0][0], atol=0, rtol=0)
    cut = partial_attention(q[2:], k[2:, :, :7], v[2:, :, :7])
    torch.testing.assert_close(o[2], cut[0][0], atol=1e-6, rtol=1e-6)


def test_kv_len_is_clamped_to_t():
    q, k, v = make_qkv(2, 2, 2, 5, 8, torch.float32)
    got = partial_attention(q, k, v, kv_len=torch.tensor([99, -3]))
    want = partial_attention(q, k, v, kv_len=torch.tensor([5, 0]))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_huge_scores_do_not_overflow(dtype, small_chunks):
    q, k, v = make_qkv(2, 4, 2, 50, 32, dtype, seed=7)
    scale = 1e4 / 32**0.5  # logits ~1e4 times the usual size
    o, lse = partial_attention(q, k, v, scale=scale)
    assert torch.isfinite(o).all() and torch.isfinite(lse).all()
    want = reference.naive_attention(q, k, v, scale=scale)
    # Scores near 1e5: fp32 keeps them to ~1e-2 absolute, so lse is checked relatively.
    torch.testing.assert_close(lse, want[1], atol=0, rtol=1e-6)
    torch.testing.assert_close(o, want[0], atol=1e-3, rtol=1e-3)


def test_fp16_near_its_limits():
    # q·k products reach ~6e4 and sums reach ~1e6, past fp16's max of 65504, and V sits
    # near the max: accumulating in fp16 anywhere would give inf.
    gen = torch.Generator().manual_seed(8)
    q = (torch.rand(2, 4, 64, generator=gen) * 2 - 1) * 250
    k = (torch.rand(2, 2, 33, 64, generator=gen) * 2 - 1) * 250
    v = (torch.rand(2, 2, 33, 64, generator=gen) * 2 - 1) * 65000
    q, k, v = q.half(), k.half(), v.half()
    o, lse = partial_attention(q, k, v, scale=1e-3)
    assert torch.isfinite(o).all() and torch.isfinite(lse).all()
    want = reference.naive_attention(q, k, v, scale=1e-3)
    torch.testing.assert_close(o, want[0], atol=0.5, rtol=1e-5)  # |o| ~ 6e4: 1e-5 relative
    torch.testing.assert_close(lse, want[1], **LSE_TOLERANCE)


def test_merging_identities_gives_identity():
    ident = reference.identity_partial(2, 3, 8)
    for o, lse in (merge(ident, ident), merge_stacked(*(torch.stack([x] * 4) for x in ident))):
        assert torch.equal(o, ident[0]) and torch.equal(lse, ident[1])
    q, k, v = make_qkv(2, 3, 3, 4, 8, torch.float32)
    real = partial_attention(q, k, v)
    for got in (merge(ident, real), merge(real, ident)):
        torch.testing.assert_close(got[0], real[0], atol=0, rtol=0)
        torch.testing.assert_close(got[1], real[1], atol=0, rtol=0)


def test_merge_partials_of_nothing_is_identity():
    o, lse = merge_stacked(torch.zeros(0, 2, 3, 8), torch.zeros(0, 2, 3))
    assert torch.equal(o, torch.zeros(2, 3, 8)) and torch.isneginf(lse).all()


def test_merge_of_two_known_partials():
    # Two equal-weight halves: weights exp(0 - log 2) = 1/2 each, by hand.
    a = (torch.full((1, 1, 2), 1.0), torch.zeros(1, 1))
    b = (torch.full((1, 1, 2), 3.0), torch.zeros(1, 1))
    o, lse = merge(a, b)
    assert o.tolist() == [[[2.0, 2.0]]]
    assert lse.item() == pytest.approx(0.6931471805599453, rel=1e-7)


def test_outputs_are_bit_identical_across_calls(small_chunks):
    q, k, v = make_qkv(2, 8, 2, 45, 32, torch.bfloat16, seed=9)
    kv_len = torch.tensor([45, 20])
    first = partial_attention(q, k, v, kv_len=kv_len)
    second = partial_attention(q, k, v, kv_len=kv_len)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    stack = (torch.stack([first[0], second[0] * 2]), torch.stack([first[1], second[1] - 1]))
    again = zip(merge_stacked(*stack), merge_stacked(*stack), strict=True)
    assert all(torch.equal(x, y) for x, y in again)


def _zeros(*shapes, dtype=torch.float32):
    return tuple(torch.zeros(shape, dtype=dtype) for shape in shapes)


KV = (2, 2, 3, 4)  # (B, Hkv, T, D)


@pytest.mark.parametrize(
    "args, match",
    [
        (_zeros((2, 4), KV, KV), "q must"),
        (_zeros((2, 3, 4), KV, KV), "Hq=3"),
        (_zeros((2, 4, 4), KV, (2, 2, 5, 4)), "differ"),
        (_zeros((1, 4, 4), KV, KV), "batch"),
        (_zeros((2, 4, 8), KV, KV), "batch"),
        (_zeros((2, 4, 4), KV, KV, dtype=torch.int64), "dtype"),
        ((torch.zeros(2, 4, 4).half(), *_zeros(KV, KV)), "dtypes differ"),
        (("q", *_zeros(KV, KV)), "torch.Tensor"),
    ],
)
def test_bad_partial_inputs_raise_kernel_error(args, match):
    with pytest.raises(KernelError, match=match):
        partial_attention(*args)


def test_bad_kv_len_and_scale_raise_kernel_error():
    q, k, v = make_qkv(2, 4, 2, 3, 8, torch.float32)
    with pytest.raises(KernelError, match="kv_len"):
        partial_attention(q, k, v, kv_len=torch.tensor([1, 2, 3]))
    with pytest.raises(KernelError, match="kv_len"):
        partial_attention(q, k, v, kv_len=torch.tensor([1.0, 2.0]))
    with pytest.raises(KernelError, match="scale"):
        partial_attention(q, k, v, scale=float("nan"))


def test_bad_merge_inputs_raise_kernel_error():
    a = reference.identity_partial(2, 3, 8)
    with pytest.raises(KernelError, match="shapes"):
        merge(a, reference.identity_partial(2, 4, 8))
    with pytest.raises(KernelError, match="partial"):
        merge(a, a[0])
    with pytest.raises(KernelError, match="lse"):
        merge_stacked(torch.zeros(2, 2, 3, 8), torch.zeros(2, 3))
    with pytest.raises(KernelError, match="dtype"):
        merge_stacked(torch.zeros(2, 2, 3, 8, dtype=torch.int32), torch.zeros(2, 2, 3))


def test_unknown_backend_is_a_kernel_error(monkeypatch):
    monkeypatch.setenv("TREEATTN_KERNEL", "cuda-magic")
    q, k, v = make_qkv(1, 2, 2, 3, 8, torch.float32)
    with pytest.raises(KernelError, match="TREEATTN_KERNEL"):
        partial_attention(q, k, v)


def test_forcing_triton_on_cpu_without_interpreter_explains_how(monkeypatch):
    monkeypatch.setenv("TREEATTN_KERNEL", "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, k, v = make_qkv(1, 2, 2, 3, 8, torch.float32)
    with pytest.raises(KernelError, match="TRITON_INTERPRET=1"):
        partial_attention(q, k, v)
    with pytest.raises(KernelError, match="TRITON_INTERPRET=1"):
        merge_stacked(torch.zeros(2, 1, 2, 8), torch.zeros(2, 1, 2))


def test_auto_backend_takes_the_exact_torch_path_for_ragged_kv_on_cpu(monkeypatch):
    monkeypatch.delenv("TREEATTN_KERNEL", raising=False)
    assert kernels.choose_backend(torch.device("cpu")) == "native"  # which serves dense KV only
    q, k, v = make_qkv(2, 2, 2, 5, 8, torch.float32)
    kv_len = torch.tensor([3, 5])
    got = partial_attention(q, k, v, kv_len=kv_len)
    want = reference.partial_attention(q, k, v, kv_len=kv_len)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_interpreter_switched_on_after_triton_import_is_explained(monkeypatch):
    pytest.importorskip("triton")
    from treeattn.kernels.dispatch import triton_is_interpreted

    if triton_is_interpreted():  # imports Triton now, with this process's setting
        pytest.skip("this process runs Triton interpreted")
    monkeypatch.setenv("TREEATTN_KERNEL", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    q, k, v = make_qkv(1, 2, 2, 3, 8, torch.float32)
    with pytest.raises(KernelError, match="before starting Python"):
        partial_attention(q, k, v)


@settings(max_examples=200, deadline=None)
@given(
    b=st.integers(1, 64),
    hkv=st.integers(1, 16),
    t=st.integers(0, 1 << 21),
    sms=st.sampled_from([4, 108, 132]),
)
def test_split_plan_covers_t_in_whole_blocks(b, hkv, t, sms):
    tp = pytest.importorskip("treeattn.kernels.triton_partial")
    splits, per_split = tp.num_splits_for(b, hkv, t, sms)
    assert per_split % tp.SPLIT_QUANTUM == 0 and per_split > 0
    assert splits * per_split >= t and (splits - 1) * per_split < max(t, 1)  # no empty split
    assert 1 <= splits <= tp.MAX_SPLITS
    # Long enough sequences fill the GPU: at least PROGRAMS_PER_SM programs per SM.
    if t >= tp.MIN_SPLIT_TOKENS * tp.PROGRAMS_PER_SM * sms * 2:
        assert b * hkv * splits >= min(tp.PROGRAMS_PER_SM * sms, b * hkv * tp.MAX_SPLITS) // 2
