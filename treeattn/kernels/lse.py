"""The log-sum-exp convention of every public partial: natural log, never guessed.

A partial is ``(o, lse)`` with ``o`` the softmax-weighted values of a KV shard and ``lse`` the
log-sum-exp of its scaled scores, ``log(sum_j exp(s_j))``, in the **natural** log. Some
kernels (FlashInfer's decode and merge kernels, and kernels written in ``exp2`` for speed)
return ``log2(sum_j 2^(s_j log2 e))`` instead, which is the natural LSE times ``log2 e``.
Merging partials whose bases differ gives silently wrong weights, and context-parallel
decoding has shipped that bug; so a base-2 LSE is accepted only where the caller says so
(``lse_base="2"``), and every LSE treeattn returns is natural.

>>> import torch
>>> o, lse = torch.zeros(2, 1, 1, 4), torch.tensor([[[0.0]], [[1.0]]])
>>> merged = merge_partials(o, lse, lse_base="e")[1]
>>> merged2 = merge_partials(o, lse * LOG2_E, lse_base="2")[1]
>>> torch.allclose(merged, merged2), round(float(merged), 4)
(True, 1.3133)
"""

from __future__ import annotations

import math

import torch

from treeattn.kernels.errors import KernelError

LSE_BASES = ("e", "2")
LOG2_E = 1.0 / math.log(2.0)  # log2(x) = ln(x) * LOG2_E


def natural_lse(lse: torch.Tensor, lse_base: str) -> torch.Tensor:
    """``lse`` in the natural log; ``lse_base`` is ``"e"`` (returned as is) or ``"2"``."""
    base = str(lse_base)
    if base not in LSE_BASES:
        raise KernelError(f"lse_base must be 'e' (natural log) or '2' (FlashInfer-style "
                          f"log2), got {lse_base!r}")
    return lse if base == "e" else lse / LOG2_E


def merge_partials(o: torch.Tensor, lse: torch.Tensor, *, lse_base: str
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge ``n`` stacked partials, ``o`` (n, B, Hq, D) and ``lse`` (n, B, Hq), into one:
    ``o`` (B, Hq, D) fp32 and its natural-log ``lse`` (B, Hq) fp32.

    ``lse_base`` has no default: ``"e"`` for a natural-log ``lse``, ``"2"`` for a base-2 one
    (FlashInfer's convention); the result is natural either way. An empty partial is
    ``(0, -inf)`` and weighs nothing. Non-finite values follow IEEE arithmetic, row by row
    (a row is one ``(b, h)``): a NaN in any partial's ``lse`` makes the row's ``o`` and ``lse``
    NaN; a ``+inf`` ``lse`` (an overflowed sum) makes the row's ``lse`` ``+inf`` and its
    ``o`` NaN, since the weights ``inf / inf`` are undefined. Nothing non-finite is dropped.
    Raises :class:`~treeattn.kernels.errors.KernelError` for anything but two float tensors
    of those shapes on one device.
    """
    from treeattn.kernels import merge_stacked
    from treeattn.kernels.checks import check_partials

    check_partials(o, lse, stacked=True)
    lse = natural_lse(lse, lse_base).float()  # (n, B, Hq)
    merged_o, merged_lse = merge_stacked(o, lse)  # (B, Hq, D), (B, Hq)
    nan = torch.isnan(lse).any(0)  # (B, Hq)
    overflow = torch.isposinf(lse).any(0) & ~nan  # (B, Hq)
    merged_lse = torch.where(nan, float("nan"), merged_lse)
    merged_lse = torch.where(overflow, float("inf"), merged_lse)
    merged_o = torch.where((nan | overflow)[..., None], float("nan"), merged_o)
    return merged_o, merged_lse
