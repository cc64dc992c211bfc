"""Helpers for testing kernels: seeded inputs, tolerances per backend and dtype, merge trees.

They live in the package (like ``torch.testing``) so that the tests of other packages, such as
the runtime's distributed tests, can build the same inputs and use the same tolerances.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import torch

from treeattn import kernels

Partial = tuple[torch.Tensor, torch.Tensor]

# Tolerance of o against the float64 oracle, for inputs already in the given dtype (so input
# rounding is not counted). The torch reference upcasts K and V exactly and does everything in
# fp32: only fp32 accumulation error remains, ~1e-7 relative over the test lengths. The
# Triton kernel rounds the softmax probabilities to the input dtype before the P·V dot (as
# FlashAttention does): bf16 keeps 8 significant bits (relative error 2^-9 ≈ 2e-3 per weight,
# a few times that in the worst element), fp16 keeps 11 bits (2^-12 ≈ 2.4e-4). torch's fused
# CPU kernel ("fused") rounds the same way and also returns o in the input dtype, one more
# rounding of the same size; in fp32 it rounds nothing and only sums in another order.
O_TOLERANCE = {
    ("torch", torch.float32): dict(atol=1e-5, rtol=1e-5),
    ("torch", torch.float16): dict(atol=1e-5, rtol=1e-5),
    ("torch", torch.bfloat16): dict(atol=1e-5, rtol=1e-5),
    ("triton", torch.float32): dict(atol=1e-5, rtol=1e-5),
    ("triton", torch.float16): dict(atol=2e-3, rtol=2e-3),
    ("triton", torch.bfloat16): dict(atol=1.5e-2, rtol=1.5e-2),
    ("fused", torch.float32): dict(atol=1e-5, rtol=1e-5),
    ("fused", torch.float16): dict(atol=2e-3, rtol=2e-3),
    ("fused", torch.bfloat16): dict(atol=1.5e-2, rtol=1.5e-2),
    # treeattn's C kernel widens 16-bit K/V exactly and does everything in fp32, like the
    # exact path: only the order of its sums differs.
    ("native", torch.float32): dict(atol=1e-5, rtol=1e-5),
    ("native", torch.bfloat16): dict(atol=1e-5, rtol=1e-5),
}
# lse depends only on the fp32 scores, which are exact products of the inputs summed in fp32,
# whatever the backend: a relative 1e-6 of |lse| plus fp32 summation error.
LSE_TOLERANCE = dict(atol=2e-5, rtol=1e-6)
# The one exception: torch's fused CPU kernel given 16-bit K/V computes its log-sum-exp less
# exactly, up to 4.7e-5 absolute and 1.3e-5 relative against the float64 oracle as measured
# (fp16 and bf16, T from 1 to 1300, D from 16 to 128, 40 seeds each); about twice that.
FUSED_HALF_LSE_TOLERANCE = dict(atol=1e-4, rtol=3e-5)


def make_qkv(
    b: int,
    hq: int,
    hkv: int,
    t: int,
    d: int,
    dtype: torch.dtype,
    seed: int = 0,
    device: str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Seeded standard-normal ``q`` (B, Hq, D) and ``k``, ``v`` (B, Hkv, T, D) in ``dtype``."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, d, generator=gen)  # (B, Hq, D)
    k = torch.randn(b, hkv, t, d, generator=gen)  # (B, Hkv, T, D)
    v = torch.randn(b, hkv, t, d, generator=gen)  # (B, Hkv, T, D)
    return tuple(x.to(dtype=dtype, device=device) for x in (q, k, v))


def cut_points(t: int, n_chunks: int, rng: random.Random) -> list[int]:
    """``n_chunks + 1`` sorted boundaries from 0 to t; equal neighbours make empty chunks."""
    inner = sorted(rng.randint(0, t) for _ in range(n_chunks - 1))
    return [0, *inner, t]


def merge_random_tree(
    partials: Sequence[Partial],
    rng: random.Random,
    merge: Callable[[Partial, Partial], Partial],
    merge_many: Callable[[torch.Tensor, torch.Tensor], Partial] | None = None,
) -> Partial:
    """Reduce ``partials`` in a random order and tree shape.

    Each step picks two (or, with ``merge_many``, sometimes several) random members of the
    pool, merges them, and puts the result back, until one partial is left.
    """
    pool = list(partials)
    rng.shuffle(pool)
    while len(pool) > 1:
        take = 2
        if merge_many is not None and len(pool) > 2 and rng.random() < 0.3:
            take = rng.randint(2, len(pool))
        picked = [pool.pop(rng.randrange(len(pool))) for _ in range(take)]
        if take == 2 and (merge_many is None or rng.random() < 0.7):
            pool.append(merge(picked[0], picked[1]))
        else:
            o = torch.stack([p[0] for p in picked])  # (n, B, Hq, D)
            lse = torch.stack([p[1] for p in picked])  # (n, B, Hq)
            pool.append(merge_many(o, lse))
    return pool[0]


def split_and_merge(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_chunks: int,
                    rng: random.Random) -> Partial:
    """Sequence parallelism in one process: cut K and V (B, Hkv, T, D) into ``n_chunks``
    random shards (some may be empty), take each shard's partial with the dispatched
    :func:`treeattn.kernels.partial_attention`, and merge them in a random tree."""
    cuts = cut_points(k.shape[2], n_chunks, rng)
    parts = [kernels.partial_attention(q, k[:, :, a:b], v[:, :, a:b])
             for a, b in zip(cuts, cuts[1:])]
    return merge_random_tree(parts, rng, kernels.merge, kernels.merge_stacked)
