"""The element types NCCL runs a collective on: its names for them, and the reductions it
has for each (:func:`check_dtype`). NVLS's narrower set is in
:func:`treeattn.sim.nccl.collectives.nvls_refusal`."""

from __future__ import annotations

from treeattn.schedule.payloads import SimError
from treeattn.sim.nccl import tables as T
from treeattn.sim.nccl.group_shape import GroupShape

REDUCING_OPS = ("all_reduce", "reduce_scatter")


def normalize_dtype(dtype: str) -> str:
    """NCCL's name for ``dtype`` (``bf16`` -> ``bfloat16``); SimError if NCCL has none."""
    key = str(dtype).strip().lower()
    key = T.NCCL_DTYPE_ALIASES.get(key, key)
    if key not in T.NCCL_DTYPES:
        raise SimError(f"NCCL has no dtype {dtype!r} (known: {', '.join(T.NCCL_DTYPES)})")
    return key


def check_dtype(op: str, dtype: str, shape: GroupShape | None = None,
                reduction: str = "sum") -> str:
    """``dtype`` normalised, or SimError where NCCL cannot run ``op`` on it: a reduction NCCL
    does not have, or an fp8 reduction below Hopper (enqueue.cc: "FP8 reduction support
    begins with sm90 capable devices")."""
    dtype = normalize_dtype(dtype)
    if op in REDUCING_OPS:
        if reduction not in T.NCCL_REDUCTIONS:
            raise SimError(f"NCCL has no {reduction!r} reduction (known: "
                           f"{', '.join(T.NCCL_REDUCTIONS)})")
        if (dtype.startswith("float8") and shape is not None and shape.family == "nvidia"
                and shape.arch not in ("hopper", "blackwell")):
            raise SimError(f"NCCL reduces {dtype} only on Hopper or newer GPUs, not "
                           f"{shape.arch}")
    return dtype
