"""Pick the backend for each call: Triton on CUDA tensors, a CPU chain on CPU tensors.

On CPU tensors ``auto`` means ``native``: the fastest CPU path for each call, which a plugged-in
chain of CPU kernels offers (:class:`CpuKernels`, :func:`plug_in_cpu`; the CPU test bed's numpy,
C and fused-torch paths, :mod:`treeattn.testbed.kernels.chain`), and the exact torch path for
everything the chain does not take or where none is plugged in.
``TREEATTN_KERNEL=triton|native|fused|torch`` forces one backend (``auto`` or unset: by
device); ``fused`` is the CPU chain without its C kernel, ``torch`` is the exact path
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
from typing import Protocol

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
    take the plugged-in chain's path where one applies (:func:`cpu_kernels`), the exact path
    last."""
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


class CpuKernels(Protocol):
    """Faster CPU paths than the exact one, plugged in beside it (:func:`plug_in_cpu`).

    ``backend`` is ``"native"`` or ``"fused"`` (:func:`choose_backend`); a path is a name the
    chain runs (``"small"``, ``"native"``, ``"fused"``). Every method returns None for a call
    it does not take, which then goes to the exact torch path."""

    def attention_path(self, backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       kv_len: torch.Tensor | None) -> str | None: ...

    def attention(self, path: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]: ...

    def attention_packed(self, path: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         scale: float) -> torch.Tensor | None: ...

    def merge(self, backend: str, a: tuple[torch.Tensor, torch.Tensor],
              b: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor] | None:
        ...

    def merge_packed(self, backend: str, a: torch.Tensor, b: torch.Tensor,
                     rows: int) -> torch.Tensor | None: ...


_cpu_kernels: CpuKernels | None = None


def plug_in_cpu(chain: CpuKernels | None) -> None:
    """Use ``chain`` for CPU calls in this process from now on (None: the exact path)."""
    global _cpu_kernels
    _cpu_kernels = chain


def cpu_kernels(backend: str) -> CpuKernels | None:
    """The plugged-in CPU chain for ``backend`` (None on other backends, or where none is);
    asking for a CPU chain by name (``TREEATTN_KERNEL=native|fused``) with none plugged in is
    an error."""
    if backend not in CPU_BACKENDS:
        return None
    if _cpu_kernels is None and requested_backend() in CPU_BACKENDS:
        raise KernelError(f"{ENV_BACKEND}={requested_backend()} needs a CPU kernel chain "
                          "plugged in (treeattn.testbed.plug_in())")
    return _cpu_kernels


def triton_module(name: str) -> ModuleType:
    """Import the Triton kernel module ``treeattn.kernels.<name>`` (lazily, on first use)."""
    if name not in ("triton_merge", "triton_partial"):
        raise KernelError(f"unknown Triton kernel module {name!r}")
    return importlib.import_module(f"treeattn.kernels.{name}")
