"""treeattn's C kernel for CPU decode (treeattn/testbed/kernels/cpu_native.py) against the float64
oracle and the merge algebra; how it is built, cached and refused; and the dispatch to it."""

from __future__ import annotations

import random
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from treeattn import kernels
from treeattn.kernels import KernelError, partial_attention, reference
from treeattn.kernels.testing import (
    LSE_TOLERANCE,
    O_TOLERANCE,
    make_qkv,
    split_and_merge,
)
from treeattn.testbed.kernels import cpu_fused, cpu_native

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True)
def _one_thread_auto_backend(monkeypatch):
    """The kernel serves one-thread calls (as every rank makes them) under ``auto``."""
    monkeypatch.delenv("TREEATTN_KERNEL", raising=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def kern():
    found = cpu_native.kernel()
    assert found is not None, cpu_native.unavailable_reason()  # gcc is part of the CI image
    return found


def assert_native_close(got, want, dtype):
    torch.testing.assert_close(got[0], want[0], **O_TOLERANCE[("native", dtype)])
    torch.testing.assert_close(got[1], want[1], **LSE_TOLERANCE)


def native_calls(monkeypatch) -> list[torch.dtype]:
    """Record the K dtype of every call that reaches the C kernel."""
    calls = []
    real = cpu_native.partial_attention_native
    monkeypatch.setattr(cpu_native, "partial_attention_native",
                        lambda kern, q, k, v, s: calls.append(k.dtype) or real(kern, q, k, v, s))
    return calls


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,d", [(8, 8, 128), (9, 3, 64), (32, 8, 128), (4, 1, 64),
                                      (14, 2, 64), (16, 2, 32), (6, 2, 16)])
@pytest.mark.parametrize("t", [1, 63, 64, 65, 1300])
def test_native_matches_the_oracle(kern, dtype, hq, hkv, d, t):
    """Any G up to 8, the block edges (64 tokens) and several blocks of online softmax."""
    q, k, v = make_qkv(2, hq, hkv, t, d, dtype, seed=hq * t + d)
    got = cpu_native.partial_attention_native(kern, q, k, v, d ** -0.5)
    assert got[0].dtype == torch.float32 and got[1].dtype == torch.float32
    assert_native_close(got, reference.naive_attention(q, k, v), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_native_reads_strided_views_of_a_larger_cache(kern, dtype):
    """A decode cache hands out ``[:, :, :length]`` views of a larger capacity, KV of a packed
    (2, B, Hkv, T, D) block, and token-major (B, T, Hkv, D) layouts; all unit-stride in D."""
    q, k, v = make_qkv(2, 6, 3, 400, 64, dtype, seed=4)
    want = reference.naive_attention(q, k[:, :, :250], v[:, :, :250])
    store = torch.stack([k, v])  # (2, B, Hkv, T, D)
    view_k, view_v = store[0][:, :, :250], store[1][:, :, :250]
    assert not view_k.is_contiguous() and cpu_native.applies(q, view_k, view_v, None)
    assert_native_close(partial_attention(q, view_k, view_v), want, dtype)
    token_major_k = k.transpose(1, 2).contiguous().transpose(1, 2)[:, :, :250]  # strides T·D
    token_major_v = v.transpose(1, 2).contiguous().transpose(1, 2)[:, :, :250]
    assert token_major_k.stride(2) == 3 * 64
    assert_native_close(partial_attention(q, token_major_k, token_major_v), want, dtype)


def test_scale_and_a_non_contiguous_query_are_honoured(kern):
    q, k, v = make_qkv(1, 8, 2, 300, 64, torch.float32, seed=5)
    transposed = q.transpose(1, 2).contiguous().transpose(1, 2)  # (B, Hq, D), D-stride Hq
    for scale in (0.05, 1.0):
        got = partial_attention(transposed, k, v, scale=scale)
        assert_native_close(got, reference.naive_attention(q, k, v, scale=scale), torch.float32)


def test_one_token_shard_is_that_token(kern):
    q, k, v = make_qkv(3, 4, 2, 1, 32, torch.bfloat16, seed=7)
    o, lse = cpu_native.partial_attention_native(kern, q, k, v, 32 ** -0.5)
    torch.testing.assert_close(o, v[:, :, 0].float().repeat_interleave(2, dim=1))
    want_lse = (q.float().view(3, 2, 2, 32) * k[:, :, 0:1].float()).sum(-1) * 32 ** -0.5
    torch.testing.assert_close(lse, want_lse.view(3, 4), **LSE_TOLERANCE)


def test_large_scores_do_not_overflow(kern):
    """Scores in the hundreds: only the online maximum keeps exp() finite."""
    q, k, v = make_qkv(1, 4, 2, 700, 64, torch.float32, seed=8)
    got = cpu_native.partial_attention_native(kern, q * 30, k, v, 1.0)
    assert torch.isfinite(got[0]).all() and torch.isfinite(got[1]).all()
    assert_native_close(got, reference.naive_attention(q * 30, k, v, scale=1.0), torch.float32)


@settings(max_examples=25, deadline=None)
@given(t=st.integers(1, 700), n_chunks=st.integers(1, 6), seed=st.integers(0, 10_000),
       dtype=st.sampled_from(DTYPES))
def test_any_split_merged_in_any_order_gives_whole_attention(t, n_chunks, seed, dtype):
    """Sequence parallelism with the C kernel: shards (some empty) merged in a random tree
    equal the whole."""
    torch.set_num_threads(1)  # hypothesis runs each example outside the fixture's scope
    q, k, v = make_qkv(1, 6, 2, t, 32, dtype, seed=seed)
    rng = random.Random(seed)
    got = split_and_merge(q, k, v, n_chunks, rng)
    assert_native_close(got, reference.naive_attention(q, k, v), dtype)


def _identity(partial):
    return torch.zeros_like(partial[0]), torch.full_like(partial[1], float("-inf"))


def _packed(partial) -> torch.Tensor:
    return torch.cat([partial[0].reshape(-1), partial[1].reshape(-1)])


@settings(max_examples=30, deadline=None)
@given(b=st.integers(1, 3), hq=st.integers(1, 12), d=st.sampled_from([1, 8, 64, 128]),
       seed=st.integers(0, 10_000), gap=st.floats(-80.0, 80.0))
def test_c_merge_is_the_exact_merge_and_keeps_the_identity_neutral(b, hq, d, seed, gap):
    """Any shape, partials whose log-sum-exps differ by up to 80 (where one weight
    underflows), and identities on either or both sides, in the tuple and packed forms."""
    kern = cpu_native.kernel()
    gen = torch.Generator().manual_seed(seed)
    a = (torch.randn(b, hq, d, generator=gen), torch.randn(b, hq, generator=gen))
    c = (torch.randn(b, hq, d, generator=gen), a[1] + gap)
    got = cpu_native.merge_native(kern, a, c)
    want = reference.merge(a, c)
    torch.testing.assert_close(got[0], want[0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=1e-6)
    packed = cpu_native.merge_packed_native(kern, _packed(a), _packed(c), b * hq)
    assert torch.equal(packed, _packed(got))
    for left, right in ((a, _identity(a)), (_identity(a), a)):
        same = cpu_native.merge_native(kern, left, right)
        assert torch.equal(same[0], a[0]) and torch.equal(same[1], a[1])
    both = cpu_native.merge_native(kern, _identity(a), _identity(a))
    assert torch.equal(both[0], torch.zeros_like(a[0])) and torch.isneginf(both[1]).all()


def test_merges_dispatch_to_c_under_auto_only(kern, monkeypatch):
    calls = []
    real, real_packed = cpu_native.merge_native, cpu_native.merge_packed_native
    monkeypatch.setattr(cpu_native, "merge_native",
                        lambda *a: calls.append("merge") or real(*a))
    monkeypatch.setattr(cpu_native, "merge_packed_native",
                        lambda *a: calls.append("packed") or real_packed(*a))
    part = (torch.randn(1, 4, 16), torch.randn(1, 4))
    kernels.merge(part, part)
    kernels.merge_packed(_packed(part), _packed(part), 4)
    kernels.merge((part[0].transpose(1, 2).contiguous().transpose(1, 2), part[1]), part)
    assert calls == ["merge", "packed"]  # the strided one took numpy
    monkeypatch.setenv("TREEATTN_KERNEL", "fused")
    kernels.merge(part, part)
    kernels.merge_packed(_packed(part), _packed(part), 4)
    assert calls == ["merge", "packed"]


@pytest.mark.parametrize("backend", ["auto", "fused", "torch"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", [0, 3, 5000])
def test_packed_attention_is_the_packed_partial(kern, monkeypatch, backend, dtype, t):
    """The runtime's packed form, written in place by the C kernel (auto) or concatenated
    after the other paths: numpy for 3 tokens, torch's kernels, an empty shard's identity."""
    monkeypatch.setenv("TREEATTN_KERNEL", backend)
    q, k, v = make_qkv(2, 6, 3, t, 64, dtype, seed=t + 1)
    got = kernels.partial_attention_packed(q, k, v, scale=0.1)
    assert got.dtype == torch.float32 and got.shape == (2 * 6 * 65,)
    assert torch.equal(got, _packed(partial_attention(q, k, v, scale=0.1)))
    if t:
        want = reference.naive_attention(q, k, v, scale=0.1)
        tolerance = O_TOLERANCE[("fused" if backend == "fused" else "native", dtype)]
        torch.testing.assert_close(got[: 2 * 6 * 64].view(2, 6, 64), want[0], **tolerance)


def test_dispatch_sends_one_thread_dense_fp32_and_bf16_to_native(kern, monkeypatch):
    calls = native_calls(monkeypatch)
    big = make_qkv(1, 4, 2, 5000, 64, torch.float32)  # K over the small path's limit
    partial_attention(*big)
    partial_attention(*(x.to(torch.bfloat16) for x in big))
    assert calls == [torch.float32, torch.bfloat16]
    partial_attention(*(x.to(torch.float16) for x in big))  # fp16: the exact path
    partial_attention(*big, kv_len=torch.tensor([4000]))  # ragged: exact path
    partial_attention(*make_qkv(1, 18, 2, 5000, 64, torch.float32))  # G = 9 > 8: fused
    odd_d = kern.lanes + kern.lanes // 2 if kern.lanes > 1 else kern.max_d + 1
    partial_attention(*make_qkv(1, 4, 2, 5000, odd_d, torch.float32))  # D not a lane multiple
    torch.set_num_threads(2)
    partial_attention(*big)  # more threads: torch's kernels use them
    torch.set_num_threads(1)
    monkeypatch.setenv("TREEATTN_KERNEL", "fused")
    partial_attention(*big)
    assert calls == [torch.float32, torch.bfloat16]
    monkeypatch.setenv("TREEATTN_KERNEL", "native")
    partial_attention(*big)
    assert calls == [torch.float32, torch.bfloat16, torch.float32]


def test_without_a_kernel_auto_falls_back_and_native_by_name_says_why(monkeypatch):
    monkeypatch.setattr(cpu_native, "_load", lambda: (None, "no C compiler found (test)"))
    fused = []
    real = cpu_fused.partial_attention_fused
    monkeypatch.setattr(cpu_fused, "partial_attention_fused",
                        lambda *a: fused.append(1) or real(*a))
    q, k, v = make_qkv(1, 4, 2, 5000, 64, torch.float32)
    assert_native_close(partial_attention(q, k, v), reference.naive_attention(q, k, v),
                        torch.float32)
    assert fused == [1]
    monkeypatch.setenv("TREEATTN_KERNEL", "native")
    with pytest.raises(KernelError, match="TREEATTN_KERNEL=native.*no C compiler found"):
        partial_attention(q, k, v)


def test_a_portable_build_has_narrower_vectors_and_the_same_results(tmp_path):
    """Without -march=native an x86-64 compiler targets SSE2 (4 lanes): the other branch of
    the kernel's vector width, checked on the same oracle."""
    path = cpu_native.build(tmp_path, flags=("-O2",))
    portable = cpu_native.NativeKernel(path)
    assert portable.lanes in (4, 8, 16) and portable.max_d == 256
    assert cpu_native.fits(portable, 64) and not cpu_native.fits(portable, 512)
    for dtype in DTYPES:
        q, k, v = make_qkv(2, 12, 4, 333, 64, dtype, seed=9)
        got = cpu_native.partial_attention_native(portable, q, k, v, 0.125)
        assert_native_close(got, reference.naive_attention(q, k, v, scale=0.125), dtype)


def test_builds_are_cached_and_concurrent_builders_agree(tmp_path):
    paths = []
    builders = [threading.Thread(target=lambda: paths.append(cpu_native.build(tmp_path,
                                                                             ("-O1",))))
                for _ in range(2)]
    for b in builders:
        b.start()
    for b in builders:
        b.join(timeout=240)
    assert len(paths) == 2 and paths[0] == paths[1]
    assert [p.name for p in tmp_path.iterdir()] == [paths[0].name]  # no temporary left
    mtime = paths[0].stat().st_mtime_ns
    assert cpu_native.build(tmp_path, ("-O1",)) == paths[0]
    assert paths[0].stat().st_mtime_ns == mtime  # reused, not rebuilt


def test_a_failing_or_missing_compiler_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", "false")
    with pytest.raises(OSError, match="could not build treeattn-native"):
        cpu_native.build(tmp_path)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setenv("CC", "env TREEATTN_TEST=1 cc")  # a compiler command of several words
    assert cpu_native.NativeKernel(cpu_native.build(tmp_path, ("-O1",))).lanes > 0
    monkeypatch.setattr(cpu_native, "_compiler", lambda: None)
    with pytest.raises(OSError, match="no C compiler found"):
        cpu_native.build(tmp_path)
