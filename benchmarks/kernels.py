"""Partial-attention throughput against the memory-bandwidth ceiling, on CPU and on CUDA.

Decode attention is memory-bound: one step reads every K and V byte once, so the figure of
merit is GB/s of K+V read against what the memory can deliver.

- CPU (always): the torch path (``treeattn.kernels.reference``) in fp32 and bf16, against a
  copy benchmark measured in the same run (STREAM convention: read + write bytes).
- CUDA (when available): bf16, the Triton kernel beside ``scaled_dot_product_attention`` and a
  naive torch implementation, as a fraction of the GPU's peak HBM bandwidth (datasheet) and of
  a measured device copy. Also records the Triton kernel's error against the torch reference.

Shapes: B=1, Hq=32, Hkv=8, D=128, T from 4k to 1M. Writes ``benchmarks/results/kernels-<tag>``
``.json`` and ``.md``. Run: ``.venv/bin/python benchmarks/kernels.py [--quick]``.
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
from treeattn.kernels import partial_attention, reference  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
B, HQ, HKV, D = 1, 32, 8, 128
T_SWEEP = [4096, 16384, 65536, 262144, 1048576]
T_SWEEP_GPU = [4096, 8192, 16384, 32768, 65536, 131072, 262144, 524288, 1048576]
# Peak memory bandwidth, bytes/s, from the vendors' datasheets (DESIGN.md for H100/MI300X/4090;
# NVIDIA H200 datasheet: 4.8 TB/s; A100 datasheet: 2.039 TB/s for 80GB SXM, 1.555 for 40GB).
PEAK_BW = {
    "H200": 4.8e12, "H100 80GB HBM3": 3.35e12, "H100 SXM": 3.35e12, "H100 PCIe": 2.0e12,
    "H100 NVL": 3.9e12, "A100-SXM4-80GB": 2.039e12, "A100-SXM4-40GB": 1.555e12,
    "MI300X": 5.3e12, "RTX 4090": 1.008e12,
}  # fmt: skip


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


def _fill(shape: tuple[int, ...], dtype: torch.dtype, device: str, seed: int) -> torch.Tensor:
    """A large tensor filled fast: one random 1M-element tile repeated (values are irrelevant
    to the timing, but must be finite and not all equal)."""
    gen = torch.Generator().manual_seed(seed)
    tile = torch.randn(1 << 20, generator=gen).to(dtype=dtype, device=device)
    out = torch.empty(shape, dtype=dtype, device=device)
    flat = out.view(-1)
    for start in range(0, flat.numel(), tile.numel()):
        n = min(tile.numel(), flat.numel() - start)
        flat[start : start + n].copy_(tile[:n])
    return out


_FLUSH = None


def _flush_caches() -> None:
    """Write 256 MiB so that the next run reads K and V from DRAM, not from the CPU caches
    (a decode step reads a layer's cache once; at T=4k it would otherwise fit in L3)."""
    global _FLUSH
    if _FLUSH is None:
        _FLUSH = torch.empty(1 << 26, dtype=torch.float32)
    _FLUSH.fill_(1.0)


def _time_cpu(fn, reps: int) -> tuple[float, float]:
    """(best, median) seconds over ``reps`` cold-cache runs after a warm-up. The best run is
    the figure used: on a shared machine the others are slowed by neighbours, not the code."""
    fn()  # warm up
    times = []
    for _ in range(reps):
        _flush_caches()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times), statistics.median(times)


class CpuCopy:
    """Copy bandwidth in bytes/s (read + write counted, STREAM convention), re-measured next
    to every kernel measurement so that both see the same load on a shared machine."""

    def __init__(self, nbytes: int = 1 << 28) -> None:
        self.src = _fill((nbytes // 4,), torch.float32, "cpu", 0)
        self.dst = torch.empty_like(self.src)
        self.nbytes = nbytes

    def measure(self) -> float:
        return 2 * self.nbytes / _time_cpu(lambda: self.dst.copy_(self.src), 5)[0]


def run_cpu(t_values: list[int], dtypes: list[torch.dtype]) -> dict:
    copy = CpuCopy()
    rows = []
    for dtype in dtypes:
        for t in t_values:
            q = _fill((B, HQ, D), dtype, "cpu", 1)
            k = _fill((B, HKV, t, D), dtype, "cpu", 2)
            v = _fill((B, HKV, t, D), dtype, "cpu", 3)
            kv_bytes = 2 * k.numel() * k.element_size()
            reps = 5 if kv_bytes < 1 << 30 else 2
            fn = lambda q=q, k=k, v=v: reference.partial_attention(q, k, v)  # noqa: E731
            copy_bw = copy.measure()
            sec, median = _time_cpu(fn, reps)
            copy_bw = max(copy_bw, copy.measure())
            rows.append({
                "dtype": str(dtype).removeprefix("torch."), "T": t, "kv_bytes": kv_bytes,
                "ms": sec * 1e3, "ms_median": median * 1e3, "GBps": kv_bytes / sec / 1e9,
                "copy_GBps": copy_bw / 1e9, "frac_of_copy": kv_bytes / sec / copy_bw,
            })  # fmt: skip
            print(f"cpu {rows[-1]['dtype']:9s} T={t:8d} {rows[-1]['GBps']:7.2f} GB/s "
                  f"({100 * rows[-1]['frac_of_copy']:.0f}% of copy)", flush=True)  # fmt: skip
            del q, k, v
    return {"copy_GBps": max(r["copy_GBps"] for r in rows), "rows": rows}


def gpu_peak_bandwidth() -> tuple[float | None, str]:
    name = torch.cuda.get_device_name()
    for key, bw in PEAK_BW.items():
        if key.lower() in name.lower():
            return bw, f"datasheet ({key})"
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    clock_khz = getattr(props, "memory_clock_rate", 0)
    bus_bits = getattr(props, "memory_bus_width", 0)
    if clock_khz and bus_bits:
        return 2 * clock_khz * 1e3 * bus_bits / 8, "memory clock x bus width (double data rate)"
    return None, "unknown"


def _gpu_copy_bandwidth(do_bench, nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write counted)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * nbytes / (do_bench(lambda: dst.copy_(src), return_mode="median") / 1e3)


def _naive_torch(q, k, v):
    g = q.shape[1] // k.shape[1]
    kr, vr = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)  # (B, Hq, T, D)
    s = torch.einsum("bhd,bhtd->bht", q.float(), kr.float()) / q.shape[-1] ** 0.5
    return torch.einsum("bht,bhtd->bhd", torch.softmax(s, -1), vr.float())


def _sdpa(q, k, v):
    f = torch.nn.functional.scaled_dot_product_attention
    try:
        return f(q[:, :, None], k, v, enable_gqa=True)
    except TypeError:  # torch < 2.5: no enable_gqa, repeat K and V (counted in the time)
        g = q.shape[1] // k.shape[1]
        return f(q[:, :, None], k.repeat_interleave(g, 1), v.repeat_interleave(g, 1))


def run_gpu(t_values: list[int]) -> dict:
    from triton.testing import do_bench

    peak, peak_source = gpu_peak_bandwidth()
    copy_bw = _gpu_copy_bandwidth(do_bench)
    impls = {"triton": lambda q, k, v: partial_attention(q, k, v), "sdpa": _sdpa,
             "naive": _naive_torch}  # fmt: skip
    rows, checks = [], []
    for t in t_values:
        q, k, v = (_fill(s, torch.bfloat16, "cuda", i)
                   for i, s in enumerate([(B, HQ, D), (B, HKV, t, D), (B, HKV, t, D)]))  # fmt: skip
        kv_bytes = 2 * k.numel() * k.element_size()
        for name, fn in impls.items():
            if name == "naive" and t > 262144:
                continue  # the repeated K/V copies dominate; enough points already
            ms = do_bench(lambda fn=fn, q=q, k=k, v=v: fn(q, k, v), return_mode="median")
            bw = kv_bytes / (ms / 1e3)
            rows.append({"impl": name, "T": t, "kv_bytes": kv_bytes, "ms": ms, "GBps": bw / 1e9,
                         "frac_of_peak": bw / peak if peak else None,
                         "frac_of_copy": bw / copy_bw})  # fmt: skip
            print(f"gpu {name:6s} T={t:8d} {bw / 1e9:8.1f} GB/s "
                  f"({100 * bw / peak if peak else float('nan'):.0f}% of peak)", flush=True)
        checks.append(_check_gpu(q, k, v, t))
        del q, k, v
    return {"peak_GBps": peak / 1e9 if peak else None, "peak_source": peak_source,
            "copy_GBps": copy_bw / 1e9, "rows": rows, "checks": checks}  # fmt: skip


def _check_gpu(q, k, v, t: int) -> dict:
    """Triton against the torch reference on the same device (fp32 math on bf16 inputs)."""
    o, lse = partial_attention(q, k, v)
    ro, rlse = reference.partial_attention(q, k, v)
    return {"T": t, "max_abs_err_o": (o - ro).abs().max().item(),
            "max_abs_err_lse": (lse - rlse).abs().max().item()}  # fmt: skip


def markdown(result: dict) -> str:
    m = result["machine"]
    lines = ["# Partial attention throughput", "",
             f"Machine: {m['cpu']} ({m['cpu_count']} CPUs, torch threads {m['torch_threads']}),"
             f" {m.get('gpu', 'no GPU')}; torch {m['torch']}, triton {m['triton']}.",
             f"Shapes: B={B}, Hq={HQ}, Hkv={HKV}, D={D}. GB/s counts K and V bytes read once.",
             ""]  # fmt: skip
    if "cpu" in result:
        cpu = result["cpu"]
        lines += ["## CPU, torch path", "",
                  "Best of the runs; copy BW (read+write bytes) measured beside each row.", "",
                  "| dtype | T | ms (best) | ms (median) | GB/s | copy GB/s | of copy BW |",
                  "|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
        lines += [f"| {r['dtype']} | {r['T']} | {r['ms']:.2f} | {r['ms_median']:.2f} | "
                  f"{r['GBps']:.2f} | {r['copy_GBps']:.1f} | {100 * r['frac_of_copy']:.0f}% |"
                  for r in cpu["rows"]]  # fmt: skip
        lines.append("")
    if "gpu" in result:
        gpu = result["gpu"]
        peak = f"{gpu['peak_GBps']:.0f}" if gpu["peak_GBps"] else "unknown"
        lines += [f"## CUDA, bf16 (peak {peak} GB/s from {gpu['peak_source']}; "
                  f"measured copy {gpu['copy_GBps']:.0f} GB/s)", "",
                  "| impl | T | ms | GB/s | of peak | of copy |", "|---|---:|---:|---:|---:|---:|"]
        for r in gpu["rows"]:
            fp = f"{100 * r['frac_of_peak']:.0f}%" if r["frac_of_peak"] else "n/a"
            lines.append(f"| {r['impl']} | {r['T']} | {r['ms']:.4f} | {r['GBps']:.0f} | {fp} | "
                         f"{100 * r['frac_of_copy']:.0f}% |")
        worst = max(c["max_abs_err_o"] for c in gpu["checks"])
        lines += ["", f"Triton vs torch reference, worst max |Δo| over the sweep: {worst:.2e}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="T up to 64k only")
    parser.add_argument("--no-cpu", action="store_true", help="skip the CPU sweep")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    parser.add_argument("--tag", help="results file tag (default: cpu, or the GPU's name)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    result: dict = {"machine": machine_info()}
    cap = 65536 if args.quick else None
    if not args.no_cpu:
        t_cpu = [t for t in T_SWEEP if cap is None or t <= cap]
        result["cpu"] = run_cpu(t_cpu, [torch.float32, torch.bfloat16])
    tag = "cpu"
    if torch.cuda.is_available():
        result["gpu"] = run_gpu([t for t in T_SWEEP_GPU if cap is None or t <= cap])
        tag = torch.cuda.get_device_name().lower().replace(" ", "-")
    tag = args.tag or tag
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"kernels-{tag}.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / f"kernels-{tag}.md").write_text(markdown(result))
    print(f"wrote {RESULTS / f'kernels-{tag}.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
