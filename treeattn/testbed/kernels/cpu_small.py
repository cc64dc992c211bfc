"""Partial attention and merge of small fp32 CPU tensors in numpy.

Why a third CPU path: a decode step's merges, and the attention of a short shard, are a few
microseconds of arithmetic. On a CPU, torch spends about 2-5 µs dispatching each operator,
so the exact path's 9 operators (:func:`treeattn.kernels.reference._dense_fp32`) plus its
reshapes cost 23-40 µs for a 4-token shard, and its merge 15-20 µs, whatever the size. numpy
dispatches an operator in about 1 µs on the same machine. Measured one thread each, median
of five batches (this repository's 2-core box, torch 2.13):

* attention, Hq = Hkv = 1, D = 8, 4 tokens: 35 µs in torch, 10 µs in numpy;
* attention, 32/8 heads, D = 128, 64 tokens (65,536 K elements): 35 against 27 µs;
* attention, 9/3 heads, D = 64, 1024 tokens: 81 against 143 µs (torch wins);
* merge of 8 heads × 128: 20 against 9 µs; of 128 × 128: 23 against 20 µs; of 512 × 128:
  41 against 53 µs (torch wins).

Where the C kernel (:mod:`treeattn.testbed.kernels.cpu_native`) takes a call it runs first: it
beats this path 2-3x even on a 16-token shard (``benchmarks/results/kernel_paths.md``). So
this path serves the CPU chain without it (no C compiler, or ``TREEATTN_KERNEL=fused``),
where it is 2.2-3.1x faster than the exact path on such shards and 1.5x on merges.

It takes fp32 attention whose K holds at most :data:`MAX_KV_ELEMENTS` elements
(and whose matmuls stay on one BLAS thread, :data:`MAX_MATMUL_WORK`), and
fp32 merges whose ``o`` holds at most :data:`MAX_MERGE_ELEMENTS` (a 64 KiB partial, the
largest a shared-memory mailbox carries); above that, torch's vectorised kernels win.
A schedule step on tiny payloads is where it shows (``benchmarks/executor_overhead.py``).

Numerics: the exact path's two passes in the same fp32 order of operations (scores, exact
maximum, ``exp``, sum, ``P·V``, divide); only the ``exp``/``log`` implementations differ
(numpy's and torch's are both within 1-2 ulp), so results sit within the exact path's own
tolerance of the float64 oracle. ``TREEATTN_KERNEL=torch`` forces the exact path.
"""

from __future__ import annotations

import numpy as np
import torch

MAX_KV_ELEMENTS = 1 << 16  # B·Hkv·T·D of K: 256 KiB in fp32
# Each per-head matmul does G·T·D multiply-adds (G = Hq / Hkv). Above 2^18 of them numpy's
# OpenBLAS hands the work to a second thread (measured here, each shape in a fresh process:
# 262,144 ran on one core, 524,288 on two), and that thread keeps spinning after the call.
# On a rank that is meant to use one core it would take a peer rank's core, so those calls
# stay on torch, whose thread count the rank sets.
MAX_MATMUL_WORK = 1 << 18
MAX_MERGE_ELEMENTS = 1 << 14  # B·Hq·D of o: 64 KiB in fp32
_FLOAT32_MIN = np.float32(np.finfo(np.float32).min)


def applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            kv_len: torch.Tensor | None) -> bool:
    """Whether this path serves a partial attention: fp32 CPU q, K and V, dense (no
    ``kv_len``), at least one token, K no larger than :data:`MAX_KV_ELEMENTS` and each
    head's matmul within :data:`MAX_MATMUL_WORK`."""
    return (k.device.type == "cpu" and kv_len is None and k.shape[2] > 0
            and q.dtype == k.dtype == v.dtype == torch.float32
            and 0 < k.numel() <= MAX_KV_ELEMENTS
            and q.shape[1] // k.shape[1] * k.shape[2] * k.shape[3] <= MAX_MATMUL_WORK)


def partial_attention_small(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The partial ``(o (B, Hq, D), lse (B, Hq))`` for inputs already checked and accepted
    by :func:`applies`; the G = Hq / Hkv query heads of a KV head share its K and V."""
    b, hq, d = q.shape
    hkv = k.shape[1]
    qg = q.detach().numpy().reshape(b, hkv, hq // hkv, d) * np.float32(scale)  # (B,Hkv,G,D)
    kn, vn = k.detach().numpy(), v.detach().numpy()  # (B, Hkv, T, D) each, strided views
    s = qg @ kn.swapaxes(-1, -2)  # (B, Hkv, G, T)
    m = s.max(axis=-1, keepdims=True)  # (B, Hkv, G, 1): finite, every row has a token
    p = np.exp(s - m, out=s)  # (B, Hkv, G, T)
    l_sum = p.sum(axis=-1, keepdims=True)  # (B, Hkv, G, 1) >= 1
    o = p @ vn  # (B, Hkv, G, D)
    o /= l_sum
    lse = np.log(l_sum) + m  # (B, Hkv, G, 1)
    return torch.from_numpy(o.reshape(b, hq, d)), torch.from_numpy(lse.reshape(b, hq))


def merge_applies(a: tuple[torch.Tensor, torch.Tensor],
                  b: tuple[torch.Tensor, torch.Tensor]) -> bool:
    """Whether this path serves a merge: fp32 CPU partials of at most
    :data:`MAX_MERGE_ELEMENTS` output elements."""
    oa = a[0]
    return (oa.device.type == "cpu" and oa.numel() <= MAX_MERGE_ELEMENTS
            and all(t.dtype == torch.float32 for t in (*a, *b)))


def _merge_into(oa, la, ob, lb, o: np.ndarray, lse: np.ndarray) -> None:
    """The merge formula on arrays, written into ``o`` (..., D) and ``lse`` (...): the
    exact path's, ``-inf``-safe (two identities give the identity)."""
    np.logaddexp(la, lb, out=lse)  # -inf only when both are identities
    # a finite stand-in for a -inf lse keeps both weights exp(-inf) = 0, so o = 0 there
    ref = np.maximum(lse, _FLOAT32_MIN)
    np.multiply(oa, np.exp(la - ref)[..., None], out=o)
    o += ob * np.exp(lb - ref)[..., None]


def merge_small(a: tuple[torch.Tensor, torch.Tensor],
                b: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The merge of two checked partials ``(o (B, Hq, D), lse (B, Hq))``."""
    oa, la = a[0].detach().numpy(), a[1].detach().numpy()
    ob, lb = b[0].detach().numpy(), b[1].detach().numpy()
    o, lse = np.empty_like(oa), np.empty_like(la)  # (B, Hq, D), (B, Hq)
    _merge_into(oa, la, ob, lb, o, lse)
    return torch.from_numpy(o), torch.from_numpy(lse)


def merge_packed_small(a: torch.Tensor, b: torch.Tensor, rows: int) -> torch.Tensor:
    """:func:`merge_small` of two packed partials (flat fp32: ``o`` of ``rows`` × D, then
    ``lse`` of ``rows``), written straight into one new packed tensor: no views, no
    concatenation, one allocation."""
    an, bn = a.detach().numpy(), b.detach().numpy()  # (rows·(D+1),) each
    n = an.size - rows  # elements of o
    out = np.empty_like(an)
    _merge_into(an[:n].reshape(rows, -1), an[n:], bn[:n].reshape(rows, -1), bn[n:],
                out[:n].reshape(rows, -1), out[n:])
    return torch.from_numpy(out)
