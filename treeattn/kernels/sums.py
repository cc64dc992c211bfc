"""The all-reduce form of the merge: partials as sums over a shared maximum.

The log-sum-exp merge of ``p`` partials can also be computed with element-wise reductions,
which is how the Tree Attention paper runs it (three all-reduces) and how ``allreduce2``
and vLLM's decode context parallelism do:

1. ``m = max_r lse_r`` (an all-reduce with MAX);
2. each rank rescales its partial to that common max, :func:`rescale_to_max`:
   ``den_r = exp(lse_r − m)`` and ``num_r = o_r · den_r``;
3. the sums ``num = Σ num_r``, ``den = Σ den_r`` (all-reduce or reduce-scatter with SUM);
4. :func:`finalize_sums`: ``o = num / den`` and ``lse = m + log(den)``.

An empty shard (``lse = −inf``) contributes ``den = 0`` and ``num = 0``; if every shard is
empty, ``den = 0`` and the result is the merge identity ``(0, −inf)``. Both the runtime's
executors use these functions, so the arithmetic is written once.

>>> import torch
>>> from treeattn.kernels import merge
>>> a = (torch.randn(1, 2, 4), torch.randn(1, 2))
>>> b = (torch.randn(1, 2, 4), torch.randn(1, 2))
>>> m = torch.maximum(a[1], b[1])
>>> (na, da), (nb, db) = rescale_to_max(*a, m), rescale_to_max(*b, m)
>>> o, lse = finalize_sums(na + nb, da + db, m)
>>> torch.allclose(o, merge(a, b)[0], atol=1e-6) and torch.allclose(lse, merge(a, b)[1])
True
"""

from __future__ import annotations

import torch


def rescale_to_max(o: torch.Tensor, lse: torch.Tensor,
                   m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(num, den)`` of one partial, ``o`` (B, Hq, D) and ``lse`` (B, Hq), at the max ``m``
    (B, Hq) (or at the global log-sum-exp, where ``den`` is the partial's final weight)."""
    den = torch.where(torch.isneginf(lse), torch.zeros_like(lse), torch.exp(lse - m))  # (B, Hq)
    return o * den[..., None], den  # (B, Hq, D), (B, Hq)


def finalize_sums(num: torch.Tensor, den: torch.Tensor,
                  m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The merged partial from the summed ``num`` (B, Hq, D), ``den`` (B, Hq) and max ``m``."""
    empty = den <= 0  # every shard empty for this (sequence, head)
    safe = torch.where(empty, torch.ones_like(den), den)
    o = torch.where(empty[..., None], torch.zeros_like(num), num / safe[..., None])
    lse = torch.where(empty, torch.full_like(den, float("-inf")), m + torch.log(safe))
    return o, lse
