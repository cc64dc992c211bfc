"""A user's measured kernel table: decode GEMMs and attention points with their times.

``treeattn calibrate --kernels FILE --topology SPEC`` reads a CSV of measured kernels (the
format is in ``docs/token.md``), fits each kind's fixed cost and achieved HBM rate, and
writes a profile whose hardware model replaces the sourced defaults of
:mod:`treeattn.sim.devices` for that GPU: ``predict --token`` reads the weights at the
fitted GEMM rate of their dtype, the KV cache by the attention fit (in place of the sourced
grid model of :mod:`treeattn.sim.decode_kernels`), and charges every small kernel the GEMMs'
fitted fixed cost.

Each row is one kernel the token model runs:

- ``kind=gemm``: ``m`` (tokens of the batch), ``n``, ``k`` (the weight is ``n × k``),
  ``dtype`` (the weights': ``bf16``, ``fp16``, ``fp8``, ``fp4`` (NVFP4, 4.5 bits a weight
  with its scales), ``fp32``), ``time_us``. It reads ``n·k`` weight elements plus ``m·k``
  and ``m·n`` 16-bit activations.
- ``kind=attention``: ``batch``, ``q_heads``, ``kv_heads``, ``head_dim``, ``context``
  (cached tokens), ``dtype`` (the KV cache's), ``time_us``. It reads
  ``2·batch·kv_heads·context·head_dim`` KV elements.

Per kind (and per weight dtype for GEMMs) ``time = fixed + bytes / rate`` is fitted by least
squares over at least two sizes (a negative fixed cost is refitted as zero).
"""

from __future__ import annotations

import csv
import io
import math
from dataclasses import dataclass
from pathlib import Path

from treeattn.schedule.payloads import SimError
from treeattn.sim.files.profile_schema import (
    KERNEL_BYTES_PER_S,
    KERNEL_FIXED_S,
    KERNEL_TABLE_KINDS,
    KERNELS_KIND,
)

KINDS = KERNEL_TABLE_KINDS
DTYPE_BYTES = {"bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "fp8": 1, "float8": 1,
               "fp32": 4, "float32": 4, "fp4": 4.5 / 8, "float4": 4.5 / 8}
CANONICAL = {"bfloat16": "bf16", "float16": "fp16", "float8": "fp8", "float32": "fp32",
             "float4": "fp4"}
KNOWN_DTYPES = ("bf16", "fp16", "fp8", "fp4", "fp32")
WEIGHT_ONLY_DTYPES = ("fp4",)  # NVFP4 weights; the model runs no FP4 KV cache
COLUMNS = {"gemm": ("m", "n", "k", "dtype", "time_us"),
           "attention": ("batch", "q_heads", "kv_heads", "head_dim", "context", "dtype",
                         "time_us")}
ACTIVATION_BYTES = 2  # decode activations are bf16/fp16 whatever the weights' dtype
MAX_TABLE_BYTES = 4 << 20
MAX_DIMENSION = 1 << 40  # a dimension above this is no kernel a GPU runs (bytes stay finite)


@dataclass(frozen=True)
class KernelFit:
    """``time = fixed_s + bytes / bytes_per_s`` for one kind (and dtype) of kernel."""

    kind: str
    dtype: str
    fixed_s: float
    bytes_per_s: float
    points: int

    def time_s(self, nbytes: float) -> float:
        return self.fixed_s + nbytes / self.bytes_per_s

    def to_json(self) -> dict:
        return {"kind": self.kind, "dtype": self.dtype, "fixed_s": self.fixed_s,
                "bytes_per_s": self.bytes_per_s, "points": self.points}


def row_bytes(row: dict) -> float:
    """HBM bytes one checked row's kernel reads (see the module docstring)."""
    width = DTYPE_BYTES[row["dtype"]]
    if row["kind"] == "gemm":
        m, n, k = row["m"], row["n"], row["k"]
        return n * k * width + (m * k + m * n) * ACTIVATION_BYTES
    return 2.0 * row["batch"] * row["kv_heads"] * row["context"] * row["head_dim"] * width


def read_kernel_table(source: str | Path, text: str | None = None) -> list[dict]:
    """The checked rows of a kernel table (a CSV file, or ``text``); SimError naming the
    first bad row: not CSV, missing columns, an unknown kind or dtype, a dimension that is
    not an integer in ``[1, MAX_DIMENSION]``, heads that do not group (``q_heads`` a multiple
    of ``kv_heads``), a time that is not a positive number."""
    name = str(source)
    if text is None:
        path = Path(source)
        if not path.is_file():
            raise SimError(f"kernel table {name}: no such file")
        if path.stat().st_size > MAX_TABLE_BYTES:
            raise SimError(f"kernel table {name}: larger than {MAX_TABLE_BYTES} bytes")
        text = path.read_text(errors="replace")
    try:
        return _read_rows(name, text)
    except csv.Error as err:  # a field over csv's limit, a stray NUL, ...
        raise SimError(f"kernel table {name}: not a CSV table ({err})") from None


def _read_rows(name: str, text: str) -> list[dict]:
    reader = csv.DictReader(io.StringIO(text))
    header = [h.strip() for h in (reader.fieldnames or [])]
    if "kind" not in header:
        raise SimError(f"kernel table {name}: missing column 'kind' (columns: "
                       f"{', '.join(header) or 'none'})")
    rows = []
    for line, raw in enumerate(reader, start=2):
        raw = {str(k).strip(): (v or "").strip() for k, v in raw.items() if k is not None}
        kind = raw.get("kind", "").lower()
        if kind not in KINDS:
            raise SimError(f"kernel table {name} line {line}: kind {raw.get('kind')!r} is "
                           f"not one the model runs ({', '.join(KINDS)})")
        missing = [c for c in COLUMNS[kind] if c not in header]
        if missing:
            raise SimError(f"kernel table {name}: {kind} rows need column(s) "
                           f"{', '.join(missing)}")
        row = {"kind": kind, "line": line}
        for col in COLUMNS[kind]:
            value = raw.get(col, "")
            if col == "dtype":
                dtype = value.lower()
                if dtype not in DTYPE_BYTES:
                    raise SimError(f"kernel table {name} line {line}: dtype {value!r} is not "
                                   f"one the model runs ({', '.join(KNOWN_DTYPES)})")
                row["dtype"] = CANONICAL.get(dtype, dtype)
                if kind == "attention" and row["dtype"] in WEIGHT_ONLY_DTYPES:
                    raise SimError(f"kernel table {name} line {line}: dtype {value!r} is a "
                                   "weight dtype; the model runs no KV cache in it")
            elif col == "time_us":
                try:
                    time_us = float(value)
                except ValueError:
                    raise SimError(f"kernel table {name} line {line}: time_us {value!r} is "
                                   "not a number") from None
                if not math.isfinite(time_us) or time_us <= 0:
                    raise SimError(f"kernel table {name} line {line}: time_us {value} is not "
                                   "a positive time")
                row["time_s"] = time_us * 1e-6
            else:
                try:
                    number = int(value)
                except ValueError:
                    number = 0
                if not 1 <= number <= MAX_DIMENSION:
                    raise SimError(f"kernel table {name} line {line}: {col} {value[:40]!r} is "
                                   f"not an integer in [1, 2^40]")
                row[col] = number
        if kind == "attention" and row["q_heads"] % row["kv_heads"]:
            raise SimError(f"kernel table {name} line {line}: {row['q_heads']} query heads "
                           f"do not group over {row['kv_heads']} KV heads")
        rows.append(row)
    if not rows:
        raise SimError(f"kernel table {name}: no rows")
    return rows


def check_table_gpu(rows: list[dict], gpu_model: str, source: str = "kernel table") -> None:
    """SimError naming the rows a ``gpu_model`` GPU cannot have run: FP4 GEMMs on a GPU
    without FP4 tensor cores (:func:`treeattn.sim.devices.check_weight_dtype`)."""
    from treeattn.sim.devices import check_weight_dtype

    fp4 = [row for row in rows if row["kind"] == "gemm" and row["dtype"] == "fp4"]
    if fp4:
        try:
            check_weight_dtype(gpu_model, "float4")
        except SimError as err:
            raise SimError(f"{source} {_lines(fp4)}: fp4 GEMMs on {gpu_model}: {err}") from None


def _lines(rows: list[dict]) -> str:
    lines = [str(row["line"]) for row in rows if "line" in row]
    return ("line " if len(lines) == 1 else "lines ") + ", ".join(lines) if lines else "rows"


def fit_kernels(rows: list[dict], source: str = "kernel table") -> list[KernelFit]:
    """One :class:`KernelFit` per kind (GEMMs per weight dtype), least squares in
    ``time = fixed + bytes / rate``; SimError where a group has fewer than two sizes, or
    where its fit is not a fixed cost and a rate a profile holds (the schema's
    ``KERNEL_FIXED_S`` and ``KERNEL_BYTES_PER_S``: times so small the rate is beyond any
    HBM, or so large the fixed cost is beyond any kernel), naming the group's rows."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for row in rows:
        key = (row["kind"], row["dtype"] if row["kind"] == "gemm" else "any")
        groups.setdefault(key, []).append(row)
    fits = []
    for (kind, dtype), group in sorted(groups.items()):
        what = f"{kind} {'' if dtype == 'any' else dtype + ' '}rows"
        points = [(float(row_bytes(row)), row["time_s"]) for row in group]
        if len({b for b, _ in points}) < 2:
            raise SimError(f"{source}: {what} need at least two different sizes to fit a "
                           "fixed cost and a rate")
        fixed, rate = _least_squares(points)
        if rate is None:
            raise SimError(f"{source} {_lines(group)}: the {what}' sizes are too close to "
                           "tell apart in floating point, so no rate can be fitted")
        (fixed_lo, fixed_hi), (rate_lo, rate_hi) = KERNEL_FIXED_S, KERNEL_BYTES_PER_S
        if not (math.isfinite(fixed) and fixed_lo <= fixed <= fixed_hi
                and math.isfinite(rate) and rate_lo < rate <= rate_hi):
            raise SimError(f"{source} {_lines(group)}: the fit of the {what} (fixed {fixed:g} "
                           f"s, rate {rate:g} B/s) is outside what a profile holds (fixed in "
                           f"[{fixed_lo:g}, {fixed_hi:g}] s, rate in ({rate_lo:g}, "
                           f"{rate_hi:g}] B/s)")
        fits.append(KernelFit(kind, dtype, fixed, rate, len(points)))
    return fits


def _least_squares(points: list[tuple[float, float]]) -> tuple[float, float | None]:
    """(fixed s, bytes/s) of ``t = a + b / rate``; ``a`` refitted as 0 if it comes out
    negative; rate None where the sizes have no variance in floating point; SimError if the
    times do not grow with the bytes."""
    n = len(points)
    mean_b = sum(b for b, _ in points) / n
    mean_t = sum(t for _, t in points) / n
    var = sum((b - mean_b) ** 2 for b, _ in points)
    if not var > 0:
        return 0.0, None
    slope = sum((b - mean_b) * (t - mean_t) for b, t in points) / var
    fixed = mean_t - slope * mean_b
    if fixed < 0:
        fixed = 0.0
        slope = sum(b * t for b, t in points) / sum(b * b for b, _ in points)
    if slope <= 0:
        raise SimError("kernel table: the times do not grow with the bytes read, so no "
                       "rate can be fitted")
    return fixed, 1.0 / slope


def kernel_profile(rows: list[dict], fits: list[KernelFit], gpu_model: str,
                   source: str) -> dict:
    """The profile ``calibrate --kernels`` writes (kind ``kernels``)."""
    from treeattn.sim.devices import default_backend

    check_table_gpu(rows, gpu_model, str(source))
    residuals = []
    by_key = {(f.kind, f.dtype): f for f in fits}
    for row in rows:
        fit = by_key[(row["kind"], row["dtype"] if row["kind"] == "gemm" else "any")]
        model = fit.time_s(row_bytes(row))
        residuals.append({"kind": row["kind"], "dtype": row["dtype"], "bytes": row_bytes(row),
                          "measured_s": row["time_s"], "model_s": model,
                          "error": model / row["time_s"] - 1})
    return {"format": "treeattn.profile", "version": 1, "kind": KERNELS_KIND,
            "backend": default_backend(gpu_model).name, "gpu_model": gpu_model,
            "kernels": {"source": str(source), "fits": [f.to_json() for f in fits],
                        "residuals": residuals}}


def hardware_from_kernels(profile: dict):
    """The GPU's hardware model with the table's fits in place of the sourced defaults: the
    attention fit's rate as its memory bandwidth, each GEMM fit's rate for its weight dtype,
    and the attention fit's fixed cost (else the GEMMs' mean) as every kernel's fixed cost.
    """
    from dataclasses import replace

    from treeattn.sim.devices import hardware_for

    base = hardware_for(profile["gpu_model"])
    fits = [KernelFit(f["kind"], f["dtype"], float(f["fixed_s"]), float(f["bytes_per_s"]),
                      int(f["points"])) for f in profile["kernels"]["fits"]]
    attention = next((f for f in fits if f.kind == "attention"), None)
    gemms = [f for f in fits if f.kind == "gemm"]
    gemm_fixed = sum(f.fixed_s for f in gemms) / len(gemms) if gemms else None
    launch = attention.fixed_s if attention is not None else gemm_fixed
    # one GEMM is one kernel: the GEMMs' fixed cost prices every small kernel; without GEMM
    # rows, half the attention's (a decode attention is a split kernel and its combine)
    kernel = gemm_fixed if gemm_fixed is not None else attention.fixed_s / 2
    return replace(base, memory_bandwidth_Bps=(attention.bytes_per_s if attention is not None
                                               else base.memory_bandwidth_Bps),
                   launch_s=launch, kernel_s=kernel, attention_measured=attention is not None,
                   gemm_bandwidth=tuple((f.dtype, f.bytes_per_s) for f in gemms))
