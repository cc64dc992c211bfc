"""Local compute of Tree Attention: the partial attention of a KV shard, and the merge.

A *partial* is ``(o, lse)``: ``o`` (B, Hq, D) fp32 and ``lse`` (B, Hq) fp32. Triton kernels
run on CUDA tensors. On CPU tensors a plugged-in chain of faster CPU paths takes the calls it
can (:class:`~treeattn.kernels.dispatch.CpuKernels`; the CPU test bed's numpy, C and
fused-torch paths), and everything else goes through the exact torch path
(:mod:`treeattn.kernels.reference`); ``TREEATTN_KERNEL=triton|native|fused|torch`` forces one
(see :mod:`treeattn.kernels.dispatch`).
Kernels know nothing of topology.

>>> import torch
>>> from treeattn.kernels import partial_attention, merge
>>> q, k = torch.randn(1, 4, 8), torch.randn(1, 2, 6, 8)
>>> full = partial_attention(q, k, k)
>>> left = partial_attention(q, k[:, :, :2], k[:, :, :2])
>>> right = partial_attention(q, k[:, :, 2:], k[:, :, 2:])
>>> torch.allclose(merge(left, right)[0], full[0], atol=1e-6)
True
"""

from __future__ import annotations

import torch

from treeattn.kernels import reference
from treeattn.kernels.checks import (
    check_packed_pair,
    check_pair,
    check_partial_inputs,
    check_partials,
)
from treeattn.kernels.dispatch import choose_backend, cpu_kernels, triton_module
from treeattn.kernels.errors import KernelError
from treeattn.kernels.sums import finalize_sums, rescale_to_max

__all__ = ["KernelError", "finalize_sums", "merge", "merge_packed", "merge_stacked",
           "partial_attention", "partial_attention_packed", "partial_attention_path",
           "reference", "rescale_to_max"]


def partial_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None = None,
    kv_len: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Partial attention of one query token per sequence over a KV shard.

    ``q`` (B, Hq, D); ``k``, ``v`` (B, Hkv, T, D) with ``Hq % Hkv == 0``; ``kv_len`` (B,)
    optional valid lengths (clamped to ``[0, T]``). Returns ``o`` (B, Hq, D) and ``lse``
    (B, Hq) in fp32; an empty shard gives the identity ``(0, -inf)``. See
    :func:`treeattn.kernels.reference.partial_attention` for the exact semantics.
    """
    scale = check_partial_inputs(q, k, v, scale, kv_len)
    return _run_path(partial_attention_path(q, k, v, kv_len), q, k, v, scale, kv_len)


def partial_attention_packed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                             scale: float | None = None) -> torch.Tensor:
    """:func:`partial_attention` of a dense shard, packed flat as the runtime sends it:
    fp32 ``o`` (its B·Hq rows of D) then ``lse`` (B·Hq). A CPU path may write this form
    directly; the others concatenate their result."""
    scale = check_partial_inputs(q, k, v, scale, None)
    path = partial_attention_path(q, k, v, None)
    if path not in ("triton", "exact"):
        packed = cpu_kernels(choose_backend(q.device)).attention_packed(path, q, k, v, scale)
        if packed is not None:
            return packed
    return _packed(*_run_path(path, q, k, v, scale, None))


def _run_path(path: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
              kv_len: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    if path == "triton":
        return triton_module("triton_partial").partial_attention_checked(q, k, v, scale, kv_len)
    if path == "exact":
        return reference.partial_attention_checked(q, k, v, scale, kv_len)
    return cpu_kernels(choose_backend(q.device)).attention(path, q, k, v, scale)


def partial_attention_path(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           kv_len: torch.Tensor | None = None) -> str:
    """Which implementation :func:`partial_attention` runs for these (checked) inputs:
    ``"triton"``, a plugged-in CPU chain's path (the test bed's ``"small"``: numpy,
    ``"native"``: its C kernel, ``"fused"``: torch's fused kernel) or ``"exact"`` (the torch
    reference). Benchmarks report it."""
    backend = choose_backend(q.device)
    if backend == "triton":
        return "triton"
    chain = cpu_kernels(backend)
    path = chain.attention_path(backend, q, k, v, kv_len) if chain is not None else None
    return path or "exact"


def merge_stacked(o: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge n stacked partials, (n, B, Hq, D) and (n, B, Hq), into one (B, Hq, D), (B, Hq)."""
    check_partials(o, lse, stacked=True)
    if choose_backend(o.device) == "triton":
        return triton_module("triton_merge").merge_stacked(o, lse)
    return reference.merge_stacked(o, lse)


def merge(
    a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partials ``(o, lse)``; associative, commutative, identity ``(0, -inf)``."""
    check_pair(a, b)
    backend = choose_backend(a[0].device)
    if backend == "triton":
        return triton_module("triton_merge").merge(a, b)
    chain = cpu_kernels(backend)
    merged = chain.merge(backend, a, b) if chain is not None else None
    return merged if merged is not None else reference.merge(a, b)


def merge_packed(a: torch.Tensor, b: torch.Tensor, rows: int) -> torch.Tensor:
    """:func:`merge` of two partials packed flat as the runtime sends them: fp32, ``o`` (its
    ``rows`` = B·Hq rows of D) then ``lse`` (``rows``). Returns a new packed tensor.

    Why a packed form: a decode step merges small received partials, where unpacking into
    views, merging and concatenating back cost more than the arithmetic.
    """
    check_packed_pair(a, b, rows)
    n = a.numel() - rows  # elements of o
    backend = choose_backend(a.device)
    chain = cpu_kernels(backend)
    merged = chain.merge_packed(backend, a, b, rows) if chain is not None else None
    if merged is not None:
        return merged
    d = n // rows
    return _packed(*merge((a[:n].view(1, rows, d), a[n:].view(1, rows)),
                          (b[:n].view(1, rows, d), b[n:].view(1, rows))))


def _packed(o: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """``o`` (B, Hq, D) then ``lse`` (B, Hq), flat: the runtime's packed partial."""
    return torch.cat([o.reshape(-1), lse.reshape(-1)])
