"""Triton kernels under Triton's interpreter: kernel = torch reference = naive oracle.

Triton fixes interpreter-or-compiler for every ``@triton.jit`` function when it is defined,
its own ``tl.zeros``/``tl.sum`` included, which happens at ``import triton``; so
``TRITON_INTERPRET=1`` has to be in the environment before anything in the process imports
Triton, and setting it later from a fixture cannot work. When this file is collected in a
process that already runs Triton interpreted (``TRITON_INTERPRET=1 pytest ...``) its tests run
in place. Otherwise they are skipped here and ``test_triton_kernels_in_interpreter_subprocess``
runs this file in a child pytest with the variable set, under a timeout, and fails with the
child's report. Other test files never see the variable. The interpreter is slow, so shapes
are small and blocks big.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from treeattn.kernels import KernelError, merge, merge_stacked, partial_attention, reference
from treeattn.kernels.dispatch import interpreter_enabled, triton_module
from treeattn.kernels.testing import (
    LSE_TOLERANCE,
    O_TOLERANCE,
    cut_points,
    make_qkv,
    merge_random_tree,
)

pytest.importorskip("triton")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
CHILD_TIMEOUT_S = 240


def _interpreting() -> bool:
    """True when Triton is (or will be, once imported) in interpreter mode in this process."""
    if not interpreter_enabled():
        return False
    if "triton.language" not in sys.modules:
        return True
    from treeattn.kernels.dispatch import triton_is_interpreted

    return triton_is_interpreted()


IN_INTERPRETER = _interpreting()


@pytest.mark.skipif(IN_INTERPRETER, reason="already in the interpreter: tests run in place")
def test_triton_kernels_in_interpreter_subprocess():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONHASHSEED": "0"}
    cmd = [sys.executable, "-m", "pytest", str(Path(__file__)), "-q", "-x", "-p",
           "no:cacheprovider", f"--timeout={CHILD_TIMEOUT_S}",
           "-k", "not in_interpreter_subprocess"]  # fmt: skip
    proc = subprocess.run(
        cmd, env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S + 30,
        cwd=Path(__file__).resolve().parents[1],
    )  # fmt: skip
    report = proc.stdout[-6000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, f"Triton interpreter tests failed:\n{report}"
    assert " passed" in proc.stdout and " skipped" not in proc.stdout, report


@pytest.fixture(scope="module", autouse=True)
def triton_backend():
    """Route the public functions to Triton for this file's in-interpreter tests."""
    with pytest.MonkeyPatch.context() as mp:
        if IN_INTERPRETER:
            mp.setenv("TREEATTN_KERNEL", "triton")
        yield


def _interpreted(name: str):
    if not IN_INTERPRETER:
        pytest.skip("run by test_triton_kernels_in_interpreter_subprocess")
    module = triton_module(name)
    assert module.INTERPRETED
    return module


@pytest.fixture(scope="module")
def tp():
    return _interpreted("triton_partial")


@pytest.fixture(scope="module")
def tm():
    return _interpreted("triton_merge")


def assert_partial_close(got, want, dtype):
    torch.testing.assert_close(got[0], want[0], **O_TOLERANCE[("triton", dtype)])
    torch.testing.assert_close(got[1], want[1], **LSE_TOLERANCE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2)])
@pytest.mark.parametrize("d", [64, 128])
def test_kernel_matches_reference_and_naive(tp, dtype, hq, hkv, d):
    t = 150  # not a multiple of the 64-token block; 2 splits of 75 tokens
    q, k, v = make_qkv(2, hq, hkv, t, d, dtype, seed=d + hq)
    kv_len = torch.tensor([t, 70])
    for lens in (None, kv_len):
        got = tp.partial_attention(q, k, v, kv_len=lens, num_splits=2, block_n=64)
        assert got[0].dtype == got[1].dtype == torch.float32
        assert_partial_close(got, reference.naive_attention(q, k, v, kv_len=lens), dtype)
        assert_partial_close(got, reference.partial_attention(q, k, v, kv_len=lens), dtype)


@pytest.mark.parametrize("hq,hkv,d", [(8, 8, 64), (12, 4, 80), (32, 8, 128)])
def test_public_dispatch_with_automatic_splits(tp, hq, hkv, d):
    # D=80 is padded to 128 in the kernel; G=3 is padded to 16.
    q, k, v = make_qkv(1, hq, hkv, 700, d, torch.bfloat16, seed=hq)
    got = partial_attention(q, k, v)
    assert_partial_close(got, reference.naive_attention(q, k, v), torch.bfloat16)


def test_non_contiguous_kv_views(tp):
    # A shard is often a slice of a bigger cache along T: strides, not copies.
    q, k, v = make_qkv(2, 4, 2, 120, 64, torch.float32, seed=11)
    ks, vs = k[:, :, 10:110], v[:, :, 10:110]
    got = tp.partial_attention(q, ks, vs, num_splits=3, block_n=32)
    assert_partial_close(got, reference.naive_attention(q, ks, vs), torch.float32)


@settings(max_examples=12, deadline=None)
@given(
    t=st.integers(0, 90),
    n_chunks=st.integers(1, 5),
    seed=st.integers(0, 2**16),
    many=st.booleans(),
)
def test_chunked_partials_merge_to_full_attention(tp, t, n_chunks, seed, many):
    rng = random.Random(seed)
    q, k, v = make_qkv(2, 4, 2, t, 16, torch.float32, seed=seed)
    bounds = cut_points(t, n_chunks, rng)
    parts = [
        tp.partial_attention(q, k[:, :, a:b], v[:, :, a:b], num_splits=2, block_n=32)
        for a, b in zip(bounds[:-1], bounds[1:], strict=True)
    ]
    got = merge_random_tree(parts, rng, merge, merge_stacked if many else None)
    if t == 0:
        assert torch.equal(got[0], torch.zeros_like(got[0]))
        assert torch.isneginf(got[1]).all()
    else:
        assert_partial_close(got, reference.naive_attention(q, k, v), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_empty_and_single_token(tp, dtype):
    q, k, v = make_qkv(2, 4, 2, 0, 32, dtype)
    o, lse = tp.partial_attention(q, k, v, num_splits=3, block_n=32)
    assert torch.equal(o, torch.zeros_like(o)) and torch.isneginf(lse).all()
    q, k, v = make_qkv(2, 4, 2, 1, 32, dtype, seed=2)
    got = tp.partial_attention(q, k, v, num_splits=2, block_n=32)  # second split is empty
    torch.testing.assert_close(got[0], v[:, :, 0].float().repeat_interleave(2, 1))
    assert_partial_close(got, reference.naive_attention(q, k, v), dtype)


def test_kv_len_zero_row_is_identity(tp):
    q, k, v = make_qkv(3, 4, 2, 40, 32, torch.float16, seed=6)
    o, lse = tp.partial_attention(q, k, v, kv_len=torch.tensor([0, 40, 9]), block_n=32)
    assert torch.equal(o[0], torch.zeros_like(o[0])) and torch.isneginf(lse[0]).all()
    assert torch.isfinite(o).all()
    want = reference.naive_attention(q, k, v, kv_len=torch.tensor([0, 40, 9]))
    assert_partial_close((o[1:], lse[1:]), (want[0][1:], want[1][1:]), torch.float16)


@pytest.mark.parametrize("dtype", DTYPES)
def test_huge_scores_do_not_overflow(tp, dtype):
    q, k, v = make_qkv(2, 4, 2, 50, 32, dtype, seed=7)
    scale = 1e4 / 32**0.5
    o, lse = tp.partial_attention(q, k, v, scale=scale, num_splits=2, block_n=32)
    assert torch.isfinite(o).all() and torch.isfinite(lse).all()
    want = reference.naive_attention(q, k, v, scale=scale)
    torch.testing.assert_close(lse, want[1], atol=0, rtol=1e-6)  # scores ~1e5
    torch.testing.assert_close(o, want[0], **O_TOLERANCE[("triton", dtype)])


def test_fp16_near_its_limits(tp):
    gen = torch.Generator().manual_seed(8)
    q = ((torch.rand(2, 4, 64, generator=gen) * 2 - 1) * 250).half()
    k = ((torch.rand(2, 2, 33, 64, generator=gen) * 2 - 1) * 250).half()
    v = ((torch.rand(2, 2, 33, 64, generator=gen) * 2 - 1) * 65000).half()
    o, lse = tp.partial_attention(q, k, v, scale=1e-3, num_splits=2, block_n=32)
    assert torch.isfinite(o).all() and torch.isfinite(lse).all()
    want = reference.naive_attention(q, k, v, scale=1e-3)
    # |o| ~ 6e4 and p is rounded to fp16 (2^-12 relative): scale fp16's tolerance by |v|.
    torch.testing.assert_close(o, want[0], atol=65000 * 2e-3, rtol=2e-3)
    torch.testing.assert_close(lse, want[1], **LSE_TOLERANCE)


def test_merge_kernel_matches_reference(tm):
    gen = torch.Generator().manual_seed(4)
    o = torch.randn(70, 2, 3, 40, generator=gen)  # (n, B, Hq, D): n > one 64-wide tile
    lse = torch.randn(70, 2, 3, generator=gen) * 30  # (n, B, Hq)
    lse[:, 0, 0] = float("-inf")  # a row of identities
    lse[5:, 1, 2] = float("-inf")  # identities mixed with real partials
    got = tm.merge_stacked(o, lse)
    want = reference.merge_stacked(o, lse)
    torch.testing.assert_close(got[0], want[0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got[1], want[1], atol=1e-6, rtol=1e-6)
    assert torch.equal(got[0][0, 0], torch.zeros(40)) and torch.isneginf(got[1][0, 0])


def test_merge_kernel_identities_and_pairs(tm):
    ident = reference.identity_partial(2, 3, 8)
    o, lse = tm.merge(ident, ident)
    assert torch.equal(o, ident[0]) and torch.equal(lse, ident[1])
    a = (torch.full((1, 1, 16), 1.0), torch.zeros(1, 1))
    b = (torch.full((1, 1, 16), 3.0), torch.zeros(1, 1))
    o, lse = tm.merge(a, b)  # equal weights 1/2, by hand
    assert torch.equal(o, torch.full((1, 1, 16), 2.0))
    assert lse.item() == pytest.approx(0.6931471805599453, rel=1e-6)
    o, lse = tm.merge_stacked(torch.zeros(0, 2, 3, 8), torch.zeros(0, 2, 3))
    assert torch.equal(o, torch.zeros(2, 3, 8)) and torch.isneginf(lse).all()


def test_bit_identical_across_calls(tp, tm):
    q, k, v = make_qkv(2, 8, 2, 130, 64, torch.bfloat16, seed=9)
    kv_len = torch.tensor([130, 77])
    first = tp.partial_attention(q, k, v, kv_len=kv_len, num_splits=3, block_n=32)
    second = tp.partial_attention(q, k, v, kv_len=kv_len, num_splits=3, block_n=32)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    stack = (torch.stack([first[0], second[0] + 1]), torch.stack([first[1], second[1] - 2]))
    again = zip(tm.merge_stacked(*stack), tm.merge_stacked(*stack), strict=True)
    assert all(torch.equal(x, y) for x, y in again)


def test_bad_input_is_kernel_error_on_triton_path(tp):
    q, k, v = make_qkv(2, 3, 2, 5, 8, torch.float32)
    with pytest.raises(KernelError, match="Hq=3"):
        partial_attention(q, k, v)
