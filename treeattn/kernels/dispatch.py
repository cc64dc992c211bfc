"""Pick the backend for each call: Triton on CUDA tensors, treeattn's CPU paths on CPU tensors.

On CPU tensors ``auto`` means ``native``: the fastest CPU path for each call. That is numpy
for small fp32 attention and merges (:func:`treeattn.testbed.kernels.cpu_small.applies`), treeattn's
own C kernel for the partial attention of dense fp32 or bf16 KV on one thread
(:mod:`treeattn.testbed.kernels.cpu_native`), torch's fused FlashAttention kernel for other dense KV
where it is faster (:func:`treeattn.testbed.kernels.cpu_fused.applies`), and the exact torch path
for everything else (ragged ``kv_len`` batches, empty shards, large fp32 with one query head
per KV head, large merges). Where the C kernel cannot be built (no compiler), ``auto`` goes
on to the next path and ``native`` asked for by name is an error that says why.
``TREEATTN_KERNEL=triton|native|fused|torch`` forces one backend (``auto`` or unset: by
device); ``fused`` is the CPU chain without the C kernel, ``torch`` is the exact path
everywhere, the oracle of the others. Triton on CPU tensors only
runs in Triton's interpreter (``TRITON_INTERPRET=1``). Triton fixes that choice for each
``@triton.jit`` function when it is defined, including its own library functions
(``tl.zeros``, ``tl.sum``) defined when ``triton`` is first imported, so the variable must be
set before Python imports Triton. The Triton modules are imported lazily, and a setting that
changed after Triton's import is reported as a KernelError instead of failing deep inside
the interpreter.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import torch

from treeattn.kernels.errors import KernelError

ENV_BACKEND = "TREEATTN_KERNEL"
BACKENDS = ("auto", "triton", "native", "fused", "torch")
CPU_BACKENDS = ("native", "fused")  # the CPU chains: small, [native,] fused, exact


def interpreter_enabled() -> bool:
    """Whether ``TRITON_INTERPRET`` is on, read the way Triton reads it."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def requested_backend() -> str:
    """The backend asked for by ``TREEATTN_KERNEL`` (``auto`` when unset)."""
    name = os.environ.get(ENV_BACKEND, "auto").strip().lower() or "auto"
    if name not in BACKENDS:
        raise KernelError(f"{ENV_BACKEND}={name!r} is not one of {', '.join(BACKENDS)}")
    return name


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def triton_is_interpreted() -> bool:
    """Whether the imported Triton was imported in interpreter mode (imports it if needed)."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.zeros, InterpretedFunction)


def choose_backend(device: torch.device) -> str:
    """Return ``"triton"``, ``"native"``, ``"fused"`` or ``"torch"`` for tensors on
    ``device``, or raise KernelError. ``"native"`` and ``"fused"`` are CPU chains; callers
    take each path of the chain that applies to the call, the exact path last
    (:mod:`treeattn.testbed.kernels.cpu_small`, :mod:`treeattn.testbed.kernels.cpu_native`,
    :func:`treeattn.testbed.kernels.cpu_fused.applies`)."""
    name = requested_backend()
    on_cuda = device.type == "cuda"
    if name == "torch":
        return "torch"
    if name in CPU_BACKENDS:
        return "torch" if on_cuda else name
    if name == "auto":
        if on_cuda:
            return "triton" if _triton_available() else "torch"
        return "native"
    if not _triton_available():
        raise KernelError(f"{ENV_BACKEND}=triton but Triton is not installed")
    if not on_cuda and not interpreter_enabled():
        raise KernelError(
            f"{ENV_BACKEND}=triton on {device.type} tensors needs Triton's interpreter: "
            "set TRITON_INTERPRET=1 in the environment before starting Python (slow; for tests), "
            "or use CUDA tensors"
        )
    if interpreter_enabled() != triton_is_interpreted():
        raise KernelError(
            "TRITON_INTERPRET was changed after Triton was imported; set it in the environment "
            "before starting Python"
        )
    return "triton"


def triton_module(name: str) -> ModuleType:
    """Import the Triton kernel module ``treeattn.kernels.<name>`` (lazily, on first use)."""
    if name not in ("triton_merge", "triton_partial"):
        raise KernelError(f"unknown Triton kernel module {name!r}")
    return importlib.import_module(f"treeattn.kernels.{name}")
