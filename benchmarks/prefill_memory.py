"""Peak memory per rank during the sharded prefill, against the shard it ends with.

For each point, ``world`` local CPU ranks (gloo, one torch thread each) run
:func:`treeattn.llm.prefill.sharded_prefill` on a model with seeded random weights in a
registered shape (default SmolLM2-135M's: 30 layers, 3 KV heads of 64, fp32). Each rank
reports the growth of its resident set during the prefill: ``VmHWM`` (reset through
``/proc/self/clear_refs`` just before) minus ``VmRSS`` before, with every weight page
faulted in beforehand so that only the prefill's own allocations count. Beside it: the shard
the rank ends with (all layers), the estimate :func:`treeattn.llm.prefill.prefill_bytes` states
(shard + 3 ring blocks of one layer + the activations of its queries), and the whole cache,
which the replicated prefill this replaces held on every rank. The replicated prefill is also
measured, in a fresh process of its own (one rank's work under the old path).

Points: a long repeated-document context with a short prompt (``--context-tokens`` mode, the
K/V of the document built per shard; pass-KV passes them round the ring, pass-Q passes the
prompt's queries instead), and a prompt-only prefill (every token through the model, zig-zag
chunks).

Run: ``.venv/bin/python benchmarks/prefill_memory.py [--world 4] [--shape smollm2-135m]``.
Writes ``benchmarks/results/prefill_memory.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from results_io import write_results  # noqa: E402

from treeattn import testbed  # noqa: E402
from treeattn.llm.model import LlamaConfig  # noqa: E402
from treeattn.llm.prefill import prefill_bytes  # noqa: E402
from treeattn.llm.prefill_check import PrefillJob  # noqa: E402
from treeattn.runtime.launch import LaunchOptions, launch  # noqa: E402
from treeattn.testbed.calibration.calibrate import machine_info  # noqa: E402

MIB = 2**20


def _tokens(n: int, seed: int) -> tuple[int, ...]:
    return tuple((seed * 7919 + 31 * i) % 256 for i in range(n))


def run_point(shape: str, world: int, context: int, n_prompt: int, replicated: bool,
              algorithm: str = "pass-kv") -> dict:
    config = LlamaConfig.from_name(shape)
    prompt, segment = _tokens(n_prompt, 1), _tokens(64, 2) if context else ()
    job = PrefillJob(shape, prompt, context, segment, gather_kv=False, random_shape=True,
                     algorithm=algorithm)
    everyone = launch(job, world, LaunchOptions(timeout_s=600, threads=1))
    estimate = prefill_bytes(config, context, n_prompt, world, 4, algorithm=algorithm)
    whole = (context + n_prompt) * config.n_layers * 2 * config.n_kv_heads * config.head_dim * 4
    ranks = []
    for out in everyone:
        growth = out["peak_rss_bytes"] - out["rss_before_bytes"]
        ranks.append({"rank": out["rank"], "shard_bytes": out["shard_bytes"],
                      "peak_growth_bytes": growth,
                      "peak_over_shard": growth / out["shard_bytes"],
                      "ring_peak_block_bytes": out["peak_block_bytes"],
                      "bytes_sent": out["bytes_sent"], "prefill_s": out["prefill_s"]})
    point = {"shape": shape, "world": world, "algorithm": algorithm,
             "context_tokens": context, "prompt_tokens": n_prompt,
             "estimate_bytes": estimate, "estimate_total_bytes": sum(estimate.values()),
             "whole_cache_bytes": whole, "ranks": ranks,
             "max_peak_growth_bytes": max(r["peak_growth_bytes"] for r in ranks)}
    if replicated:  # one fresh process doing what every rank of the old path did
        old = launch(PrefillJob(shape, prompt, context, segment, gather_kv=False,
                                random_shape=True, replicated=True), 1,
                     LaunchOptions(timeout_s=600, threads=1))[0]
        point["replicated_peak_growth_bytes"] = old["peak_rss_bytes"] - old["rss_before_bytes"]
    return point


def markdown(points: list[dict], info: dict) -> str:
    lines = ["# Sharded prefill: peak memory per rank against its shard", "",
             "Measured by `benchmarks/prefill_memory.py` on a shared CPU host "
             f"({info.get('cpu', 'cpu')}, other jobs running): random weights in the "
             "registered shape, fp32, gloo ranks with one thread each. *growth*: peak resident "
             "set during the prefill minus the resident set before (weights already in). "
             "*estimate*: shard + what travels (pass-KV: 3 ring blocks of one layer; pass-Q: "
             "its own block, 2 query blocks, 3 partials and one layer's incoming prompt K/V) + "
             "the queries' activations (`prefill_bytes`, what `generate` checks against free "
             "memory before starting). "
             "*whole cache*: what every rank of the replaced replicated "
             "prefill held.", "",
             "| shape | world | algorithm | context + prompt | shard / rank | peak growth (max "
             "rank) | growth / shard | estimate | whole cache | replicated growth (measured) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for p in points:
        shard = max(r["shard_bytes"] for r in p["ranks"])
        ratio = max(r["peak_over_shard"] for r in p["ranks"])
        rep = p.get("replicated_peak_growth_bytes")
        lines.append(
            f"| {p['shape']} | {p['world']} | {p.get('algorithm', 'pass-kv')} | "
            f"{p['context_tokens']} + {p['prompt_tokens']} | "
            f"{shard / MIB:.1f} MiB | {p['max_peak_growth_bytes'] / MIB:.1f} MiB | "
            f"{ratio:.2f} | {p['estimate_total_bytes'] / MIB:.1f} MiB | "
            f"{p['whole_cache_bytes'] / MIB:.1f} MiB | "
            f"{'n/a' if rep is None else f'{rep / MIB:.1f} MiB'} |")
    lines += ["", "Per rank (growth MiB / shard MiB):", ""]
    for p in points:
        cells = ", ".join(f"r{r['rank']} {r['peak_growth_bytes'] / MIB:.1f}/"
                          f"{r['shard_bytes'] / MIB:.1f}" for r in p["ranks"])
        lines.append(f"- {p.get('algorithm', 'pass-kv')}, {p['context_tokens']} + "
                     f"{p['prompt_tokens']}: {cells}")
    return "\n".join(lines) + "\n"


def main() -> None:
    testbed.plug_in()  # CPU ranks of one host: the transport `treeattn run` uses
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--shape", default="smollm2-135m")
    parser.add_argument("--points", default="32768:128,32768:128:pass-q,0:1024,0:4096",
                        help="context:prompt[:algorithm] points, comma-separated")
    parser.add_argument("--no-replicated", action="store_true",
                        help="skip measuring the replicated prefill in this process")
    args = parser.parse_args()
    points = []
    for item in args.points.split(","):
        context, n_prompt, *alg = item.split(":")
        algorithm = alg[0] if alg else "pass-kv"
        points.append(run_point(args.shape, args.world, int(context), int(n_prompt),
                                not args.no_replicated and algorithm == "pass-kv", algorithm))
        print(f"{item}: max growth {points[-1]['max_peak_growth_bytes'] / MIB:.1f} MiB, "
              f"shard {max(r['shard_bytes'] for r in points[-1]['ranks']) / MIB:.1f} MiB",
              flush=True)
    info = machine_info()
    out = write_results("prefill_memory", {"points": points, "machine": info},
                        markdown(points, info))
    print(f"wrote {out}/prefill_memory.json and .md")


if __name__ == "__main__":
    main()
