"""The sharded prefills' predicted times against their measured times, on CPU ranks.

As decode is checked (``run --check``): calibrate with microbenchmarks first, then predict,
then measure, and never fit the prediction to the measurement.

1. **Calibrate** (one process, one thread, before any prefill runs):
   - the matmul rate, FLOP/s, of ``torch.matmul`` at the model's projection and
     feed-forward shapes for this many tokens per rank (best of 5);
   - the causal attention rate, FLOP/s (``4·Hq·D`` per causal query-key pair), of the
     runtime's own tiled kernel (:func:`treeattn.runtime.prefill_ring.causal_partial`) on
     rank 0's zig-zag queries over its own block of the point's layout (best of 3);
   - the read bandwidth of ``sum()`` over 256 MiB (best of 3).
   These make a :class:`~treeattn.sim.devices.HardwareModel`; messages keep the CPU
   backend's defaults (the ring hides them behind the attention here: a layer's block is a
   few MB against a second of compute).
2. **Predict** ``predict_prefill`` of the point's algorithm on ``local:ranks=W`` with that
   hardware.
3. **Measure** ``sharded_prefill`` on W gloo ranks of the local launcher, one thread each,
   random weights in the registered shape (``PrefillJob``), the slowest rank's wall time.
   A point with a cached context first builds that context's K/V in place, which an
   engine would have cached; its time (``RingStats.document_s``) is left out.

A point is ``ALGORITHM:CONTEXT:PROMPT``: pass-KV and pass-Q over a whole prompt, and pass-Q
after a long cached context (where it is the one to pick). Reported per point: predicted,
measured, the error ``|pred / meas − 1|``, and the geometric-mean error, against the
targets (≤ 25% per point, ≤ 15% geometric mean). Run:
``.venv/bin/python benchmarks/prefill_check.py [--points pass-kv:0:1024 ... --world 2]``.
Writes ``benchmarks/results/prefill_check.{json,md}``.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_io import write_results  # noqa: E402

from treeattn.runtime.launch import LaunchOptions, launch  # noqa: E402
from treeattn.runtime.prefill_ring import causal_partial  # noqa: E402
from treeattn.sim.devices import CPU_LAUNCH_S, HardwareModel  # noqa: E402
from treeattn.sim.prefill.layout import PrefillLayout, causal_pairs  # noqa: E402
from treeattn.sim.prefill.pricing import predict_prefill  # noqa: E402
from treeattn.sim.workload import ModelConfig  # noqa: E402


def _best(fn, repeats: int) -> float:
    fn()  # warm
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def matmul_rate(m: ModelConfig, tokens: int) -> float:
    """FLOP/s of the layer's matmuls for ``tokens`` rows: Q/K/V, O and the gated MLP."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, m.dim, generator=g)
    shapes = [(m.dim, m.head_dim * (m.n_heads + 2 * m.n_kv_heads)),
              (m.head_dim * m.n_heads, m.dim), (m.dim, 2 * m.ffn_dim), (m.ffn_dim, m.dim)]
    weights = [torch.randn(a, b, generator=g) for a, b in shapes]
    inputs = [x, torch.randn(tokens, m.head_dim * m.n_heads, generator=g), x,
              torch.randn(tokens, m.ffn_dim, generator=g)]

    def layer():
        for a, w in zip(inputs, weights, strict=True):
            torch.matmul(a, w)

    flops = sum(2.0 * tokens * a * b for a, b in shapes)
    return flops / _best(layer, 5)


def attention_rate(m: ModelConfig, world: int, prompt: int, context: int = 0) -> float:
    """FLOP/s of the ring's kernel: rank 0's zig-zag queries over its own block."""
    layout = PrefillLayout(world, context, prompt)
    q_pos = layout.positions(0, queries=True)
    k_pos = layout.positions(0)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, m.n_heads, len(q_pos), m.head_dim, generator=g)
    kv = torch.randn(2, 1, m.n_kv_heads, len(k_pos), m.head_dim, generator=g)
    pairs = sum(causal_pairs(a, b) for a in layout.compute(0) for b in layout.block(0))
    seconds = _best(lambda: causal_partial(q, q_pos, kv, k_pos), 3)
    return 4.0 * m.n_heads * m.head_dim * pairs / seconds


def read_bandwidth() -> float:
    x = torch.ones(64 << 20)  # 256 MiB of fp32
    return x.numel() * 4 / _best(lambda: float(x.sum()), 3)


def measure(model: str, world: int, prompt: int, algorithm: str, context: int) -> float:
    from treeattn.llm.prefill_check import PrefillJob

    segment = tuple(i % 500 + 3 for i in range(64)) if context else ()
    job = PrefillJob(model, tuple(i % 1000 + 1 for i in range(prompt)), context, segment,
                     gather_kv=False, random_shape=True, algorithm=algorithm)
    rows = launch(job, world, LaunchOptions(timeout_s=900, threads=1))
    return max(r["prefill_s"] - r["document_s"] for r in rows)


def parse_point(text: str) -> tuple[str, int, int]:
    algorithm, context, prompt = text.split(":")
    return algorithm, int(context), int(prompt)


DEFAULT_POINTS = ["pass-kv:0:1024", "pass-kv:0:2048", "pass-kv:0:4096", "pass-q:0:1024",
                  "pass-q:0:2048", "pass-q:16384:512"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--points", type=parse_point, nargs="+",
                        default=[parse_point(p) for p in DEFAULT_POINTS],
                        metavar="ALGORITHM:CONTEXT:PROMPT")
    parser.add_argument("--world", type=int, default=2)
    args = parser.parse_args()
    from treeattn.topo import Topology

    torch.set_num_threads(1)
    m = ModelConfig.from_name(args.model)
    topology = Topology.from_spec(f"local:ranks={args.world}")
    bandwidth = read_bandwidth()
    rows = []
    for algorithm, context, prompt in args.points:
        tokens = math.ceil(prompt / args.world)
        hardware = HardwareModel("cpu-calibrated", memory_bandwidth_Bps=bandwidth,
                                 peak_flops=matmul_rate(m, tokens), launch_s=CPU_LAUNCH_S,
                                 attention_flops=attention_rate(m, args.world, prompt, context))
        (pred,) = predict_prefill(topology, args.model, prompt, hardware=hardware,
                                  algorithms=(algorithm,), context=context)
        measured = measure(args.model, args.world, prompt, algorithm, context)
        rows.append({"algorithm": algorithm, "context": context, "prompt": prompt,
                     "predicted_s": pred.ttft_s, "measured_s": measured,
                     "error": abs(pred.ttft_s / measured - 1),
                     "matmul_gflops": hardware.peak_flops / 1e9,
                     "attention_gflops": hardware.attention_flops / 1e9,
                     "read_GBps": bandwidth / 1e9})
        print(f"{algorithm} context {context} prompt {prompt}: predicted {pred.ttft_s:.2f} s, "
              f"measured {measured:.2f} s", file=sys.stderr, flush=True)
    geo = math.exp(sum(math.log1p(r["error"]) for r in rows) / len(rows)) - 1
    payload = {"model": args.model, "world": args.world, "rows": rows, "geo_error": geo,
               "machine": f"{platform.processor() or platform.machine()}, "
                          f"{os.cpu_count()} cores", "load_avg": os.getloadavg(),
               "date": time.strftime("%Y-%m-%d")}
    md = [f"# Sharded prefill, predicted against measured: {args.model}, "
          f"{args.world} CPU ranks", "",
          "Calibrated first by microbenchmarks (matmul and the ring's attention kernel FLOP "
          "rates, read bandwidth), then predicted, then measured; nothing fitted. Cached: "
          "context tokens whose K/V are in the shards before the prompt's prefill.", "",
          "| algorithm | cached | prompt | predicted | measured | error | matmul GFLOP/s "
          "| attn GFLOP/s |",
          "|---|---:|---:|---:|---:|---:|---:|---:|"]
    md += [f"| {r['algorithm']} | {r['context']:,} | {r['prompt']:,} | "
           f"{r['predicted_s']:.2f} s | {r['measured_s']:.2f} s | "
           f"{100 * r['error']:.0f}% | {r['matmul_gflops']:.1f} | {r['attention_gflops']:.1f} |"
           for r in rows]
    md += ["", f"Geometric-mean error {100 * geo:.0f}% (targets: ≤ 25% per point, ≤ 15% "
               "geometric mean). Machine: " + payload["machine"] + f"; load average at the "
               f"end {payload['load_avg'][0]:.1f}; {payload['date']}.", "",
           "Command: `.venv/bin/python benchmarks/prefill_check.py --points "
           + " ".join(f"{a}:{c}:{p}" for a, c, p in args.points) + f" --world {args.world}`"]
    write_results("prefill_check", payload, "\n".join(md) + "\n")
    print("\n".join(md))
    return 0 if max(r["error"] for r in rows) <= 0.25 and geo <= 0.15 else 1


if __name__ == "__main__":
    raise SystemExit(main())
