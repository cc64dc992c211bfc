"""Partial-attention throughput against the memory-bandwidth ceiling, on CPU and on CUDA.

Decode attention is memory-bound: one step reads every K and V byte once, so the figure of
merit is GB/s of K+V read against what the memory can deliver.

- CPU (always): the torch path (``treeattn.kernels.reference``) in fp32 and bf16, as K+V read
  GB/s against the read bandwidth of ``sum()`` over the same K and V, measured in the same
  process, interleaved with the kernel runs (best of each), so that the ratio is meaningful on a
  shared machine. The previous implementation (online softmax over small chunks, kept below as
  ``legacy_partial_attention`` for this comparison only) is timed the same way.
- CUDA (when available): bf16, the Triton kernel beside ``scaled_dot_product_attention`` and a
  naive torch implementation, as a fraction of the GPU's peak HBM bandwidth (datasheet) and of
  a measured device copy. Also records the Triton kernel's error against the torch reference.

CPU shapes: B=1 with Hq=Hkv=8, D=128 (MHA) and Hq=9, Hkv=3, D=64 (SmolLM2-like GQA 3:1), T from
16k to 1M. GPU shapes: B=1, Hq=32, Hkv=8, D=128, T from 4k to 1M. Writes
``benchmarks/results/kernels-<tag>.json`` and ``.md``. Run single-threaded on one core:
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

from treeattn.kernels import reference  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
B, HQ, HKV, D = 1, 32, 8, 128
# CPU configurations: (name, Hq, Hkv, D); T values per configuration.
CPU_SHAPES = [("mha-d128", 8, 8, 128), ("smollm2-gqa3", 9, 3, 64)]
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


def legacy_partial_attention(q, k, v, scale=None, kv_len=None):
    """PREVIOUS IMPLEMENTATION, kept only as the benchmark's baseline (treeattn before the
    two-pass rewrite): online softmax over chunks of 2**24 (fp32) or 2**20 (16-bit) elements
    of K, with a rescale of the running state per chunk. Not used by the package."""
    b, hq, d = q.shape
    hkv, t_total = k.shape[1], k.shape[2]
    g = hq // hkv
    scale = 1.0 / d**0.5 if scale is None else scale
    qg = q.reshape(b, hkv, g, d).to(torch.float32) * scale  # (B, Hkv, G, D)
    m = torch.full((b, hkv, g, 1), float("-inf"))  # (B, Hkv, G, 1)
    l_sum = torch.zeros(b, hkv, g, 1)  # (B, Hkv, G, 1)
    acc = torch.zeros(b, hkv, g, d)  # (B, Hkv, G, D)
    t_end = t_total
    if kv_len is not None:
        kv_len = kv_len.to(torch.int64).clamp(0, t_total)  # (B,)
        t_end = int(kv_len.max().item()) if b > 0 else 0
    budget = (1 << 24) if k.dtype == torch.float32 else (1 << 20)
    chunk = max(256, budget // max(1, b * hkv * d))
    bufs = None
    if k.dtype != torch.float32 and t_end > 0:
        shape = (b, hkv, min(chunk, t_end), d)
        bufs = (torch.empty(shape), torch.empty(shape))
    safe = lambda x: torch.where(torch.isneginf(x), torch.zeros_like(x), x)  # noqa: E731
    for c0 in range(0, t_end, chunk):
        c1 = min(c0 + chunk, t_end)
        kc, vc = k[:, :, c0:c1], v[:, :, c0:c1]  # (B, Hkv, t, D)
        if bufs is not None:
            kc = bufs[0][:, :, : c1 - c0].copy_(kc)
            vc = bufs[1][:, :, : c1 - c0].copy_(vc)
        s = torch.matmul(qg, kc.transpose(-1, -2))  # (B, Hkv, G, t)
        if kv_len is not None:
            pos = torch.arange(c0, c1)  # (t,)
            s.masked_fill_((pos[None, :] >= kv_len[:, None])[:, None, None, :], float("-inf"))
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))  # (B, Hkv, G, 1)
        m_safe = safe(m_new)
        p = s.sub_(m_safe).exp_()  # (B, Hkv, G, t)
        alpha = torch.exp(m - m_safe)  # (B, Hkv, G, 1)
        l_sum = l_sum * alpha + p.sum(-1, keepdim=True)
        acc = acc * alpha + torch.matmul(p, vc)  # (B, Hkv, G, D)
        m = m_new
    nonempty = l_sum > 0
    o = torch.where(nonempty, acc / torch.where(nonempty, l_sum, 1.0), 0.0)
    lse = torch.where(nonempty, safe(m) + torch.log(l_sum), float("-inf"))
    return o.reshape(b, hq, d), lse.reshape(b, hq)


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
    new, old = reference.partial_attention(q, k, v), legacy_partial_attention(q, k, v)
    err = max((new[0] - old[0]).abs().max().item(), (new[1] - old[1]).abs().max().item())
    timed = _time_interleaved({
        "sum": lambda: (k.sum(), v.sum()),
        "kernel": lambda: reference.partial_attention(q, k, v),
        "legacy": lambda: legacy_partial_attention(q, k, v),
    }, reps)  # fmt: skip
    bw = {key: kv_bytes / x["best"] / 1e9 for key, x in timed.items()}
    cpu_bw = {key: kv_bytes / x["cpu"] / 1e9 for key, x in timed.items()}
    row = {
        "config": name, "dtype": str(dtype).removeprefix("torch."), "Hq": hq, "Hkv": hkv,
        "D": d, "T": t, "kv_bytes": kv_bytes, "reps": reps,
        "ms": timed["kernel"]["best"] * 1e3, "ms_median": timed["kernel"]["median"] * 1e3,
        "GBps": bw["kernel"], "sum_GBps": bw["sum"], "frac_of_sum": bw["kernel"] / bw["sum"],
        "legacy_ms": timed["legacy"]["best"] * 1e3, "legacy_GBps": bw["legacy"],
        "legacy_frac_of_sum": bw["legacy"] / bw["sum"],
        "speedup": timed["legacy"]["best"] / timed["kernel"]["best"],
        "cpu_time_frac_of_sum": cpu_bw["kernel"] / cpu_bw["sum"],
        "legacy_cpu_time_frac_of_sum": cpu_bw["legacy"] / cpu_bw["sum"],
        "max_abs_diff_vs_legacy": err,
    }  # fmt: skip
    print(f"cpu {name:12s} {row['dtype']:8s} T={t:8d} {bw['kernel']:6.2f} GB/s "
          f"({100 * row['frac_of_sum']:.0f}% of sum {bw['sum']:.1f}); legacy "
          f"{bw['legacy']:.2f} ({100 * row['legacy_frac_of_sum']:.0f}%); CPU-time ratios "
          f"{100 * row['cpu_time_frac_of_sum']:.0f}% vs "
          f"{100 * row['legacy_cpu_time_frac_of_sum']:.0f}%", flush=True)  # fmt: skip
    return row


def markdown(result: dict) -> str:
    m = result["machine"]
    lines = ["# Partial attention throughput", "",
             f"Machine: {m['cpu']} ({m['cpu_count']} CPUs, torch threads {m['torch_threads']}),"
             f" {m.get('gpu', 'no GPU')}; torch {m['torch']}, triton {m['triton']}.",
             f"B={B}. GB/s counts K and V bytes read once.",
             ""]  # fmt: skip
    if "cpu" in result:
        lines += ["## CPU, torch path (two-pass) vs the previous online-softmax loop", "",
                  "Best of the runs, cold caches. `sum` is the read bandwidth of `sum()` over the "
                  "same K and V, measured in the same process interleaved with both kernels; the "
                  "ratios are the figures to compare (absolute GB/s vary with the machine's "
                  "load). The CPU-time ratios use the thread's CPU time instead of wall time "
                  "(robust to being descheduled on a shared core).", "",
                  "| config | dtype | Hq/Hkv | D | T | ms | GB/s | sum GB/s | of sum | "
                  "previous GB/s | previous of sum | speedup | of sum (CPU time) | "
                  "previous of sum (CPU time) |",
                  "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        lines += [f"| {r['config']} | {r['dtype']} | {r['Hq']}/{r['Hkv']} | {r['D']} | {r['T']} | "
                  f"{r['ms']:.2f} | {r['GBps']:.2f} | {r['sum_GBps']:.2f} | "
                  f"{100 * r['frac_of_sum']:.0f}% | {r['legacy_GBps']:.2f} | "
                  f"{100 * r['legacy_frac_of_sum']:.0f}% | {r['speedup']:.2f}x | "
                  f"{100 * r['cpu_time_frac_of_sum']:.0f}% | "
                  f"{100 * r['legacy_cpu_time_frac_of_sum']:.0f}% |"
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
