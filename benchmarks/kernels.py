"""Partial-attention throughput against the memory-bandwidth ceiling, on CPU and on CUDA.

Decode attention is memory-bound: one step reads every K and V byte once, so the figure of
merit is GB/s of K+V read against what the memory can deliver.

- CPU (always): ``treeattn.kernels.partial_attention`` as it dispatches on a CPU (dense
  fp32/bf16 KV on one thread: treeattn's C kernel, ``testbed/kernels/cpu_native.py``; with more
  threads torch's fused FlashAttention kernel, ``testbed/kernels/cpu_fused.py``), as K+V read GB/s
  against the read bandwidth of ``sum()`` over the same K and V, measured in the same
  process, interleaved with the kernel runs (best of each), so that the ratio is meaningful
  on a shared machine. The strongest torch alternatives are timed the same way beside it:
  torch's fused kernel and the exact torch path (``treeattn.kernels.reference``, the oracle).
- CUDA (when available): bf16, the Triton kernel beside ``scaled_dot_product_attention`` and a
  naive torch implementation, as a fraction of the GPU's peak HBM bandwidth (datasheet) and of
  a measured device copy. Also records the Triton kernel's error against the torch reference.

CPU shapes: B=1 with Hq=Hkv=8, D=128 (MHA), Hq=9, Hkv=3, D=64 (SmolLM2-like GQA 3:1) and
Hq=32, Hkv=8, D=128 (Llama-3-8B-like GQA 4:1), T from 16k to 1M. GPU shapes: B=1, Hq=32,
Hkv=8, D=128, T from 4k to 1M. Writes ``benchmarks/results/kernels-<tag>.json`` and ``.md``.
Run single-threaded on one core:
``taskset -c 1 .venv/bin/python benchmarks/kernels.py --threads 1 --tag cpu-1thread [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernels_gpu  # noqa: E402  (benchmarks/, beside this file)

from treeattn.kernels import (  # noqa: E402
    partial_attention,
    partial_attention_path,
    reference,
)
from treeattn.testbed.kernels import cpu_fused  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
B, HQ, HKV, D = 1, 32, 8, 128
# CPU configurations: (name, Hq, Hkv, D); T values per configuration.
CPU_SHAPES = [("mha-d128", 8, 8, 128), ("smollm2-gqa3", 9, 3, 64), ("llama-gqa4", 32, 8, 128)]
T_SWEEP_CPU = [16384, 131072, 1048576]


def machine_info() -> dict:
    info = {
        "python": platform.python_version(), "torch": torch.__version__,
        "platform": platform.platform(), "cpu": _cpu_model(), "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }  # fmt: skip
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


_FLUSH = None
MIN_FLUSH_BYTES = 256 << 20


def last_level_cache_bytes() -> int:
    """The largest CPU cache Linux reports (sysfs), or 0 when it cannot tell."""
    sizes = []
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = entry.read_text().strip().upper()
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text[:-1] if text[-1:] in "KMG" else text
        if digits.isdigit():
            sizes.append(int(digits) * scale)
    return max(sizes, default=0)


def _flush_caches() -> None:
    """Write twice the last-level cache (at least 256 MiB) so that the next run reads K and V
    from DRAM, not from a cache (a decode step reads a layer's cache once; some server CPUs
    have an L3 of hundreds of MiB, which a fixed 256 MiB flush would leave warm)."""
    global _FLUSH
    if _FLUSH is None:
        n = max(MIN_FLUSH_BYTES, 2 * last_level_cache_bytes()) // 4
        _FLUSH = torch.empty(n, dtype=torch.float32)
    _FLUSH.fill_(1.0)



def _time_interleaved(fns: dict, reps: int) -> dict[str, dict[str, float]]:
    """Best and median cold-cache wall seconds, and best CPU seconds of the calling thread, of
    each function; the functions take turns in every repetition so that all of them see the
    same load from neighbours on a shared machine. CPU time leaves out the time the thread was
    descheduled, the main disturbance on a shared core (memory contention remains)."""
    for fn in fns.values():
        fn()  # warm up
    wall: dict[str, list[float]] = {name: [] for name in fns}
    cpu: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            _flush_caches()
            c0, t0 = time.thread_time(), time.perf_counter()
            fn()
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.thread_time() - c0)
    return {name: {"best": min(wall[name]), "median": statistics.median(wall[name]),
                   "cpu": min(cpu[name])} for name in fns}  # fmt: skip


def run_cpu(shapes: list[tuple], t_values: list[int], dtypes: list[torch.dtype]) -> dict:
    rows = []
    for name, hq, hkv, d in shapes:
        for dtype in dtypes:
            for t in t_values:
                rows.append(_cpu_row(name, hq, hkv, d, t, dtype))
    return {"reference": "sum() over the same K and V, same process, same threads",
            "rows": rows}  # fmt: skip


def _cpu_row(name: str, hq: int, hkv: int, d: int, t: int, dtype: torch.dtype) -> dict:
    q = kernels_gpu.fill((B, hq, d), 1, dtype, "cpu")
    k = kernels_gpu.fill((B, hkv, t, d), 2, dtype, "cpu")
    v = kernels_gpu.fill((B, hkv, t, d), 3, dtype, "cpu")
    kv_bytes = 2 * k.numel() * k.element_size()
    reps = 5 if kv_bytes < 1 << 30 else 3
    new, exact = partial_attention(q, k, v), reference.partial_attention(q, k, v)
    err = max((new[0] - exact[0]).abs().max().item(), (new[1] - exact[1]).abs().max().item())
    fns = {"sum": lambda: (k.sum(), v.sum()), "kernel": lambda: partial_attention(q, k, v),
           "exact": lambda: reference.partial_attention(q, k, v)}
    scale = d ** -0.5
    if cpu_fused.applies(q, k, None):
        fns["fused"] = lambda: cpu_fused.partial_attention_fused(q, k, v, scale)
    timed = _time_interleaved(fns, reps)
    bw = {key: kv_bytes / x["best"] / 1e9 for key, x in timed.items()}
    cpu_bw = {key: kv_bytes / x["cpu"] / 1e9 for key, x in timed.items()}
    best_torch = min(timed[key]["best"] for key in ("exact", "fused") if key in timed)
    row = {
        "config": name, "dtype": str(dtype).removeprefix("torch."), "Hq": hq, "Hkv": hkv,
        "D": d, "T": t, "kv_bytes": kv_bytes, "reps": reps,
        "ms": timed["kernel"]["best"] * 1e3, "ms_median": timed["kernel"]["median"] * 1e3,
        "GBps": bw["kernel"], "sum_GBps": bw["sum"], "frac_of_sum": bw["kernel"] / bw["sum"],
        "path": partial_attention_path(q, k, v),
        "fused_frac_of_sum": bw["fused"] / bw["sum"] if "fused" in bw else None,
        "exact_ms": timed["exact"]["best"] * 1e3, "exact_GBps": bw["exact"],
        "exact_frac_of_sum": bw["exact"] / bw["sum"],
        "speedup": timed["exact"]["best"] / timed["kernel"]["best"],
        "speedup_vs_best_torch": best_torch / timed["kernel"]["best"],
        "cpu_time_frac_of_sum": cpu_bw["kernel"] / cpu_bw["sum"],
        "exact_cpu_time_frac_of_sum": cpu_bw["exact"] / cpu_bw["sum"],
        "max_abs_diff_vs_exact": err,
    }  # fmt: skip
    print(f"cpu {name:12s} {row['dtype']:8s} T={t:8d} {row['path']:6s} {bw['kernel']:6.2f} GB/s "
          f"({100 * row['frac_of_sum']:.0f}% of sum {bw['sum']:.1f}); "
          f"{row['speedup_vs_best_torch']:.2f}x the best torch path; exact path "
          f"{bw['exact']:.2f} ({100 * row['exact_frac_of_sum']:.0f}%); CPU-time ratios "
          f"{100 * row['cpu_time_frac_of_sum']:.0f}% vs "
          f"{100 * row['exact_cpu_time_frac_of_sum']:.0f}%", flush=True)  # fmt: skip
    return row


def markdown(result: dict) -> str:
    m = result["machine"]
    lines = ["# Partial attention throughput", "",
             f"Machine: {m['cpu']} ({m['cpu_count']} CPUs, torch threads {m['torch_threads']}),"
             f" {m.get('gpu', 'no GPU')}; torch {m['torch']}, triton {m['triton']}.",
             f"B={B}. GB/s counts K and V bytes read once.",
             ""]  # fmt: skip
    if "cpu" in result:
        lines += ["## CPU, the dispatched kernel vs torch's kernels", "",
                  "Best of the runs, cold caches. `path` is what `partial_attention` runs: "
                  "`native` is treeattn's C kernel (one thread, fp32/bf16 dense KV, fp32 "
                  "arithmetic), `fused` torch's fused FlashAttention kernel (in bf16, P "
                  "rounded to bf16 for P·V, as on a GPU), `exact` the torch reference. `sum` "
                  "is the read bandwidth of `sum()` over the same K and V, measured in the "
                  "same process interleaved with the kernels; the ratios are the figures to "
                  "compare (absolute GB/s vary with the machine's load). `vs best torch` "
                  "divides the faster of torch's two paths by the dispatched kernel. The "
                  "CPU-time ratio uses the thread's CPU time instead of wall time (robust to "
                  "being descheduled on a shared core).", "",
                  "| config | dtype | Hq/Hkv | D | T | path | ms | GB/s | sum GB/s | of sum | "
                  "fused of sum | exact of sum | vs best torch | of sum (CPU time) | "
                  "max diff vs exact |",
                  "|---|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        lines += [f"| {r['config']} | {r['dtype']} | {r['Hq']}/{r['Hkv']} | {r['D']} | {r['T']} | "
                  f"{r['path']} | {r['ms']:.2f} | {r['GBps']:.2f} | {r['sum_GBps']:.2f} | "
                  f"{100 * r['frac_of_sum']:.0f}% | "
                  + (f"{100 * r['fused_frac_of_sum']:.0f}% | " if r.get("fused_frac_of_sum")
                     else "– | ")
                  + f"{100 * r['exact_frac_of_sum']:.0f}% | {r['speedup_vs_best_torch']:.2f}x | "
                  f"{100 * r['cpu_time_frac_of_sum']:.0f}% | "
                  f"{r['max_abs_diff_vs_exact']:.1e} |"
                  for r in result["cpu"]["rows"]]  # fmt: skip
        lines.append("")
    if "gpu" in result:
        lines += kernels_gpu.markdown(result["gpu"])
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="T up to 128k only")
    parser.add_argument("--cpu-t", type=int, nargs="+", help="CPU T values (default: 16k..1M)")
    parser.add_argument("--no-cpu", action="store_true", help="skip the CPU sweep")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    parser.add_argument("--tag", help="results file tag (default: cpu, or the GPU's name)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    result: dict = {"machine": machine_info()}
    cap = 131072 if args.quick else None
    if not args.no_cpu:
        t_cpu = args.cpu_t or [t for t in T_SWEEP_CPU if cap is None or t <= cap]
        result["cpu"] = run_cpu(CPU_SHAPES, t_cpu, [torch.float32, torch.bfloat16])
    tag = "cpu"
    if torch.cuda.is_available():
        result["gpu"] = kernels_gpu.run_gpu(
            [t for t in kernels_gpu.T_SWEEP if cap is None or t <= cap], explore=not args.quick)
        tag = torch.cuda.get_device_name().lower().replace(" ", "-")
    tag = args.tag or tag
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"kernels-{tag}.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / f"kernels-{tag}.md").write_text(markdown(result))
    print(f"wrote {RESULTS / f'kernels-{tag}.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
