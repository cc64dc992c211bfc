"""Input checks shared by the torch reference and the Triton wrappers.

Every check raises :class:`~treeattn.kernels.errors.KernelError` with a one-line message that
names the argument and what was wrong with it. None of them syncs a CUDA device.
"""

from __future__ import annotations

import math

import torch

from treeattn.kernels.errors import KernelError

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64, torch.int16, torch.uint8, torch.int8)


def _shape(t: torch.Tensor) -> str:
    return "(" + ", ".join(str(s) for s in t.shape) + ")"


def _require_tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise KernelError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def check_partial_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None,
    kv_len: torch.Tensor | None,
) -> float:
    """Check the arguments of ``partial_attention`` and return the softmax scale to use.

    Parameters
    ----------
    q : torch.Tensor
        (B, Hq, D) query, one new token per sequence.
    k, v : torch.Tensor
        (B, Hkv, T, D) keys and values, ``Hq % Hkv == 0``.
    scale : float or None
        Score scale; ``None`` means ``1 / sqrt(D)``.
    kv_len : torch.Tensor or None
        (B,) integer valid lengths.

    Returns
    -------
    float
        The scale.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        _require_tensor(name, t)
        if t.dtype not in FLOAT_DTYPES:
            raise KernelError(f"{name} has dtype {t.dtype}; expected float32, float16 or bfloat16")
    if q.dim() != 3:
        raise KernelError(f"q must be (B, Hq, D), got shape {_shape(q)}")
    if k.dim() != 4 or v.dim() != 4:
        raise KernelError(f"k and v must be (B, Hkv, T, D), got {_shape(k)} and {_shape(v)}")
    if k.shape != v.shape:
        raise KernelError(f"k and v shapes differ: {_shape(k)} vs {_shape(v)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise KernelError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise KernelError(f"q, k, v are on different devices: {q.device}, {k.device}, {v.device}")
    b, hq, d = q.shape
    kb, hkv, _, kd = k.shape
    if kb != b or kd != d:
        raise KernelError(f"q {_shape(q)} and k {_shape(k)} disagree on batch B or head dim D")
    if d == 0 or hq == 0 or hkv == 0:
        raise KernelError(f"heads and head dim must be positive: q {_shape(q)}, k {_shape(k)}")
    if hq % hkv != 0:
        raise KernelError(f"Hq={hq} is not a multiple of Hkv={hkv} (GQA needs Hq % Hkv == 0)")
    if kv_len is not None:
        _require_tensor("kv_len", kv_len)
        if kv_len.shape != (b,) or kv_len.dtype not in INDEX_DTYPES:
            raise KernelError(
                f"kv_len must be an integer tensor of shape ({b},), "
                f"got {kv_len.dtype} {_shape(kv_len)}"
            )
        if kv_len.device != q.device:
            raise KernelError(f"kv_len is on {kv_len.device} but q is on {q.device}")
    if scale is None:
        return 1.0 / math.sqrt(d)
    scale = float(scale)
    if not math.isfinite(scale):
        raise KernelError(f"scale must be finite, got {scale}")
    return scale


def check_partials(o: torch.Tensor, lse: torch.Tensor, stacked: bool) -> None:
    """Check one partial ``(o, lse)``: (B, Hq, D) and (B, Hq), or stacked with a leading n."""
    _require_tensor("o", o)
    _require_tensor("lse", lse)
    lead = "(n, B, Hq, D)" if stacked else "(B, Hq, D)"
    want = 4 if stacked else 3
    if o.dim() != want or lse.dim() != want - 1 or o.shape[:-1] != lse.shape:
        raise KernelError(
            f"partial must be o {lead} with lse of the same shape minus D, "
            f"got o {_shape(o)} and lse {_shape(lse)}"
        )
    for name, t in (("o", o), ("lse", lse)):
        if t.dtype not in FLOAT_DTYPES:
            raise KernelError(f"partial {name} has dtype {t.dtype}; expected a float dtype")
    if o.device != lse.device:
        raise KernelError(f"partial o is on {o.device} but lse is on {lse.device}")


def check_pair(a: tuple, b: tuple) -> None:
    """Check two partials for the pairwise ``merge``: same shapes, same device."""
    for name, p in (("a", a), ("b", b)):
        if not isinstance(p, (tuple, list)) or len(p) != 2:
            raise KernelError(f"merge argument {name} must be a partial (o, lse)")
        check_partials(p[0], p[1], stacked=False)
    if a[0].shape != b[0].shape:
        raise KernelError(f"cannot merge partials of shapes {_shape(a[0])} and {_shape(b[0])}")
    if a[0].device != b[0].device:
        raise KernelError(f"cannot merge partials on {a[0].device} and {b[0].device}")


def check_packed_pair(a: torch.Tensor, b: torch.Tensor, rows: int) -> None:
    """Check two packed partials for ``merge_packed``: flat fp32 tensors of the same size on
    the same device, ``rows``·(D + 1) elements with D >= 1."""
    _require_tensor("a", a)
    _require_tensor("b", b)
    n = a.numel()
    if (a.dim() != 1 or a.shape != b.shape or a.dtype != torch.float32 or b.dtype != a.dtype
            or rows < 1 or n < 2 * rows or (n - rows) % rows):
        raise KernelError(f"packed partials must be two flat fp32 tensors of rows·(D + 1) "
                          f"elements for {rows} rows; got {_shape(a)} {a.dtype} and "
                          f"{_shape(b)} {b.dtype}")
    if a.device != b.device:
        raise KernelError(f"cannot merge partials on {a.device} and {b.device}")
