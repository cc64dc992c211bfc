"""How fast the planner and simulator are on very large clusters.

Times ``plan_workload(topology, workload)`` (closed-form scoring of every candidate, then
simulating the promising ones with the simpy engine) on ``dgx-h100:nodes=128`` (1024 GPUs,
target < 1 s) and ``dgx-h100:nodes=2048`` (16384 GPUs, target < 30 s), one decode step of
llama-3.1-8b at 1M tokens. Building the topology is timed separately (it is the topology
package's work). Writes ``benchmarks/results/sim_scale.{json,md}``.

    .venv/bin/python benchmarks/sim_scale.py [--nodes 128 2048]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import networkx
import numpy
import simpy

from treeattn.sim import DecodeWorkload, plan_workload
from treeattn.topo import Topology

OUT = Path(__file__).resolve().parent / "results"
TARGET_S = {128: 1.0, 2048: 30.0}


def measure(nodes: int, model: str, seq_len: int) -> dict:
    t0 = time.perf_counter()
    topo = Topology.from_spec(f"dgx-h100:nodes={nodes}")
    t1 = time.perf_counter()
    chosen = plan_workload(topo, DecodeWorkload(model, seq_len))
    t2 = time.perf_counter()
    simulated = [c for c in chosen.candidates if c.method == "simulated"]
    ring = chosen.best("ring")
    return {
        "topology": f"dgx-h100:nodes={nodes}", "gpus": topo.num_gpus, "model": model,
        "seq_len": seq_len, "topology_build_s": t1 - t0, "plan_s": t2 - t1,
        "target_s": TARGET_S.get(nodes), "candidates": len(chosen.candidates),
        "simulated": [c.name for c in simulated], "winner": chosen.name,
        "winner_method": chosen.prediction.method, "latency_s": chosen.latency_s,
        "winner_sim_over_closed_form": chosen.latency_s / chosen.winner.bound_s,
        "ring_latency_s": ring.latency_s, "ring_method": ring.method,
        "speedup_vs_ring": ring.latency_s / chosen.latency_s,
    }


def machine() -> dict:
    return {
        "python": sys.version.split()[0], "platform": platform.platform(),
        "cpu_count": os.cpu_count(), "load_average": os.getloadavg(),
        "numpy": numpy.__version__, "simpy": simpy.__version__,
        "networkx": networkx.__version__,
    }


def markdown(rows: list[dict], info: dict) -> str:
    lines = [
        "# sim_scale: plan + simulate one decode step",
        "",
        f"Machine: {info['platform']}, {info['cpu_count']} CPUs, load average "
        f"{info['load_average'][0]:.1f} (shared machine), Python {info['python']}, "
        f"simpy {info['simpy']}.",
        "",
        "| topology | GPUs | topology build | plan (incl. simulation) | target | simulated "
        "| winner | latency/layer | ring/winner |",
        "|---|---:|---:|---:|---:|---|---|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['topology']} | {r['gpus']} | {r['topology_build_s']:.2f} s "
            f"| {r['plan_s']:.2f} s | {r['target_s']} s | {', '.join(r['simulated']) or '-'} "
            f"| {r['winner']} ({r['winner_method']}) | {r['latency_s'] * 1e6:.1f} µs "
            f"| {r['speedup_vs_ring']:.0f}× |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[128, 2048])
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--seq-len", type=int, default=1 << 20)
    args = parser.parse_args()
    rows = [measure(n, args.model, args.seq_len) for n in args.nodes]
    info = machine()
    OUT.mkdir(exist_ok=True)
    (OUT / "sim_scale.json").write_text(json.dumps({"machine": info, "rows": rows}, indent=1))
    (OUT / "sim_scale.md").write_text(markdown(rows, info))
    print(markdown(rows, info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
