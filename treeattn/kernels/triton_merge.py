"""Merge of n partials ``(o, lse)`` in Triton, ``-inf`` safe.

One program per (batch, head) row. It reads the n log-sum-exps in tiles of BLOCK_S to find
their maximum ``m``, then weighs each ``o_i`` by ``exp(lse_i − m)``:
``lse = m + log Σ exp(lse_i − m)`` and ``o = Σ exp(lse_i − m)·o_i / Σ exp(lse_i − m)``.
That is the pairwise merge (docs/design.md) applied n times, in one pass over the ``o``. When every
input is the identity (``lse = −inf``) the maximum is replaced by 0 so no ``−inf − (−inf)``
NaN appears, and the output is the identity ``(0, −inf)``. Arithmetic is fp32 whatever the
input dtype, and there is no ``tl.dot``, so the interpreter's 16-bit dot bug does not apply.

This kernel also reduces the splits of :mod:`treeattn.kernels.triton_partial`.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from treeattn.kernels.checks import check_pair, check_partials
from treeattn.kernels.dispatch import interpreter_enabled
from treeattn.kernels.reference import identity_partial

INTERPRETED = interpreter_enabled()


@triton.jit
def _merge_kernel(
    O_IN, LSE_IN, O_OUT, LSE_OUT,
    N, HQ,
    stride_in, stride_ib, stride_ih,
    stride_ln, stride_lb, stride_lh,
    stride_ob, stride_oh, stride_lob,
    D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    b = pid // HQ
    h = pid % HQ
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, D_PAD)
    mask_d = offs_d < D
    lse_base = LSE_IN + b * stride_lb + h * stride_lh
    o_base = O_IN + b * stride_ib + h * stride_ih

    m_vec = tl.full([BLOCK_S], float("-inf"), tl.float32)
    for s0 in range(0, N, BLOCK_S):
        idx = s0 + offs_s
        lse = tl.load(lse_base + idx * stride_ln, mask=idx < N, other=float("-inf"))
        m_vec = tl.maximum(m_vec, lse.to(tl.float32))
    m = tl.max(m_vec, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)

    l_vec = tl.zeros([BLOCK_S], tl.float32)
    acc = tl.zeros([D_PAD], tl.float32)
    for s0 in range(0, N, BLOCK_S):
        idx = s0 + offs_s
        lse = tl.load(lse_base + idx * stride_ln, mask=idx < N, other=float("-inf"))
        w = tl.exp(lse.to(tl.float32) - m_safe)  # (BLOCK_S,); 0 for identities and padding
        o = tl.load(o_base + idx[:, None] * stride_in + offs_d[None, :],
                    mask=(idx < N)[:, None] & mask_d[None, :], other=0.0)  # (BLOCK_S, D_PAD)
        l_vec += w
        acc += tl.sum(w[:, None] * o.to(tl.float32), 0)
    l_sum = tl.sum(l_vec, 0)
    nonempty = l_sum > 0.0
    l_div = tl.where(nonempty, l_sum, 1.0)
    out = tl.where(nonempty, acc / l_div, 0.0)
    lse_out = tl.where(nonempty, m_safe + tl.log(l_div), float("-inf"))
    tl.store(O_OUT + b * stride_ob + h * stride_oh + offs_d, out, mask=mask_d)
    tl.store(LSE_OUT + b * stride_lob + h, lse_out)


def merge_stacked(o: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge n stacked partials (n, B, Hq, D), (n, B, Hq) into (B, Hq, D), (B, Hq) fp32."""
    check_partials(o, lse, stacked=True)
    return merge_stacked_checked(o, lse)


def merge_stacked_checked(o: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """:func:`merge_stacked` for inputs already checked (the split kernel's own outputs)."""
    n, b, hq, d = o.shape
    if n == 0 or b * hq * d == 0:
        return identity_partial(b, hq, d, o.device)
    if o.stride(-1) != 1:
        o = o.contiguous()
    o_out = torch.empty(b, hq, d, dtype=torch.float32, device=o.device)  # (B, Hq, D)
    lse_out = torch.empty(b, hq, dtype=torch.float32, device=o.device)  # (B, Hq)
    block_s = min(64, max(2, triton.next_power_of_2(n)))
    d_pad = max(16, triton.next_power_of_2(d))
    on_other_device = o.is_cuda and o.device.index != torch.cuda.current_device()
    with torch.cuda.device(o.device) if on_other_device else contextlib.nullcontext():
        _merge_kernel[(b * hq,)](
            o, lse, o_out, lse_out,
            n, hq,
            o.stride(0), o.stride(1), o.stride(2),
            lse.stride(0), lse.stride(1), lse.stride(2),
            o_out.stride(0), o_out.stride(1), lse_out.stride(0),
            D=d, D_PAD=d_pad, BLOCK_S=block_s,
            num_warps=1 if d_pad * block_s <= 2048 else 4,
        )  # fmt: skip
    return o_out, lse_out


def merge(
    a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partials with the same kernel (they are stacked first: O(B·Hq·D) bytes)."""
    check_pair(a, b)
    o = torch.stack([a[0], b[0].to(a[0].dtype)])  # (2, B, Hq, D)
    lse = torch.stack([a[1], b[1].to(a[1].dtype)])  # (2, B, Hq)
    return merge_stacked(o, lse)
