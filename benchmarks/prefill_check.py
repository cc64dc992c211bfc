"""The sharded prefills' predicted times against their measured times, on CPU ranks.

As decode is checked (``run --check``): calibrate with microbenchmarks first, then predict,
then measure, and never fit the prediction to the measurement.

1. **Calibrate** (:class:`treeattn.llm.prefill_rates.PrefillRates`, before the prefill):
   every rank, at the same time as the others and one thread each, measures its matmul rate
   at the layer's shapes for its query tokens, the causal attention rate of the runtime's
   own tiled kernel over exactly the (query block, key block) pairs it will attend under
   the point's algorithm (random data), and its read bandwidth. These make one
   :class:`~treeattn.sim.devices.HardwareModel` per rank; messages keep the CPU backend's
   defaults (a layer's blocks are a few MB against tens of milliseconds of compute).
2. **Predict** ``predict_prefill`` of the point's algorithm on ``local:ranks=W`` with those
   hardware models.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_io import write_results  # noqa: E402

from treeattn import testbed  # noqa: E402
from treeattn.llm.prefill_rates import PrefillRates, hardware_models  # noqa: E402
from treeattn.runtime.launch import LaunchOptions, launch  # noqa: E402
from treeattn.sim.prefill.pricing import predict_prefill  # noqa: E402


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
    testbed.plug_in()  # CPU ranks of one host: the transport `treeattn run` uses
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--points", type=parse_point, nargs="+",
                        default=[parse_point(p) for p in DEFAULT_POINTS],
                        metavar="ALGORITHM:CONTEXT:PROMPT")
    parser.add_argument("--world", type=int, default=2)
    args = parser.parse_args()
    from treeattn.topo import Topology

    topology = Topology.from_spec(f"local:ranks={args.world}")
    rows = []
    for algorithm, context, prompt in args.points:
        rates = launch(PrefillRates(args.model, context, prompt, algorithm), args.world,
                       LaunchOptions(timeout_s=900, threads=1))
        hardware = hardware_models(rates)
        (pred,) = predict_prefill(topology, args.model, prompt, hardware=hardware,
                                  algorithms=(algorithm,), context=context)
        measured = measure(args.model, args.world, prompt, algorithm, context)
        rows.append({"algorithm": algorithm, "context": context, "prompt": prompt,
                     "predicted_s": pred.ttft_s, "measured_s": measured,
                     "error": abs(pred.ttft_s / measured - 1),
                     "matmul_gflops": min(h.peak_flops for h in hardware) / 1e9,
                     "attention_gflops": min(h.attention_flops for h in hardware) / 1e9,
                     "read_GBps": min(h.memory_bandwidth_Bps for h in hardware) / 1e9,
                     "rates": rates})
        print(f"{algorithm} context {context} prompt {prompt}: predicted {pred.ttft_s:.2f} s, "
              f"measured {measured:.2f} s", file=sys.stderr, flush=True)
    geo = math.exp(sum(math.log1p(r["error"]) for r in rows) / len(rows)) - 1
    payload = {"model": args.model, "world": args.world, "rows": rows, "geo_error": geo,
               "machine": f"{platform.processor() or platform.machine()}, "
                          f"{os.cpu_count()} cores", "load_avg": os.getloadavg(),
               "date": time.strftime("%Y-%m-%d")}
    md = [f"# Sharded prefill, predicted against measured: {args.model}, "
          f"{args.world} CPU ranks", "",
          "Calibrated first by microbenchmarks on the ranks, all at once (matmul and the "
          "ring's attention kernel FLOP rates on each rank's own shapes, read bandwidth), "
          "then predicted, then measured; nothing fitted. Cached: context tokens whose K/V "
          "are in the shards before the prompt's prefill. GFLOP/s: the slowest rank's.", "",
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
