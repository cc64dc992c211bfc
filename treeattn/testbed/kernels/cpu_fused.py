"""Partial attention on a CPU through torch's fused FlashAttention kernel.

Why a second CPU path: the exact torch path (:mod:`treeattn.kernels.reference`) upcasts
16-bit K and V to fp32 block by block before its matmuls, because torch has no CPU matmul of
bf16 inputs with an fp32 result. The upcast copy alone runs at about half the read
bandwidth of ``sum()``, so that path cannot pass 30% of it in bf16
(``benchmarks/results/kernels-cpu-1thread.md``). In fp32 the exact path reads K and V in
place, but for grouped-query heads its ``q·Kᵀ`` is a matmul of only G = Hq / Hkv rows, which
MKL runs far below the memory's bandwidth (51–57% of ``sum()`` at Hq/Hkv = 32/8, D = 128,
128k tokens, against 71–72% for this kernel). torch itself ships a fused CPU kernel,
``aten._scaled_dot_product_flash_attention_for_cpu``, that reads K and V in place, tiles
the scores so they never leave the cache, and returns the log-sum-exp next to the output:
exactly a partial. No new dependency.

Numerics are FlashAttention's, the same as the Triton kernel's on a GPU: the scores, their
maximum, the exponentials and the log-sum-exp are fp32 (``lse`` matches the exact path to
~1e-5); the softmax probabilities are rounded to the input dtype for the P·V product, and
the output comes back in the input dtype. So a 16-bit ``o`` is held to the Triton 16-bit
tolerances (``treeattn.kernels.testing.O_TOLERANCE``, key ``"fused"``), not the exact
path's 1e-5; an fp32 one only differs from the exact path by the order of its sums.

Under ``auto`` it serves the dense calls that treeattn's C kernel does not take
(:mod:`treeattn.testbed.kernels.cpu_native`: several torch threads, more than 8 query heads per KV
head, or no C compiler). It applies to CPU tensors with no ``kv_len`` (a decode shard is
dense; ragged batches take the exact path) and at least one token, in bf16 always and in
fp32 for grouped-query heads (G > 1). Not in fp16: there torch's kernel is slower than the
exact path. With one query row per KV head the exact path's
``q·Kᵀ`` is a matrix-vector product, which MKL already runs at the memory's bandwidth: there
the fused kernel measured 0.90–1.05x the exact path's speed, against 0.94–1.15x for G = 3
and 1.08–1.72x for G = 4.
``TREEATTN_KERNEL=torch`` forces the exact path everywhere (it is the oracle of every other
kernel).
"""

from __future__ import annotations

import torch

# bf16 only: torch's CPU kernel in fp16 ran at 0.46x the exact path's speed (SmolLM2 shapes,
# 16k tokens, benchmarks/results/kernel_paths.md), so fp16 takes the exact path.
HALF_DTYPES = (torch.bfloat16,)


def applies(q: torch.Tensor, k: torch.Tensor, kv_len: torch.Tensor | None) -> bool:
    """Whether the fused kernel serves this call: CPU, dense, non-empty, and bf16 K/V or
    fp32 K/V with several query heads per KV head."""
    if k.device.type != "cpu" or kv_len is not None or k.shape[2] == 0 or k.shape[0] == 0:
        return False
    return k.dtype in HALF_DTYPES or (k.dtype == torch.float32 and q.shape[1] > k.shape[1])


def partial_attention_fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The partial ``(o (B, Hq, D), lse (B, Hq))`` in fp32 for inputs already checked and
    accepted by :func:`applies`.

    The ``G = Hq / Hkv`` query heads of a KV head are passed as that head's G query rows, so
    K and V are read once per KV head, never repeated per query head.
    """
    b, hq, d = q.shape
    hkv = k.shape[1]
    qg = q.reshape(b, hkv, hq // hkv, d).to(k.dtype)  # (B, Hkv, G, D)
    # The kernel walks q, K and V by their strides but needs unit stride along D (without it
    # the result is silently wrong, not an error).
    qg = qg if qg.stride(-1) == 1 else qg.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()  # (B, Hkv, T, D)
    v = v if v.stride(-1) == 1 else v.contiguous()  # (B, Hkv, T, D)
    out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        qg, k, v, 0.0, False, scale=scale)
    o, lse = out[0], out[1]  # (B, Hkv, G, D) in K's dtype, (B, Hkv, G) fp32
    return o.reshape(b, hq, d).to(torch.float32), lse.reshape(b, hq).to(torch.float32)
