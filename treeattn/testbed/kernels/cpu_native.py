"""Partial attention on one CPU core through treeattn's own C kernel.

Why a native kernel: a decode step reads K and V once and does only 2·G multiply-adds per
element (G = Hq / Hkv), so it should run at the memory's read bandwidth. torch does not get
there for grouped-query heads: its fused FlashAttention kernel and MKL's G-row matmuls reached
37–50% of ``sum()``'s bandwidth at G = 3 and 4, in fp32 and bf16
(``benchmarks/results/kernels-cpu-1thread.md``). ``native/decode_partial.c`` streams each KV
head once, scores and weights each row while it is in registers, and widens bf16 to fp32 in
registers instead of in a copy; see that file for the algorithm.

How it is built: on first use, with the system's C compiler (``$CC``, else cc, gcc or clang) at
``-O3 -march=native``, into ``$TREEATTN_CACHE`` (default ``~/.cache/treeattn``) under a
name that hashes the source, the compiler, its flags and this CPU's feature flags, so a
shared home directory never hands one machine another's instructions. The library is written
to a temporary name and renamed into place, so ranks that start together and build at once
never load a half-written file. No new Python dependency; where no compiler is present (or it
fails), :func:`unavailable_reason` says why and the calls take torch's fused kernel.

When it serves a call (:func:`applies`): a CPU, one torch thread (the kernel runs on one
core; with more threads torch's kernels use them all), dense KV (no ``kv_len``) of at least
one token, fp32 or bf16 K/V with unit stride along D, D a multiple of the vector width and at
most 256, and G ≤ 8 (more query rows than that would re-read K and V per 8 rows).
Numerics are fp32 throughout, the exact path's up to the order of its sums, so it is held to
the exact path's tolerance (``O_TOLERANCE[("native", dtype)]``).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

SOURCES = tuple(Path(__file__).with_name("native") / name
                for name in ("decode_partial.c", "merge.c"))
ENV_CACHE = "TREEATTN_CACHE"  # the one cache folder, shared with fetched models
ABI_VERSION = 4
MAX_QUERY_ROWS = 8  # the kernel's MAX_ROWS: query rows served by one pass over K and V
KV_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}  # the kernel's KV_F32, KV_BF16
COMPILE_TIMEOUT_S = 120
# -march=native first; the retry without it is for compilers that do not know the flag.
FLAG_SETS = (("-O3", "-march=native"), ("-O3",))
COMMON_FLAGS = ("-std=gnu11", "-fPIC", "-shared", "-Wno-psabi")


class NativeKernel:
    """The loaded library: its entry point and the shape limits it reports."""

    def __init__(self, path: Path):
        lib = ctypes.CDLL(str(path))
        if lib.treeattn_native_abi() != ABI_VERSION:
            raise OSError(f"{path} has ABI {lib.treeattn_native_abi()}, expected {ABI_VERSION}")
        self.path = path
        self.lanes = int(lib.treeattn_native_lanes())
        self.max_d = int(lib.treeattn_native_max_d())
        fn = lib.treeattn_decode_partial
        fn.restype = ctypes.c_int
        fn.argtypes = ([ctypes.c_void_p, ctypes.c_float] + [ctypes.c_void_p] * 2 + [ctypes.c_int]
                       + [ctypes.c_int64] * 14 + [ctypes.c_void_p] * 2)
        self.decode_partial = fn
        merge = lib.treeattn_merge
        merge.restype = ctypes.c_int
        merge.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 4
        self.merge = merge


def cache_dir() -> Path:
    """Where built libraries are kept: ``$TREEATTN_CACHE``, else ``$XDG_CACHE_HOME`` or
    ``~/.cache``, under ``treeattn``."""
    if os.environ.get(ENV_CACHE):
        return Path(os.environ[ENV_CACHE])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "treeattn"


def _cpu_flags() -> str:
    """This CPU's feature flags (Linux), so libraries built for another CPU are not reused."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _compiler() -> list[str] | None:
    """The C compiler's command: ``$CC`` (which may carry words, as ``ccache gcc`` does),
    else the first of cc, gcc and clang on the PATH."""
    if os.environ.get("CC", "").strip():
        return shlex.split(os.environ["CC"])
    found = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    return [found] if found else None


def build(out_dir: Path, flags: tuple[str, ...] | None = None,
          sources: tuple[Path, ...] = SOURCES, name: str = "treeattn-native") -> Path:
    """Compile ``sources`` into one library in ``out_dir`` (or reuse an earlier build) and
    return its path, ``{name}-{hash}.so``.

    ``flags`` replaces the optimisation flags (tests build a portable variant with it).
    The runtime builds its own library from its own sources the same way
    (:mod:`treeattn.testbed.transport.shm_program`). Raises OSError with the compiler's message
    when no flag set compiles.
    """
    compiler = _compiler()
    if compiler is None:
        raise OSError("no C compiler found (set CC, or install gcc or clang)")
    source = b"".join(path.read_bytes() for path in sources)
    version = subprocess.run([*compiler, "--version"], capture_output=True, text=True,
                             timeout=COMPILE_TIMEOUT_S).stdout.splitlines()[:1]
    errors = []
    for opt in (flags,) if flags is not None else FLAG_SETS:
        key = hashlib.sha256(repr((source, compiler, version, opt, COMMON_FLAGS,
                                   platform.machine(), _cpu_flags())).encode()).hexdigest()
        target = out_dir / f"{name}-{key[:16]}.so"
        if target.exists():
            return target
        out_dir.mkdir(parents=True, exist_ok=True)
        fd, partial = tempfile.mkstemp(dir=out_dir, prefix=".build-", suffix=".so")
        os.close(fd)
        try:
            done = subprocess.run([*compiler, *opt, *COMMON_FLAGS, "-o", partial,
                                   *map(str, sources), "-lm"], capture_output=True, text=True,
                                  timeout=COMPILE_TIMEOUT_S)
            if done.returncode == 0:
                os.replace(partial, target)  # atomic: a concurrent loader sees all or nothing
                return target
            said = done.stderr.strip().splitlines()
            errors.append(f"{' '.join(opt)}: {said[-1] if said else f'exit {done.returncode}'}")
        finally:
            if os.path.exists(partial):
                os.unlink(partial)
    raise OSError(f"{' '.join(compiler)} could not build {name}: "
                  f"{'; '.join(errors)}")


def build_cached(sources: tuple[Path, ...], name: str) -> Path:
    """:func:`build` into :func:`cache_dir`, or per user in the temp directory where the
    cache is read-only. Raises OSError or SubprocessError as :func:`build` does."""
    try:
        return build(cache_dir(), sources=sources, name=name)
    except PermissionError:
        return build(Path(tempfile.gettempdir()) / f"treeattn-native-{os.getuid()}",
                     sources=sources, name=name)


@functools.lru_cache(maxsize=1)
def _load() -> tuple[NativeKernel | None, str]:
    """The kernel, built and loaded once per process, or None and the reason it is not."""
    try:
        return NativeKernel(build_cached(SOURCES, "treeattn-native")), ""
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"the native CPU kernel is unavailable: {exc}"


def kernel() -> NativeKernel | None:
    """The loaded kernel (building it on first use), or None where it cannot be built."""
    return _load()[0]


def unavailable_reason() -> str:
    """Why :func:`kernel` is None, or ``""`` when the kernel is available."""
    return _load()[1]


def applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            kv_len: torch.Tensor | None) -> bool:
    """Whether the call's shape and layout suit the kernel (it may still be unavailable)."""
    if k.device.type != "cpu" or kv_len is not None or torch.get_num_threads() != 1:
        return False
    b, hkv, t, d = k.shape
    if b == 0 or t == 0 or k.dtype not in KV_DTYPE_CODES or v.dtype != k.dtype:
        return False
    if q.shape[1] // hkv > MAX_QUERY_ROWS:
        return False
    return k.stride(-1) == 1 and v.stride(-1) == 1


def partial_attention_native(kern: NativeKernel, q: torch.Tensor, k: torch.Tensor,
                             v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The partial ``(o (B, Hq, D), lse (B, Hq))`` in fp32 for inputs checked by
    :func:`treeattn.kernels.checks.check_partial_inputs` and accepted by :func:`applies`
    and :func:`fits`."""
    b, hq, d = q.shape
    o = torch.empty(b, hq, d, dtype=torch.float32)  # (B, Hq, D)
    lse = torch.empty(b, hq, dtype=torch.float32)  # (B, Hq)
    _decode_partial(kern, q, k, v, scale, o.data_ptr(), lse.data_ptr())
    return o, lse


def partial_attention_native_packed(kern: NativeKernel, q: torch.Tensor, k: torch.Tensor,
                                    v: torch.Tensor, scale: float) -> torch.Tensor:
    """:func:`partial_attention_native` written straight into one flat fp32 tensor, ``o``
    (B·Hq rows of D) then ``lse`` (B·Hq): the form the runtime sends, with no
    concatenation after the kernel."""
    b, hq, d = q.shape
    out = torch.empty(b * hq * (d + 1), dtype=torch.float32)  # (B·Hq·(D + 1),)
    base = out.data_ptr()
    _decode_partial(kern, q, k, v, scale, base, base + b * hq * d * out.element_size())
    return out


def elements_after(t: torch.Tensor) -> int:
    """Elements of ``t``'s storage from its first element to the storage's end: what a C
    kernel handed ``t.data_ptr()`` may read, whatever shape and strides it is told."""
    return t.untyped_storage().nbytes() // t.element_size() - t.storage_offset()


def decode_arguments(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                     ) -> tuple[torch.Tensor, tuple[int, ...]]:
    """``treeattn_decode_partial``'s integer arguments after the scale, up to the row
    capacity: (k, v addresses, dtype code, B, Hkv, G, T, D, k's and v's first three strides,
    the elements k's and v's buffers hold), and the fp32 contiguous query whose address comes
    first (keep it alive until the call)."""
    b, hq, d = q.shape
    hkv, t = k.shape[1], k.shape[2]
    if q.dtype != torch.float32 or not q.is_contiguous():
        q = q.to(torch.float32).contiguous()  # (B, Hq, D); the kernel applies the scale
    return q, (k.data_ptr(), v.data_ptr(), KV_DTYPE_CODES[k.dtype], b, hkv, hq // hkv, t, d,
               *k.stride()[:3], *v.stride()[:3], elements_after(k), elements_after(v))


def _decode_partial(kern: NativeKernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    scale: float, o_ptr: int, lse_ptr: int) -> None:
    q32, args = decode_arguments(q, k, v)
    rows = q.shape[0] * q.shape[1]  # the outputs are allocated for exactly q's rows
    status = kern.decode_partial(q32.data_ptr(), scale, *args, rows, o_ptr, lse_ptr)
    if status != 0:  # applies() and fits() admit only shapes the kernel takes
        raise RuntimeError(f"native kernel refused shape q {tuple(q.shape)} k {tuple(k.shape)}")


def fits(kern: NativeKernel, d: int) -> bool:
    """Whether the loaded kernel's vector width and limit take head dimension ``d``."""
    return d % kern.lanes == 0 and d <= kern.max_d


def merge_applies(*tensors: torch.Tensor) -> bool:
    """Whether the C merge takes these checked partials: fp32, contiguous, on the CPU."""
    return all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous()
               for t in tensors)


def merge_native(kern: NativeKernel, a: tuple[torch.Tensor, torch.Tensor],
                 b: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The merge of two checked partials ``(o (B, Hq, D), lse (B, Hq))`` accepted by
    :func:`merge_applies`."""
    o = torch.empty_like(a[0])  # (B, Hq, D)
    lse = torch.empty_like(a[1])  # (B, Hq)
    rows = lse.numel()
    if rows:
        o_cap = min(a[0].numel(), b[0].numel())
        lse_cap = min(a[1].numel(), b[1].numel())
        if kern.merge(a[0].data_ptr(), a[1].data_ptr(), b[0].data_ptr(), b[1].data_ptr(),
                      o.data_ptr(), lse.data_ptr(), rows, o.numel() // rows, o_cap, lse_cap):
            raise RuntimeError(f"native merge refused partials of {tuple(a[0].shape)} and "
                               f"{tuple(b[0].shape)}")
    return o, lse


def merge_packed_native(kern: NativeKernel, a: torch.Tensor, b: torch.Tensor,
                        rows: int) -> torch.Tensor:
    """The merge of two checked packed partials (flat fp32: ``o`` of ``rows`` × D, then
    ``lse`` of ``rows``) accepted by :func:`merge_applies`, into one new packed tensor."""
    out = torch.empty_like(a)  # (rows·(D + 1),)
    n = a.numel() - rows  # elements of o
    lse_offset = n * out.element_size()
    o_cap = min(a.numel(), b.numel()) - rows  # each packed buffer: o, then rows of lse
    if kern.merge(a.data_ptr(), a.data_ptr() + lse_offset, b.data_ptr(), b.data_ptr() + lse_offset,
                  out.data_ptr(), out.data_ptr() + lse_offset, rows, n // rows, o_cap, rows):
        raise RuntimeError(f"native merge refused packed partials of {a.numel()} and "
                           f"{b.numel()} floats for {rows} rows")
    return out
