"""Compiled Triton kernels on a CUDA GPU: kernel = torch reference = naive float64 oracle.

The interpreter tests (``test_kernels_triton.py``) check what the kernels compute on CPU; these
check the same contract as compiled for the GPU in this process, with CUDA tensors, the
autotuned launch and the automatic split count, which the interpreter never exercises. They run
on a GPU machine (``benchmarks/gpu_check.sh``) and are skipped, with the reason, elsewhere.
"""

from __future__ import annotations

import pytest
import torch

from treeattn.kernels import merge_stacked, partial_attention, reference
from treeattn.kernels.dispatch import choose_backend
from treeattn.kernels.testing import LSE_TOLERANCE, O_TOLERANCE, make_qkv

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
CUDA = "cuda"


@pytest.fixture(scope="module")
def tp():
    from treeattn.kernels import triton_partial

    assert not triton_partial.INTERPRETED, "these tests need Triton compiled, not interpreted"
    return triton_partial


def assert_matches(got, q, k, v, dtype, kv_len=None):
    """``got`` against the naive float64 oracle and the torch reference, on the same GPU."""
    for want in (reference.naive_attention(q, k, v, kv_len=kv_len),
                 reference.partial_attention(q, k, v, kv_len=kv_len)):  # fmt: skip
        torch.testing.assert_close(got[0], want[0].float(), **O_TOLERANCE[("triton", dtype)])
        torch.testing.assert_close(got[1], want[1].float(), **LSE_TOLERANCE)


def test_cuda_tensors_take_the_triton_path():
    assert choose_backend(torch.device(CUDA)) == "triton"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,d", [(32, 8, 128), (9, 3, 64)])
def test_kernel_matches_reference_and_oracle(tp, dtype, hq, hkv, d):
    # One block size (each compile costs a second or two on a fresh machine); the automatic
    # split count; T not a multiple of any block.
    t = 3001
    q, k, v = make_qkv(2, hq, hkv, t, d, dtype, seed=hq + d, device=CUDA)
    kv_len = torch.tensor([t, 1234], device=CUDA)
    for lens in (None, kv_len):
        got = tp.partial_attention(q, k, v, kv_len=lens, block_n=64)
        assert got[0].dtype == got[1].dtype == torch.float32 and got[0].is_cuda
        assert_matches(got, q, k, v, dtype, lens)


@pytest.mark.parametrize("hq,hkv,d", [(32, 8, 128), (9, 3, 64)])
def test_autotuned_launch_matches_reference_and_oracle(hq, hkv, d):
    q, k, v = make_qkv(1, hq, hkv, 9000, d, torch.bfloat16, seed=d, device=CUDA)
    assert_matches(partial_attention(q, k, v), q, k, v, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_n,splits", [(32, 1), (64, 3), (128, 7)])
def test_forced_blocks_and_splits(tp, dtype, block_n, splits):
    q, k, v = make_qkv(3, 16, 4, 777, 128, dtype, seed=block_n, device=CUDA)
    kv_len = torch.tensor([777, 0, 65], device=CUDA, dtype=torch.int32)
    got = tp.partial_attention(q, k, v, kv_len=kv_len, num_splits=splits, block_n=block_n)
    assert torch.equal(got[0][1], torch.zeros_like(got[0][1]))  # kv_len 0: the identity
    assert torch.isneginf(got[1][1]).all()
    want = reference.naive_attention(q, k, v, kv_len=kv_len)
    for i in (0, 2):
        torch.testing.assert_close(got[0][i], want[0][i].float(), **O_TOLERANCE[("triton", dtype)])
        torch.testing.assert_close(got[1][i], want[1][i].float(), **LSE_TOLERANCE)


@pytest.mark.parametrize("dtype", DTYPES)
def test_empty_and_single_token_shards(dtype):
    q, k, v = make_qkv(2, 8, 2, 0, 64, dtype, device=CUDA)
    o, lse = partial_attention(q, k, v)
    assert torch.equal(o, torch.zeros_like(o)) and torch.isneginf(lse).all()
    q, k, v = make_qkv(2, 8, 2, 1, 64, dtype, seed=3, device=CUDA)
    o, lse = partial_attention(q, k, v)
    torch.testing.assert_close(o, v[:, :, 0].float().repeat_interleave(4, 1))


def test_long_shard_many_splits_and_the_merge_kernel(tp):
    t = 200_003  # the automatic split count, then 300 splits: more than one merge tile of 64
    q, k, v = make_qkv(1, 32, 8, t, 128, torch.bfloat16, seed=5, device=CUDA)
    assert_matches(partial_attention(q, k, v), q, k, v, torch.bfloat16)
    assert_matches(tp.partial_attention(q, k, v, num_splits=300, block_n=64), q, k, v,
                   torch.bfloat16)


def test_shards_merge_to_full_attention_and_views_are_read_in_place():
    q, k, v = make_qkv(2, 32, 8, 5000, 128, torch.bfloat16, seed=6, device=CUDA)
    cuts = [0, 1, 1, 2048, 4097, 5000]  # an empty shard, a 1-token shard, uneven others
    parts = [partial_attention(q, k[:, :, a:b], v[:, :, a:b]) for a, b in zip(cuts, cuts[1:])]
    merged = merge_stacked(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
    assert_matches(merged, q, k, v, torch.bfloat16)


def test_merge_kernel_matches_reference_on_gpu():
    gen = torch.Generator().manual_seed(4)
    o = torch.randn(300, 2, 5, 128, generator=gen).to(CUDA)  # (n, B, Hq, D)
    lse = (torch.randn(300, 2, 5, generator=gen) * 30).to(CUDA)  # (n, B, Hq)
    lse[:, 0, 0] = float("-inf")
    lse[7:, 1, 3] = float("-inf")
    got, want = merge_stacked(o, lse), reference.merge_stacked(o, lse)
    torch.testing.assert_close(got[0], want[0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got[1], want[1], atol=1e-6, rtol=1e-6)
    assert torch.equal(got[0][0, 0], torch.zeros(128, device=CUDA))


def test_bit_identical_across_calls():
    q, k, v = make_qkv(1, 32, 8, 70_000, 128, torch.bfloat16, seed=9, device=CUDA)
    first, second = partial_attention(q, k, v), partial_attention(q, k, v)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])


def test_large_batch_fills_the_grid_without_splitting():
    q, k, v = make_qkv(64, 32, 8, 2048, 128, torch.bfloat16, seed=10, device=CUDA)
    kv_len = torch.randint(0, 2049, (64,), device=CUDA)
    assert_matches(partial_attention(q, k, v, kv_len=kv_len), q, k, v, torch.bfloat16, kv_len)
