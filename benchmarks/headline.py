"""The headline: the butterfly's margin over the strongest baseline, and where baselines win.

For a fixed grid of clusters, models, contexts and batches, plan each point (every algorithm
scored, the best of each simulated) and report the pick, treeattn's best own schedule, the
strongest baseline (the fastest of what serving systems run today) and their ratio. Nothing
here is measured: it is the simulator's prediction, so it moves when the cost model does
(the commit that changes the model says how the headline moved).

Writes ``benchmarks/results/headline.{json,md}`` (``--out NAME`` for another stem).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/headline.py
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from treeattn import atomic
from treeattn.schedule.algorithms import OWN
from treeattn.sim import DecodeWorkload, plan_workload
from treeattn.topo import Topology

OUT = Path(__file__).resolve().parent / "results"
GRID = [  # (topology, model, seq_len, batch)
    ("dgx-h100:nodes=1", "llama-3.1-8b", 131072, 1),
    ("dgx-h100:nodes=2", "llama-3.1-8b", 131072, 1),
    ("dgx-h100:nodes=4", "llama-3.1-8b", 131072, 1),
    ("dgx-h100:nodes=16", "llama-3.1-8b", 131072, 1),
    ("dgx-h100:nodes=16", "llama-3.1-8b", 1048576, 1),
    ("dgx-h100:nodes=16", "llama-3.1-8b", 131072, 8),
    ("dgx-h100:nodes=16", "llama-3.1-70b", 131072, 1),
    ("gb200-nvl72", "llama-3.1-8b", 131072, 1),
    ("dgx-a100:nodes=4", "llama-3.1-8b", 131072, 1),
    ("mi300x:nodes=2", "llama-3.1-8b", 131072, 1),
    ("pcie-4090:gpus=8", "llama-3.1-8b", 131072, 1),
]


def point(spec: str, model: str, seq_len: int, batch: int) -> dict:
    chosen = plan_workload(Topology.from_spec(spec), DecodeWorkload(model, seq_len, batch=batch),
                           simulate_each=True)
    own = min((c for c in chosen.candidates if c.algorithm in OWN), key=lambda c: c.latency_s)
    base = chosen.best_baseline()
    fly = chosen.best("butterfly")
    return {"topology": spec, "model": model, "seq_len": seq_len, "batch": batch,
            "pick": chosen.name, "pick_us": chosen.latency_s * 1e6,
            "best_own": own.name, "best_own_us": own.latency_s * 1e6,
            "butterfly_us": fly.latency_s * 1e6 if fly else None,
            "best_baseline": base.name, "best_baseline_us": base.latency_s * 1e6,
            "own_margin": base.latency_s / own.latency_s,
            "butterfly_margin": base.latency_s / fly.latency_s if fly else None,
            "refused": sorted(getattr(chosen, "refused", {}))}


def markdown(rows: list[dict]) -> str:
    lines = ["| topology | model | context | batch | pick | best own (µs) | butterfly (µs) | "
             "strongest baseline (µs) | own margin | butterfly margin | refused |",
             "|---|---|---:|---:|---|---|---:|---|---:|---:|---|"]
    for r in rows:
        lines.append(
            f"| {r['topology']} | {r['model']} | {r['seq_len']:,} | {r['batch']} | {r['pick']} | "
            f"{r['best_own']} {r['best_own_us']:.1f} | {r['butterfly_us']:.1f} | "
            f"{r['best_baseline']} {r['best_baseline_us']:.1f} | {r['own_margin']:.2f}× | "
            f"{r['butterfly_margin']:.2f}× | {', '.join(r['refused']) or '-'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="headline", help="file stem under benchmarks/results")
    args = parser.parse_args(argv)
    rows = [point(*p) for p in GRID]
    OUT.mkdir(parents=True, exist_ok=True)
    atomic.write_text(OUT / f"{args.out}.json", json.dumps({"rows": rows}, indent=1) + "\n")
    atomic.write_text(OUT / f"{args.out}.md", "# Headline: treeattn against the strongest "
                      "baseline (predicted)\n\nMargin = strongest baseline / treeattn "
                      "(>1: treeattn faster).\n\n" + markdown(rows))
    sys.stdout.write(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
