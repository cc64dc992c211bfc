"""Local compute of Tree Attention: the partial attention of a KV shard, and the merge.

A *partial* is ``(o, lse)``: ``o`` (B, Hq, D) fp32 and ``lse`` (B, Hq) fp32. Triton kernels
run on CUDA tensors. On CPU tensors, small fp32 calls (short shards, the merge of a decode
step's partials) go through numpy (:mod:`treeattn.testbed.kernels.cpu_small`), where torch's
per-operator dispatch would be most of the cost; larger dense fp32 or bf16 KV on one thread
through treeattn's C kernel (:mod:`treeattn.testbed.kernels.cpu_native`); other dense KV (16-bit,
or fp32 with grouped-query heads) through torch's fused FlashAttention kernel
(:mod:`treeattn.testbed.kernels.cpu_fused`); everything else through the exact torch path
(:mod:`treeattn.kernels.reference`);
``TREEATTN_KERNEL=triton|native|fused|torch`` forces one (see
:mod:`treeattn.kernels.dispatch`).
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
from treeattn.kernels.dispatch import (
    CPU_BACKENDS,
    choose_backend,
    requested_backend,
    triton_module,
)
from treeattn.kernels.errors import KernelError
from treeattn.kernels.sums import finalize_sums, rescale_to_max
from treeattn.testbed.kernels import cpu_fused, cpu_native, cpu_small

__all__ = ["KernelError", "finalize_sums", "merge", "merge_packed", "merge_partials",
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
    fp32 ``o`` (its B·Hq rows of D) then ``lse`` (B·Hq). The C kernel writes this form
    directly; the other paths concatenate their result."""
    scale = check_partial_inputs(q, k, v, scale, None)
    path = partial_attention_path(q, k, v, None)
    if path == "native":
        return cpu_native.partial_attention_native_packed(cpu_native.kernel(), q, k, v, scale)
    return _packed(*_run_path(path, q, k, v, scale, None))


def _run_path(path: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
              kv_len: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    if path == "triton":
        return triton_module("triton_partial").partial_attention_checked(q, k, v, scale, kv_len)
    if path == "small":
        return cpu_small.partial_attention_small(q, k, v, scale)
    if path == "native":
        return cpu_native.partial_attention_native(cpu_native.kernel(), q, k, v, scale)
    if path == "fused":
        return cpu_fused.partial_attention_fused(q, k, v, scale)
    return reference.partial_attention_checked(q, k, v, scale, kv_len)


def partial_attention_path(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           kv_len: torch.Tensor | None = None) -> str:
    """Which implementation :func:`partial_attention` runs for these (checked) inputs:
    ``"triton"``, ``"small"`` (numpy), ``"native"`` (the C kernel), ``"fused"`` (torch's
    fused kernel) or ``"exact"`` (the torch reference). Benchmarks report it."""
    backend = choose_backend(q.device)
    if backend == "triton":
        return "triton"
    # The C kernel first, even for tiny shards: it beats numpy there 2-3x
    # (benchmarks/results/kernel_paths.md); numpy serves the chain without it.
    if backend == "native" and cpu_native.applies(q, k, v, kv_len):
        kern = _native_kernel()
        if kern is not None and cpu_native.fits(kern, q.shape[-1]):
            return "native"
    if backend in CPU_BACKENDS and cpu_small.applies(q, k, v, kv_len):
        return "small"
    if backend in CPU_BACKENDS and cpu_fused.applies(q, k, kv_len):
        return "fused"
    return "exact"


def _native_kernel() -> cpu_native.NativeKernel | None:
    """The C kernel; None where it cannot be built, which is an error only when
    ``TREEATTN_KERNEL=native`` asked for it by name."""
    kern = cpu_native.kernel()
    if kern is None and requested_backend() == "native":
        raise KernelError(f"TREEATTN_KERNEL=native, but {cpu_native.unavailable_reason()}")
    return kern


def merge_partials(o: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge n stacked partials, (n, B, Hq, D) and (n, B, Hq), into one (B, Hq, D), (B, Hq)."""
    check_partials(o, lse, stacked=True)
    if choose_backend(o.device) == "triton":
        return triton_module("triton_merge").merge_partials(o, lse)
    return reference.merge_partials(o, lse)


def merge(
    a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partials ``(o, lse)``; associative, commutative, identity ``(0, -inf)``."""
    check_pair(a, b)
    backend = choose_backend(a[0].device)
    if backend == "triton":
        return triton_module("triton_merge").merge(a, b)
    if backend == "native" and cpu_native.merge_applies(*a, *b):
        kern = _native_kernel()
        if kern is not None:
            return cpu_native.merge_native(kern, a, b)
    if backend in CPU_BACKENDS and cpu_small.merge_applies(a, b):
        return cpu_small.merge_small(a, b)
    return reference.merge(a, b)


def merge_packed(a: torch.Tensor, b: torch.Tensor, rows: int) -> torch.Tensor:
    """:func:`merge` of two partials packed flat as the runtime sends them: fp32, ``o`` (its
    ``rows`` = B·Hq rows of D) then ``lse`` (``rows``). Returns a new packed tensor.

    Why a packed form: a decode step merges small received partials, where unpacking into
    views, merging and concatenating back cost more than the arithmetic.
    """
    check_packed_pair(a, b, rows)
    n = a.numel() - rows  # elements of o
    backend = choose_backend(a.device)
    if backend == "native" and cpu_native.merge_applies(a, b):
        kern = _native_kernel()
        if kern is not None:
            return cpu_native.merge_packed_native(kern, a, b, rows)
    if backend in CPU_BACKENDS and n <= cpu_small.MAX_MERGE_ELEMENTS:
        return cpu_small.merge_packed_small(a, b, rows)
    d = n // rows
    return _packed(*merge((a[:n].view(1, rows, d), a[n:].view(1, rows)),
                          (b[:n].view(1, rows, d), b[n:].view(1, rows))))


def _packed(o: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """``o`` (B, Hq, D) then ``lse`` (B, Hq), flat: the runtime's packed partial."""
    return torch.cat([o.reshape(-1), lse.reshape(-1)])
