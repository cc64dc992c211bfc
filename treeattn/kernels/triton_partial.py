"""Flash-decoding partial attention in Triton: split-K over T, one program per GQA group.

Decode is memory-bound: each K and V byte is read once and used by the G = Hq/Hkv query heads
of its group. A program owns one (batch, KV head, split of T); it loads the G queries of the
group as a (G_PAD, D) tile and streams K and V blocks through an online softmax, so every KV
byte feeds G heads and nothing is repeated. The scores are a ``tl.dot`` of the (G_PAD, D)
query tile with the (D, BLOCK_N) key block: G_PAD is padded up to 16, the smallest tile the
GPU's MMA takes, which wastes tensor-core FLOPs that a memory-bound kernel has spare, and keeps
the registers small (a ``tl.sum(q[:, None, :] * k[None], 2)`` reduction would hold a
(G, BLOCK_N, D) product in registers). The splits write partials ``(o, lse)`` that the merge
kernel of :mod:`treeattn.kernels.triton_merge` reduces.

Numerics: scores accumulate in fp32. With 16-bit inputs the GPU dots take the 16-bit operands
directly (products are exact in fp32); the probabilities are rounded to the input dtype before
the P·V dot, as FlashAttention does. In Triton's interpreter a 16-bit ``tl.dot`` is wrong
(triton-lang/triton#11584), so there the operands are upcast to fp32 first, after the same
rounding, which gives the GPU's numerics. fp32 inputs use IEEE fp32 dots, not TF32.

Whether this module runs compiled or interpreted is fixed when it (and Triton) is imported;
``INTERPRETED`` records which.
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch
import triton
import triton.language as tl

from treeattn.kernels import triton_merge
from treeattn.kernels.checks import check_partial_inputs
from treeattn.kernels.dispatch import interpreter_enabled
from treeattn.kernels.reference import identity_partial

INTERPRETED = interpreter_enabled()
LOG2E = 1.4426950408889634
SPLIT_QUANTUM = 128  # tokens per split are a multiple of this, so every BLOCK_N tiles it
MIN_SPLIT_TOKENS = 256  # below this a split is not worth its share of the merge
MAX_SPLITS = 512
PROGRAMS_PER_SM = 2  # target grid; measured on an H200 (benchmarks/results/kernels-h200.md):
# at T=64k, 2 programs per SM read K+V at 82% of peak, 4 at 70%; at 1M both reach 94%


@triton.jit
def _partial_split_kernel(
    Q, K, V, KV_LEN, O_SPLIT, LSE_SPLIT,
    stride_qb, stride_qh,
    stride_kb, stride_kh, stride_kt,
    stride_vb, stride_vh, stride_vt,
    stride_os, stride_ob, stride_oh,
    stride_ls, stride_lb,
    HKV, T, TOKENS_PER_SPLIT, qk_scale_log2, SPLIT_BUCKET,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr, HAS_KV_LEN: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    pid_bh = tl.program_id(0)
    pid_s = tl.program_id(1)
    b = (pid_bh // HKV).to(tl.int64)  # int64: b * stride_kb passes 2**31 at long T
    hk = (pid_bh % HKV).to(tl.int64)
    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    mask_g = offs_g < G
    mask_d = offs_d < D
    t_len = T
    if HAS_KV_LEN:
        t_len = tl.minimum(tl.maximum(tl.load(KV_LEN + b).to(tl.int32), 0), T)
    start = pid_s * TOKENS_PER_SPLIT
    end = tl.minimum(start + TOKENS_PER_SPLIT, t_len)

    q_ptrs = Q + b * stride_qb + (hk * G + offs_g)[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=mask_g[:, None] & mask_d[None, :], other=0.0)  # (G_PAD, D_PAD)
    tile = offs_n[:, None] * stride_kt + offs_d[None, :]  # (BLOCK_N, D_PAD)
    k_ptrs = K + b * stride_kb + hk * stride_kh + start.to(tl.int64) * stride_kt + tile
    tile = offs_n[:, None] * stride_vt + offs_d[None, :]
    v_ptrs = V + b * stride_vb + hk * stride_vh + start.to(tl.int64) * stride_vt + tile
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_t = n0 + offs_n
        if D == D_PAD:  # a mask constant along D keeps the loads vectorised
            mask_kv = (offs_t < end)[:, None]
        else:
            mask_kv = (offs_t < end)[:, None] & mask_d[None, :]
        k = tl.load(k_ptrs, mask=mask_kv, other=0.0)  # (BLOCK_N, D_PAD)
        if UPCAST:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))  # (G_PAD, BLOCK_N) fp32 accumulate
        s = tl.where((offs_t < end)[None, :], s * qk_scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every block has a visible token
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])  # (G_PAD, BLOCK_N)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptrs, mask=mask_kv, other=0.0)  # (BLOCK_N, D_PAD)
        p_lo = p.to(v.dtype)  # FlashAttention rounding; a no-op for fp32 inputs
        if UPCAST:
            pv = tl.dot(p_lo.to(tl.float32), v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p_lo, v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
        k_ptrs += BLOCK_N * stride_kt
        v_ptrs += BLOCK_N * stride_vt

    nonempty = l_i > 0.0
    o = tl.where(nonempty[:, None], acc / tl.where(nonempty, l_i, 1.0)[:, None], 0.0)
    lse = tl.where(nonempty, (m_i + tl.log2(tl.where(nonempty, l_i, 1.0))) / 1.4426950408889634,
                   float("-inf"))
    o_ptrs = (O_SPLIT + pid_s * stride_os + b * stride_ob
              + (hk * G + offs_g)[:, None] * stride_oh + offs_d[None, :])
    tl.store(o_ptrs, o, mask=mask_g[:, None] & mask_d[None, :])
    tl.store(LSE_SPLIT + pid_s * stride_ls + b * stride_lb + hk * G + offs_g, lse, mask=mask_g)


def _gpu_configs() -> list[triton.Config]:
    """Candidate tilings for the compiled kernel; BLOCK_N always divides SPLIT_QUANTUM."""
    shapes = [(64, 4, 2), (64, 4, 3), (64, 4, 4), (128, 4, 2), (128, 8, 3), (32, 4, 3)]
    return [
        triton.Config({"BLOCK_N": n}, num_warps=w, num_stages=s) for n, w, s in shapes
    ]


# Re-tuned per head shape, dtype and log2 bucket of the split length (a few buckets per run).
_tuned_kernel = triton.autotune(
    configs=_gpu_configs(), key=["G_PAD", "D_PAD", "UPCAST", "SPLIT_BUCKET"]
)(_partial_split_kernel)


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.lru_cache(maxsize=16)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_splits_for(b: int, hkv: int, t: int, sm_count: int) -> tuple[int, int]:
    """Choose ``(num_splits, tokens_per_split)`` so that the grid fills the GPU.

    The grid is ``B·Hkv × num_splits`` programs; aim for ``PROGRAMS_PER_SM`` per SM, never
    splitting below ``MIN_SPLIT_TOKENS`` tokens, with split lengths a multiple of
    ``SPLIT_QUANTUM`` so that every split but the last is made of whole blocks.

    >>> num_splits_for(1, 8, 65536, 132)  # H100/H200 SXM, 132 SMs: 32 splits of 2048 tokens
    (32, 2048)
    >>> num_splits_for(64, 8, 4096, 132)  # a big batch already fills the GPU
    (1, 4096)
    >>> num_splits_for(1, 8, 0, 132)
    (1, 128)
    """
    want = max(1, math.ceil(PROGRAMS_PER_SM * sm_count / max(1, b * hkv)))
    most = max(1, min(MAX_SPLITS, math.ceil(t / MIN_SPLIT_TOKENS)))
    splits = min(want, most)
    per_split = math.ceil(math.ceil(t / splits) / SPLIT_QUANTUM) * SPLIT_QUANTUM
    per_split = max(SPLIT_QUANTUM, per_split)
    return max(1, math.ceil(t / per_split)), per_split


def partial_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None = None,
    kv_len: torch.Tensor | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton partial attention; same contract as the reference ``partial_attention``.

    ``num_splits`` and ``block_n`` override the automatic choice (tests use them to keep the
    interpreter fast and to force several splits); the compiled path autotunes ``block_n``.
    """
    scale = check_partial_inputs(q, k, v, scale, kv_len)
    return partial_attention_checked(q, k, v, scale, kv_len, num_splits, block_n)


def partial_attention_checked(q, k, v, scale: float, kv_len=None, num_splits=None,
                              block_n=None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`partial_attention` for inputs already checked (``scale`` resolved).

    The public dispatcher checks once and calls this: at decode sizes on a GPU the host's
    Python is the bottleneck (``benchmarks/decode_step.py``), so it is not done twice.
    """
    b, hq, d = q.shape
    hkv, t = k.shape[1], k.shape[2]
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    compiled = q.is_cuda and not INTERPRETED
    sms = _sm_count(_device_index(q.device)) if compiled else 4
    splits, per_split = num_splits_for(b, hkv, t, sms)
    if num_splits is not None:
        splits = max(1, int(num_splits))
        per_split = max(1, math.ceil(t / splits))
    if b == 0:
        return identity_partial(b, hq, d, q.device)
    o_split = torch.empty(splits, b, hq, d, dtype=torch.float32, device=q.device)
    lse_split = torch.empty(splits, b, hq, dtype=torch.float32, device=q.device)
    g = hq // hkv
    d_pad = max(16, triton.next_power_of_2(d))
    args = (
        q, k, v, kv_len if kv_len is not None else q, o_split, lse_split,
        q.stride(0), q.stride(1),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        o_split.stride(0), o_split.stride(1), o_split.stride(2),
        lse_split.stride(0), lse_split.stride(1),
        hkv, t, per_split, scale * LOG2E, max(0, per_split.bit_length()),
    )  # fmt: skip
    meta = dict(
        G=g, G_PAD=max(16, triton.next_power_of_2(g)), D=d, D_PAD=d_pad,
        HAS_KV_LEN=kv_len is not None, UPCAST=INTERPRETED or q.dtype == torch.float32,
    )  # fmt: skip
    grid = (b * hkv, splits)
    with _on_device_of(q):
        if INTERPRETED:
            _partial_split_kernel[grid](*args, BLOCK_N=block_n or 64, **meta)
        elif block_n is not None:
            smem = _smem_bytes(_device_index(q.device))
            stages = stages_for(block_n, d_pad, q.element_size(), smem)
            _partial_split_kernel[grid](*args, BLOCK_N=block_n, num_stages=stages, **meta)
        else:
            _tuned_kernel[grid](*args, **meta)
    if splits == 1:
        return o_split[0], lse_split[0]
    return triton_merge.merge_stacked_checked(o_split, lse_split)


def _on_device_of(x: torch.Tensor):
    """A CUDA device context only when ``x`` is not on the current device (it costs µs)."""
    if x.is_cuda and x.device.index != torch.cuda.current_device():
        return torch.cuda.device(x.device)
    return contextlib.nullcontext()


SMEM_FALLBACK_BYTES = 99 * 1024  # shared memory per block when torch cannot tell (sm_86/89)


@functools.lru_cache(maxsize=16)
def _smem_bytes(device_index: int) -> int:
    props = torch.cuda.get_device_properties(device_index)
    return int(getattr(props, "shared_memory_per_block_optin", 0) or SMEM_FALLBACK_BYTES)


def stages_for(block_n: int, d_pad: int, itemsize: int, smem_bytes: int) -> int:
    """Pipeline depth for a forced block: up to 3 stages of K and V blocks that fit in
    shared memory. (The autotuner simply skips configurations that do not fit; a forced
    block has no such fallback: fp32 with 128-token blocks of D=128 fits only one stage.)

    >>> h100 = 232448  # bytes of shared memory per block, opted in
    >>> stages_for(128, 128, 4, h100), stages_for(128, 128, 2, h100), stages_for(64, 64, 4, h100)
    (1, 3, 3)
    """
    per_stage = 2 * block_n * d_pad * itemsize  # one K block and one V block
    return max(1, min(3, smem_bytes // per_stage))
