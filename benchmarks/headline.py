"""The headline: treeattn's own schedules against the strongest baseline, on a wide grid.

For every point of a grid of clusters, models, tensor-parallel sizes, batches and contexts,
plan the point with every algorithm simulated (``plan_workload(..., simulate_each=True)``)
and report:
the pick, treeattn's best own schedule, the strongest baseline (the fastest of what serving
systems run today, on its engine's wire format and transports), their ratio, and in words why
the winner wins. Only simulated times are compared, never an unsimulated closed-form bound.
Nothing here is measured: it is the simulator's prediction, so it moves when the cost model
does (the commit that changes the model says how the headline moved).

Writes ``benchmarks/results/headline.{json,md,png}`` (``--out NAME`` for another stem).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/headline.py          # the whole grid
    PYTHONPATH=$PWD .venv/bin/python benchmarks/headline.py --limit 5
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from treeattn import atomic
from treeattn.schedule.algorithms import OWN
from treeattn.sim import DecodeWorkload, SimError, plan_workload
from treeattn.topo import Topology

OUT = Path(__file__).resolve().parent / "results"
K, M = 1024, 1024 * 1024
CLUSTERS = [
    "dgx-h100:nodes=1", "dgx-h100:nodes=2", "dgx-h100:nodes=4", "dgx-h100:nodes=16",
    "dgx-h100:nodes=128", "dgx-a100:nodes=4", "dgx-b200:nodes=4", "gb200-nvl72",
    "gb200-nvl72:racks=2", "mi300x:nodes=1", "mi300x:nodes=2", "pcie-4090:gpus=8",
]
# (model, tp, batch, context) at every cluster: a context and batch sweep on the 8B model with
# every GPU a context-parallel rank, then the larger models under tensor parallelism.
POINTS = [
    ("llama-3.1-8b", 1, 1, 32 * K), ("llama-3.1-8b", 1, 1, 128 * K),
    ("llama-3.1-8b", 1, 1, 1 * M), ("llama-3.1-8b", 1, 8, 128 * K),
    ("llama-3.1-8b", 1, 64, 128 * K), ("llama-3.1-70b", 1, 1, 128 * K),
    ("llama-3.1-70b", 8, 1, 128 * K), ("llama-3.1-70b", 8, 8, 128 * K),
    ("llama-3.1-405b", 8, 1, 128 * K), ("llama-3.1-405b", 8, 1, 1 * M),
]
TIE = 0.02  # margins within 2% are called a tie: below the model's own resolution


def grid() -> list[tuple[str, str, int, int, int]]:
    return [(spec, model, tp, batch, ctx) for spec in CLUSTERS
            for model, tp, batch, ctx in POINTS]


def simulated_best(chosen, algorithms) -> object | None:
    """The fastest *simulated* candidate among ``algorithms`` (None if none was simulated)."""
    pool = [c for c in chosen.candidates
            if c.algorithm in algorithms and c.result is not None]
    return min(pool, key=lambda c: c.latency_s, default=None)


def reason(topology: Topology, tp: int, margin: float, own, base) -> str:
    """Why the winner wins, from the point's structure (not from the numbers alone)."""
    hosts = len(topology.hosts)
    cp_hosts = hosts if tp == 1 else min(hosts, topology.num_gpus // tp)
    if margin > 1 + TIE:
        if own.algorithm == "hier":
            return (f"two levels: one step inside each host, then one partial per host over a "
                    f"{cp_hosts}-host rail")
        return f"{own.algorithm} beats the one-level collectives here"
    if margin >= 1 - TIE:
        return "tie"
    if hosts == 1:
        return "one NVLink/xGMI domain: a single one-shot collective is the floor"
    if tp > 1 and topology.num_gpus // tp <= hosts:
        return "one GPU per host in the context-parallel group: no node level to exploit"
    return f"{base.algorithm} on {base.transport} is cheaper at this size"


def point(spec: str, model: str, tp: int, batch: int, ctx: int) -> dict:
    topology = Topology.from_spec(spec)
    row = {"topology": spec, "model": model, "tp": tp, "batch": batch, "seq_len": ctx}
    if topology.num_gpus // tp < 2:
        return row | {"skipped": f"TP{tp} leaves one context-parallel rank"}
    try:
        chosen = plan_workload(topology, DecodeWorkload(model, ctx, batch=batch, tp=tp),
                      simulate_each=True)
    except SimError as exc:
        return row | {"skipped": str(exc)}
    own, base = simulated_best(chosen, OWN), simulated_best(
        chosen, {c.algorithm for c in chosen.candidates} - set(OWN))
    if own is None or base is None:
        return row | {"skipped": "no simulated own schedule or baseline"}
    margin = base.latency_s / own.latency_s
    return row | {"pick": chosen.name, "pick_us": chosen.latency_s * 1e6,
                  "best_own": own.name, "best_own_us": own.latency_s * 1e6,
                  "best_baseline": base.name, "best_baseline_us": base.latency_s * 1e6,
                  "own_margin": margin, "why": reason(topology, tp, margin, own, base)}


def markdown(rows: list[dict]) -> str:
    lines = ["| topology | model | TP | batch | context | pick | best own (µs) | "
             "strongest baseline (µs) | own margin | why |",
             "|---|---|---:|---:|---:|---|---|---|---:|---|"]
    for r in rows:
        head = (f"| {r['topology']} | {r['model']} | {r['tp']} | {r['batch']} | "
                f"{r['seq_len'] // K:,}k |")
        if "skipped" in r:
            lines.append(f"{head} - | - | - | - | skipped: {r['skipped']} |")
            continue
        lines.append(f"{head} {r['pick']} | {r['best_own']} {r['best_own_us']:.1f} | "
                     f"{r['best_baseline']} {r['best_baseline_us']:.1f} | "
                     f"{r['own_margin']:.2f}× | {r['why']} |")
    return "\n".join(lines) + "\n"


def summary(rows: list[dict]) -> str:
    """Per cluster: points, own wins, ties, baseline wins, and the margin range."""
    lines = ["| topology | points | own wins | ties | baseline wins | margin range |",
             "|---|---:|---:|---:|---:|---|"]
    for spec in CLUSTERS:
        done = [r for r in rows if r["topology"] == spec and "own_margin" in r]
        if not done:
            continue
        margins = [r["own_margin"] for r in done]
        wins = sum(m > 1 + TIE for m in margins)
        losses = sum(m < 1 - TIE for m in margins)
        lines.append(f"| {spec} | {len(done)} | {wins} | {len(done) - wins - losses} | "
                     f"{losses} | {min(margins):.2f}–{max(margins):.2f}× |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    """The own margin of every point, one column per cluster (log scale, 1× marked)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator

    specs = [s for s in CLUSTERS if any(r["topology"] == s and "own_margin" in r for r in rows)]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    for i, spec in enumerate(specs):
        for r in rows:
            if r["topology"] == spec and "own_margin" in r:
                colour = "tab:green" if r["own_margin"] > 1 + TIE else (
                    "tab:grey" if r["own_margin"] >= 1 - TIE else "tab:red")
                ax.scatter(i, r["own_margin"], color=colour, s=18, alpha=0.8)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}×"))
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
    ax.set_xticks(range(len(specs)), specs, rotation=35, ha="right", fontsize=8)
    ax.set_ylabel("strongest baseline / best own schedule")
    ax.set_title("treeattn's own schedules against the strongest baseline (predicted; "
                 ">1: treeattn faster)", fontsize=10)
    fig.tight_layout()
    with atomic.atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="headline", help="file stem under benchmarks/results")
    parser.add_argument("--limit", type=int, default=None, help="only the first N points")
    args = parser.parse_args(argv)
    points = grid()[: args.limit]
    rows, start = [], time.perf_counter()
    for i, p in enumerate(points, 1):
        rows.append(point(*p))
        print(f"[{i}/{len(points)}] {p[0]} {p[1]} TP{p[2]} b{p[3]} {p[4] // K}k "
              f"({time.perf_counter() - start:.0f} s)", file=sys.stderr)
    OUT.mkdir(parents=True, exist_ok=True)
    atomic.write_text(OUT / f"{args.out}.json", json.dumps({"rows": rows}, indent=1) + "\n")
    text = ("# Headline: treeattn against the strongest baseline (predicted)\n\n"
            "Margin = strongest baseline / treeattn's best own schedule (>1: treeattn "
            f"faster; within {TIE:.0%} a tie), each the best *simulated* candidate.\n\n"
            + summary(rows) + "\n" + markdown(rows))
    atomic.write_text(OUT / f"{args.out}.md", text)
    plot(rows, OUT / f"{args.out}.png")
    sys.stdout.write(summary(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
