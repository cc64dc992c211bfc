"""The CPU kernel chain, plugged into :mod:`treeattn.kernels` (:class:`CpuChain`, a
:class:`~treeattn.kernels.dispatch.CpuKernels`).

For each CPU call the fastest path that applies: treeattn's C kernel first, even for tiny
shards (it beats numpy there 2-3x, ``benchmarks/results/kernel_paths.md``), numpy for small
fp32 calls (where torch's per-operator dispatch would be most of the cost), torch's fused
FlashAttention kernel for other dense KV; None sends the call on to the exact torch path.
``TREEATTN_KERNEL=fused`` is the chain without the C kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from treeattn.kernels.dispatch import requested_backend
from treeattn.kernels.errors import KernelError
from treeattn.testbed.kernels import cpu_fused, cpu_native, cpu_small

Partial = tuple[torch.Tensor, torch.Tensor]


def _native_kernel() -> cpu_native.NativeKernel | None:
    """The C kernel; None where it cannot be built, which is an error only when
    ``TREEATTN_KERNEL=native`` asked for it by name."""
    kern = cpu_native.kernel()
    if kern is None and requested_backend() == "native":
        raise KernelError(f"TREEATTN_KERNEL=native, but {cpu_native.unavailable_reason()}")
    return kern


@dataclass(frozen=True)
class CpuChain:
    """small (numpy), [native (C),] fused (torch's fused kernel), then the exact path."""

    def attention_path(self, backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       kv_len: torch.Tensor | None) -> str | None:
        if backend == "native" and cpu_native.applies(q, k, v, kv_len):
            kern = _native_kernel()
            if kern is not None and cpu_native.fits(kern, q.shape[-1]):
                return "native"
        if cpu_small.applies(q, k, v, kv_len):
            return "small"
        if cpu_fused.applies(q, k, kv_len):
            return "fused"
        return None

    def attention(self, path: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  scale: float) -> Partial:
        if path == "small":
            return cpu_small.partial_attention_small(q, k, v, scale)
        if path == "native":
            return cpu_native.partial_attention_native(cpu_native.kernel(), q, k, v, scale)
        return cpu_fused.partial_attention_fused(q, k, v, scale)

    def attention_packed(self, path: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         scale: float) -> torch.Tensor | None:
        if path == "native":  # the C kernel writes the packed form directly
            return cpu_native.partial_attention_native_packed(cpu_native.kernel(), q, k, v,
                                                              scale)
        return None

    def merge(self, backend: str, a: Partial, b: Partial) -> Partial | None:
        if backend == "native" and cpu_native.merge_applies(*a, *b):
            kern = _native_kernel()
            if kern is not None:
                return cpu_native.merge_native(kern, a, b)
        if cpu_small.merge_applies(a, b):
            return cpu_small.merge_small(a, b)
        return None

    def merge_packed(self, backend: str, a: torch.Tensor, b: torch.Tensor,
                     rows: int) -> torch.Tensor | None:
        if backend == "native" and cpu_native.merge_applies(a, b):
            kern = _native_kernel()
            if kern is not None:
                return cpu_native.merge_packed_native(kern, a, b, rows)
        if a.numel() - rows <= cpu_small.MAX_MERGE_ELEMENTS:
            return cpu_small.merge_packed_small(a, b, rows)
        return None
