"""Does each CPU kernel path earn its place? Each against the path that would run without it.

``treeattn.kernels`` dispatches a CPU call down a chain: partial attention goes to the numpy
path (``small``) for tiny shards, to the C kernel (``native``) for dense fp32/bf16 KV on one
thread, to torch's fused kernel (``fused``) for other dense half-precision KV, and to the
exact torch reference (``exact``) for the rest; merges go to the C kernel, then numpy, then
torch. A path is worth its code only where it beats the path that would take its calls if it
were removed, by at least :data:`KEEP_RATIO`, on a shape the project runs. This benchmark
times exactly those pairs on such shapes (SmolLM2-135M: 9/3 heads, D 64; Llama-3-8B: 32/8
heads, D 128; Llama-3.1-405B under TP 8: 16/1 heads, D 128; the merges of their partials),
each pair interleaved in the same process, one thread, median CPU time of repeated batches,
and writes
``benchmarks/results/kernel_paths.{json,md}`` with the ratio and a verdict per pair.

Run: ``taskset -c 1 .venv/bin/python benchmarks/kernel_paths.py``.
"""

from __future__ import annotations

import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from treeattn.kernels import partial_attention_path, reference  # noqa: E402
from treeattn.testbed.kernels import cpu_fused, cpu_native, cpu_small  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
KEEP_RATIO = 1.2  # a path stays only where it is at least 1.2x faster than the next
REPEATS, MIN_BATCH_S = 9, 0.02


def _attention_inputs(hq: int, hkv: int, d: int, t: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, hq, d, generator=g).to(dtype)  # (B, Hq, D)
    k = torch.randn(1, hkv, t, d, generator=g).to(dtype)  # (B, Hkv, T, D)
    v = torch.randn(1, hkv, t, d, generator=g).to(dtype)
    return q, k, v, d ** -0.5


def _merge_inputs(hq: int, d: int):
    g = torch.Generator().manual_seed(1)
    part = lambda: (torch.randn(1, hq, d, generator=g), torch.randn(1, hq, generator=g))  # noqa: E731
    return part(), part()


def _kern():
    kern = cpu_native.kernel()
    if kern is None:
        raise SystemExit(f"error: the C kernel is unavailable: {cpu_native.unavailable_reason()}")
    return kern


def _paths(kern) -> dict:
    """Callables by path name, for attention (q, k, v, scale) and merges (a, b)."""
    return {
        "attention": {
            "small": lambda q, k, v, s: cpu_small.partial_attention_small(q, k, v, s),
            "native": lambda q, k, v, s: cpu_native.partial_attention_native(kern, q, k, v, s),
            "fused": lambda q, k, v, s: cpu_fused.partial_attention_fused(q, k, v, s),
            "exact": lambda q, k, v, s: reference.partial_attention_checked(q, k, v, s, None),
        },
        "merge": {
            "native": lambda a, b: cpu_native.merge_native(kern, a, b),
            "small": lambda a, b: cpu_small.merge_small(a, b),
            "exact": lambda a, b: reference.merge(a, b),
        },
    }


# (what, shape name, path, next path, input builder); each shape is one the project runs.
CASES = [
    ("attention", "smollm2 shard of 16 tokens, fp32", "small", "native",
     lambda: _attention_inputs(9, 3, 64, 16, torch.float32)),
    ("attention", "smollm2 shard of 64 tokens, fp32", "small", "native",
     lambda: _attention_inputs(9, 3, 64, 64, torch.float32)),
    ("attention", "llama-3-8b shard of 32 tokens, fp32", "small", "native",
     lambda: _attention_inputs(32, 8, 128, 32, torch.float32)),
    ("attention", "smollm2 shard of 16 tokens, fp32, no C compiler", "small", "exact",
     lambda: _attention_inputs(9, 3, 64, 16, torch.float32)),
    ("attention", "llama-3-8b shard of 32 tokens, fp32, no C compiler", "small", "exact",
     lambda: _attention_inputs(32, 8, 128, 32, torch.float32)),
    ("attention", "smollm2 shard of 16k tokens, fp32", "native", "exact",
     lambda: _attention_inputs(9, 3, 64, 16384, torch.float32)),
    ("attention", "smollm2 shard of 16k tokens, bf16", "native", "fused",
     lambda: _attention_inputs(9, 3, 64, 16384, torch.bfloat16)),
    ("attention", "llama-3-8b shard of 16k tokens, fp32", "native", "exact",
     lambda: _attention_inputs(32, 8, 128, 16384, torch.float32)),
    ("attention", "llama-3-8b shard of 16k tokens, bf16", "native", "fused",
     lambda: _attention_inputs(32, 8, 128, 16384, torch.bfloat16)),
    ("attention", "llama-3.1-405b tp8 (G=16) shard of 16k tokens, bf16", "fused", "exact",
     lambda: _attention_inputs(16, 1, 128, 16384, torch.bfloat16)),
    ("attention", "llama-3.1-405b tp8 (G=16) shard of 16k tokens, fp32", "fused", "exact",
     lambda: _attention_inputs(16, 1, 128, 16384, torch.float32)),
    ("attention", "smollm2 shard of 16k tokens, fp16", "fused", "exact",
     lambda: _attention_inputs(9, 3, 64, 16384, torch.float16)),
    ("merge", "smollm2 partials (9 x 64)", "native", "small", lambda: _merge_inputs(9, 64)),
    ("merge", "llama-3-8b partials (32 x 128)", "native", "small",
     lambda: _merge_inputs(32, 128)),
    ("merge", "smollm2 partials (9 x 64), no C compiler", "small", "exact",
     lambda: _merge_inputs(9, 64)),
    ("merge", "llama-3-8b partials (32 x 128), no C compiler", "small", "exact",
     lambda: _merge_inputs(32, 128)),
]


def _per_call_s(fn, args, batch: int) -> float:
    """CPU seconds of this thread per call: robust to being descheduled on a shared core,
    which wall time is not (every path here runs on the calling thread)."""
    t0 = time.thread_time()
    for _ in range(batch):
        fn(*args)
    return (time.thread_time() - t0) / batch


def time_pair(fa, fb, args) -> tuple[float, float]:
    """Median per-call seconds of ``fa`` and ``fb``, batches interleaved a, b, a, b, ..."""
    fa(*args), fb(*args)  # warm up (and the first-call costs of both)
    batch = 1
    while _per_call_s(fa, args, batch) * batch < MIN_BATCH_S and batch < 1 << 16:
        batch *= 2
    ta, tb = [], []
    for _ in range(REPEATS):
        ta.append(_per_call_s(fa, args, batch))
        tb.append(_per_call_s(fb, args, batch))
    return statistics.median(ta), statistics.median(tb)


def run() -> dict:
    torch.set_num_threads(1)
    kern = _kern()
    paths = _paths(kern)
    rows = []
    for what, shape, path, nxt, build in CASES:
        args = build()
        # what `auto` dispatch runs for this shape today (the chain without the C kernel is
        # TREEATTN_KERNEL=fused, or a machine without a compiler)
        dispatched = partial_attention_path(*args[:3]) if what == "attention" else "-"
        a, b = time_pair(paths[what][path], paths[what][nxt], args)
        rows.append({"what": what, "shape": shape, "path": path, "next": nxt,
                     "auto_dispatch": dispatched,
                     "path_us": a * 1e6, "next_us": b * 1e6, "speedup": b / a,
                     "keep": b / a >= KEEP_RATIO})
        print(f"{what:9} {shape:52} {path:6} {a * 1e6:10.1f} us  {nxt:6} {b * 1e6:10.1f} us  "
              f"{b / a:5.2f}x", flush=True)
    return {"machine": {"python": platform.python_version(), "torch": torch.__version__,
                        "platform": platform.platform(), "threads": 1,
                        "native_lanes": kern.lanes,
                        "date": time.strftime("%Y-%m-%d", time.gmtime())},
            "keep_ratio": KEEP_RATIO, "rows": rows}


def markdown(result: dict) -> str:
    m = result["machine"]
    lines = ["# CPU kernel paths, each against the path that would run without it", "",
             f"Machine: {m['platform']}, one torch thread, C kernel lanes {m['native_lanes']}; "
             f"torch {m['torch']}; {m['date']}. Median CPU time per call of {REPEATS} "
             f"interleaved batches. A path is kept where it is at least "
             f"{result['keep_ratio']}x faster than the next one on a shape the project runs.", "",
             "| call | shape | path | µs | next path | µs | speedup | ≥ keep ratio | auto runs |",
             "|---|---|---|---:|---|---:|---:|---|---|"]
    lines += [f"| {r['what']} | {r['shape']} | {r['path']} | {r['path_us']:.1f} | {r['next']} | "
              f"{r['next_us']:.1f} | {r['speedup']:.2f}x | {'yes' if r['keep'] else 'no'} | "
              f"{r['auto_dispatch']} |"
              for r in result["rows"]]
    return "\n".join(lines) + "\n"


def main() -> int:
    result = run()
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "kernel_paths.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / "kernel_paths.md").write_text(markdown(result))
    print(f"wrote {RESULTS / 'kernel_paths.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
