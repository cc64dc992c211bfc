"""The CUDA half of ``benchmarks/kernels.py``: decode attention against the HBM ceiling.

One step of decode attention reads every K and V byte once, so the figure of merit is GB/s
of K+V read against the GPU's datasheet peak and against a device-to-device copy measured in
the same run (the copy counts bytes read and written). Timings are ``triton.testing.do_bench``
medians, which flush the L2 between runs, so small T is not served from the 50-60 MB L2.

- **sweep**: bf16, B=1, Hq=32, Hkv=8, D=128 (Llama 3 8B), T from 4k to 1M, for the Triton
  kernel, torch's ``scaled_dot_product_attention``, the torch reference path
  (``treeattn.kernels.reference``, what CPU runs use) and a naive repeat-and-softmax. The
  autotuner's pick is recorded per T, and the split kernel is timed alone so that the merge's
  share is visible.
- **explore**: at a few T, the kernel with its split count and block forced, to show where
  the automatic choice sits among the alternatives (the split count sets how many programs
  stream HBM at once; the block, how much each keeps in flight).
"""

from __future__ import annotations

import torch

from treeattn.kernels import partial_attention, reference

B, HQ, HKV, D = 1, 32, 8, 128
T_SWEEP = [4096, 16384, 65536, 131072, 262144, 524288, 1048576]
T_EXPLORE = [65536, 1048576]
GRAPHED = ("triton", "sdpa")  # also timed as CUDA-graph replays (device time)
NAIVE_MAX_T = 262144  # the naive path repeats K and V per query head in fp32: enough points
# Peak memory bandwidth, bytes/s, from the vendors' datasheets (treeattn/topo/hardware.py for
# H100/MI300X/4090; NVIDIA H200 datasheet: 4.8 TB/s; A100 datasheet: 2.039 TB/s for 80GB
# SXM, 1.555 for 40GB).
PEAK_BW = {
    "H200": 4.8e12, "H100 80GB HBM3": 3.35e12, "H100 SXM": 3.35e12, "H100 PCIe": 2.0e12,
    "H100 NVL": 3.9e12, "A100-SXM4-80GB": 2.039e12, "A100-SXM4-40GB": 1.555e12,
    "MI300X": 5.3e12, "RTX 4090": 1.008e12,
}  # fmt: skip


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


def fill(shape: tuple[int, ...], seed: int, dtype: torch.dtype = torch.bfloat16,
         device: str = "cuda") -> torch.Tensor:
    """A large tensor filled fast: one random 1M-element tile repeated (the values do not
    change the timing, but must be finite and not all equal). Shared with the CPU half."""
    gen = torch.Generator().manual_seed(seed)
    tile = torch.randn(1 << 20, generator=gen).to(dtype=dtype, device=device)
    out = torch.empty(shape, dtype=dtype, device=device)
    flat = out.view(-1)
    for start in range(0, flat.numel(), tile.numel()):
        n = min(tile.numel(), flat.numel() - start)
        flat[start : start + n].copy_(tile[:n])
    return out


def copy_bandwidth(do_bench, nbytes: int = 1 << 31) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write counted)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * nbytes / (do_bench(lambda: dst.copy_(src), return_mode="median") / 1e3)


def naive(q, k, v):
    g = q.shape[1] // k.shape[1]
    kr, vr = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)  # (B, Hq, T, D)
    s = torch.einsum("bhd,bhtd->bht", q.float(), kr.float()) / q.shape[-1] ** 0.5
    return torch.einsum("bht,bhtd->bhd", torch.softmax(s, -1), vr.float())


def sdpa(q, k, v):
    f = torch.nn.functional.scaled_dot_product_attention
    return f(q[:, :, None], k, v, enable_gqa=True)  # (B, Hq, 1, D)


IMPLS = {
    "triton": lambda q, k, v: partial_attention(q, k, v),
    "sdpa": sdpa,
    "torch-reference": lambda q, k, v: reference.partial_attention(q, k, v),
    "naive": naive,
}


class Recorder:
    """Times one callable with ``do_bench`` and turns it into a row for the current T."""

    def __init__(self, peak: float | None, copy_bw: float) -> None:
        from triton.testing import do_bench, do_bench_cudagraph

        self.do_bench, self.do_bench_graph = do_bench, do_bench_cudagraph
        self.peak, self.copy_bw = peak, copy_bw
        self.t, self.kv_bytes = 0, 0

    def __call__(self, name: str, fn, graph: bool = False, **extra) -> dict:
        if graph:  # replays of a captured graph: the GPU's time, no host launch in the way
            ms = self.do_bench_graph(fn, return_mode="median")
        else:  # eager launches back to back: the host's time when it is the slower side
            ms = self.do_bench(fn, return_mode="median")
        bw = self.kv_bytes / (ms / 1e3)
        frac = bw / self.peak if self.peak else None
        print(f"gpu {name:17s} T={self.t:8d} {bw / 1e9:8.1f} GB/s "
              f"({100 * frac if frac else float('nan'):.0f}% of peak) {extra or ''}", flush=True)
        return {"impl": name, "T": self.t, "kv_bytes": self.kv_bytes, "ms": ms,
                "GBps": bw / 1e9, "frac_of_peak": frac, "frac_of_copy": bw / self.copy_bw,
                **extra}  # fmt: skip


def run_gpu(t_values: list[int] | None = None, explore: bool = True) -> dict:
    from triton.testing import do_bench

    peak, peak_source = gpu_peak_bandwidth()
    copy_bw = copy_bandwidth(do_bench)
    record = Recorder(peak, copy_bw)
    out = {"rows": [], "checks": [], "explore": []}
    for t in t_values or T_SWEEP:
        _sweep_point(t, record, out, explore and t in T_EXPLORE)
    return {"shape": {"B": B, "Hq": HQ, "Hkv": HKV, "D": D, "dtype": "bf16"},
            "peak_GBps": peak / 1e9 if peak else None, "peak_source": peak_source,
            "copy_GBps": copy_bw / 1e9, "sm_count": _sms(), **out}  # fmt: skip


def _sms() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count


def _sweep_point(t: int, record: Recorder, out: dict, explore: bool) -> None:
    from treeattn.kernels import triton_partial as tp

    q, k, v = fill((B, HQ, D), 1), fill((B, HKV, t, D), 2), fill((B, HKV, t, D), 3)
    record.t, record.kv_bytes = t, 2 * k.numel() * k.element_size()
    splits, per_split = tp.num_splits_for(B, HKV, t, _sms())
    for name, fn in IMPLS.items():
        if name == "naive" and t > NAIVE_MAX_T:
            continue
        extra = {}
        if name == "triton":
            fn(q, k, v)  # autotune for this T before timing
            best = getattr(tp._tuned_kernel, "best_config", None)
            extra = {"splits": splits, "tokens_per_split": per_split,
                     "autotuned": str(best) if best is not None else None,
                     "merge_ms": _merge_ms(record, splits) if splits > 1 else 0.0}
        out["rows"].append(record(name, lambda fn=fn: fn(q, k, v), **extra))
        if name in GRAPHED:
            out["rows"].append(record(f"{name}-graph", lambda fn=fn: fn(q, k, v), graph=True))
    o, lse = partial_attention(q, k, v)
    ro, rlse = reference.partial_attention(q, k, v)
    out["checks"].append({"T": t, "max_abs_err_o": (o - ro).abs().max().item(),
                          "max_abs_err_lse": (lse - rlse).abs().max().item()})
    if explore:
        out["explore"] += _explore(tp, q, k, v, splits, record)


def _merge_ms(record: Recorder, splits: int) -> float:
    """Milliseconds of the merge kernel alone over ``splits`` partials of this shape."""
    from treeattn.kernels import triton_merge

    o = torch.randn(splits, B, HQ, D, device="cuda")  # (n, B, Hq, D)
    lse = torch.randn(splits, B, HQ, device="cuda")  # (n, B, Hq)
    return record.do_bench_graph(lambda: triton_merge.merge_stacked(o, lse),
                                 return_mode="median")


def _explore(tp, q, k, v, auto: int, record: Recorder) -> list[dict]:
    """The kernel at forced (splits, block) around the automatic split count ``auto``, timed
    as graph replays (device time)."""
    rows = []
    for splits in sorted({max(1, auto // 4), max(1, auto // 2), auto, 2 * auto, 4 * auto}):
        for block_n in (32, 64, 128):
            fn = lambda s=splits, n=block_n: tp.partial_attention(  # noqa: E731
                q, k, v, num_splits=s, block_n=n)
            rows.append(record("triton-forced", fn, graph=True, splits=splits,
                               block_n=block_n, auto_splits=auto))  # fmt: skip
    return rows


def markdown(gpu: dict) -> list[str]:
    peak = f"{gpu['peak_GBps']:.0f}" if gpu["peak_GBps"] else "unknown"
    s = gpu["shape"]
    lines = [f"## CUDA, {s['dtype']}, B={s['B']}, Hq={s['Hq']}, Hkv={s['Hkv']}, D={s['D']} "
             f"(peak {peak} GB/s from {gpu['peak_source']}; measured copy "
             f"{gpu['copy_GBps']:.0f} GB/s, {gpu['sm_count']} SMs)", "",
             "`merge ms` is the Triton merge kernel alone over that many splits (device time, "
             "part of the Triton time); `-graph` rows are CUDA-graph replays (device time), the "
             "others eager launches (host included); `torch-reference` is the path CPU runs "
             "take.", "",
             "| impl | T | ms | GB/s | of peak | of copy | splits | merge ms | autotuned |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|"]  # fmt: skip
    for r in gpu["rows"]:
        fp = f"{100 * r['frac_of_peak']:.0f}%" if r["frac_of_peak"] else "n/a"
        merge_ms = f"{r['merge_ms']:.4f}" if "merge_ms" in r else ""
        lines.append(f"| {r['impl']} | {r['T']} | {r['ms']:.4f} | {r['GBps']:.0f} | {fp} | "
                     f"{100 * r['frac_of_copy']:.0f}% | {r.get('splits', '')} | {merge_ms} | "
                     f"{r.get('autotuned') or ''} |")
    worst = max(c["max_abs_err_o"] for c in gpu["checks"])
    lines += ["", f"Triton vs the torch reference, worst max |Δo| over the sweep: {worst:.2e}."]
    if gpu["explore"]:
        lines += ["", "### Forced split counts and blocks", "",
                  "Timed as CUDA-graph replays (device time).", "",
                  "| T | splits (auto) | block | GB/s | of peak |", "|---:|---:|---:|---:|---:|"]
        for r in gpu["explore"]:
            fp = f"{100 * r['frac_of_peak']:.0f}%" if r["frac_of_peak"] else "n/a"
            lines.append(f"| {r['T']} | {r['splits']} ({r['auto_splits']}) | {r['block_n']} | "
                         f"{r['GBps']:.0f} | {fp} |")
    return lines
