"""Every reduction algorithm on local CPU ranks: measured and predicted side by side, and the
planner's pick against the best baseline.

For world 2 and 4 (gloo on loopback, one torch thread per rank), one process group per world:

1. calibrate once with microbenchmarks only, the exchange up to the largest KV block the
   ring will move (``treeattn.testbed.calibration.calibrate``);
2. at each seq_len, rank 0 predicts every algorithm with the simulator from that profile and
   asks the planner (``treeattn.sim.plan_workload``, same profile) for its pick;
3. all algorithms are measured *interleaved* (one step of each per round, the order rotating:
   ``treeattn.runtime.measure.timing.time_interleaved``), so that a drifting, shared machine slows
   them alike and the ratios between them stay meaningful.

Reported per point: measured median, p10 and p90, predicted value and band, error, and
whether the prediction lies in the measured band widened by ``MAX_ERROR``; per (world,
seq_len): the planner's pick and its measured time against the fastest measured baseline
(``treeattn.schedule.algorithms.BASELINES``), as a ratio (> 1: the pick was faster).

The tree is measured with the shape the planner picked when the planner picks a tree.

Run: ``.venv/bin/python benchmarks/algorithms.py [--quick]``. Writes
``benchmarks/results/algorithms.json`` and ``.md`` (either mode; the file says which).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from results_io import write_results  # noqa: E402  (benchmarks/, beside this script)

from treeattn import testbed  # noqa: E402
from treeattn.runtime.group import broadcast_object  # noqa: E402
from treeattn.runtime.launch import LaunchOptions, launch  # noqa: E402
from treeattn.runtime.measure.check import (  # noqa: E402
    RunRequest,
    geo_mean_error,
    largest_message_bytes,
    mark_bands,
    predictor,
    run_points,
)
from treeattn.runtime.plans import shard_lengths, workload_for  # noqa: E402
from treeattn.schedule.algorithms import ALGORITHM_NAMES, BASELINES, SOURCES  # noqa: E402
from treeattn.testbed.calibration.calibrate import calibrate_in_group, machine_info  # noqa: E402

K = 1024
SEQ_LENS = (16 * K, 64 * K, 256 * K)
QUICK_SEQ_LENS = (16 * K, 64 * K)
WORLDS = (2, 4)
MAX_ERROR = 0.25
# Hq=32, Hkv=8, D=128, fp32, batch 1: the existing model shape.
BASE = RunRequest(seq_lens=(), algorithms=ALGORITHM_NAMES, steps=5, warmup=1, check=True,
                  min_time_s=2.0, ref_limit_bytes=512 << 20)
QUICK = {"steps": 3, "min_time_s": 0.3}
MEMORY_BUDGET = 0.6  # of MemAvailable, for one point's tensors on all ranks


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 8 << 30


def ring_bytes(seq_len: int, world: int) -> int:
    """Tensor bytes ring needs on all ranks: own shard + block held + block arriving."""
    shard = 2 * BASE.n_kv_heads * BASE.head_dim * 4 * math.ceil(seq_len / world)
    return world * shard * 3


def planner_pick(profile: dict, world: int, seq_len: int) -> dict:
    """The planner's choice with the calibrated models: name, algorithm, tree params."""
    from treeattn.sim import plan_workload

    topology, hardware, backend = predictor(profile, world)
    workload = workload_for(BASE.dims, shard_lengths(seq_len, world))
    chosen = plan_workload(topology, workload, hardware, backend)
    params = {}
    if chosen.algorithm == "tree":
        params = ({"tree": chosen.winner.trees[0]} if chosen.winner.params.get("shape")
                  == "searched" else dict(chosen.winner.params))
    baseline = chosen.best_baseline()
    return {"name": chosen.name, "algorithm": chosen.algorithm, "params": params,
            "predicted_s": chosen.latency_s,
            "best_baseline_predicted": baseline.name if baseline else None,
            "best_baseline_predicted_s": baseline.latency_s if baseline else None}


@dataclass
class BenchJob:
    """One process group: calibrate once, then every seq_len, all algorithms interleaved."""

    requests: list[RunRequest]
    max_bytes: int

    def __call__(self, ctx):
        profile = broadcast_object(ctx, calibrate_in_group(ctx, BASE.dims, self.max_bytes))
        out = []
        for req in self.requests:
            pick = planner_pick(profile, ctx.world, req.seq_lens[0]) if ctx.rank == 0 else None
            pick = broadcast_object(ctx, pick)
            params = pick["params"] if pick["algorithm"] == "tree" else {}
            points = run_points(ctx, replace(req, profile=profile, params=params))
            out.append((pick, points))
        return profile, out


def run_world(world: int, seq_lens: tuple[int, ...], quick: bool,
              timing: dict | None = None) -> dict:
    """Every algorithm at every seq_len on ``world`` local ranks, calibrated once; ``timing``
    (``steps``, ``min_time_s``) overrides the mode's, as the repeatability benchmark does."""
    budget = MEMORY_BUDGET * mem_available()
    requests = []
    settings = timing if timing is not None else (QUICK if quick else {})
    for n in seq_lens:
        algorithms = tuple(a for a in ALGORITHM_NAMES
                           if a != "ring" or ring_bytes(n, world) <= budget)
        requests.append(replace(BASE, seq_lens=(n,), algorithms=algorithms, **settings))
    max_bytes = max(largest_message_bytes(r, world) for r in requests)
    profile, parts = launch(BenchJob(requests, max_bytes), world,
                            LaunchOptions(timeout_s=180.0, deadline_s=1500.0))
    rows, points = [], []
    for pick, part in parts:
        mark_bands(part, MAX_ERROR)
        points += part
        rows.append(summarize(world, pick, part))
    return {"profile": profile, "rows": rows, "points": points}


def summarize(world: int, pick: dict, points: list[dict]) -> dict:
    """One (world, seq_len): the pick's measured time against the fastest measured baseline."""
    by = {p["requested"]: p for p in points}
    baselines = [by[a] for a in BASELINES if a in by]
    best = min(baselines, key=lambda p: p["measured_s"])
    mine = by.get(pick["algorithm"])
    return {
        "world": world, "seq_len": points[0]["seq_len"],
        "pick": pick["name"], "pick_algorithm": pick["algorithm"],
        "pick_measured_s": mine["measured_s"] if mine else None,
        "pick_predicted_s": pick["predicted_s"],
        "best_baseline": best["requested"], "best_baseline_measured_s": best["measured_s"],
        "best_baseline_predicted": pick["best_baseline_predicted"],
        "measured_ratio": best["measured_s"] / mine["measured_s"] if mine else None,
        "predicted_ratio": (pick["best_baseline_predicted_s"] / pick["predicted_s"]
                            if pick["best_baseline_predicted_s"] else None),
        "fastest_measured": min(points, key=lambda p: p["measured_s"])["requested"],
    }


def _ms(x) -> str:
    return "—" if x is None else f"{x * 1e3:.2f}"


def markdown(result: dict, meta: dict) -> str:
    load = lambda avg: "/".join(f"{x:.1f}" for x in avg)  # noqa: E731
    lines = [
        "# Every algorithm, local CPU ranks (gloo): measured vs predicted", "",
        f"Machine: {meta['machine']['cpu']}, {meta['machine']['cpu_count']} cores; load "
        f"average 1/5/15 min {load(meta['load_avg_start'])} at start, "
        f"{load(meta['load_avg_end'])} at end (the benchmark's own ranks count in it; far above "
        "the core count means others shared the machine). Absolute times move with the load; "
        "the interleaved ratios are the robust part.", "",
        f"Hq=32, Hkv=8, D=128, fp32, batch 1, one torch thread per rank. Mode: "
        f"{meta['mode']}; at least {meta['steps']} timed steps per algorithm and point (more "
        f"until {meta['min_time_s']} s each), algorithms interleaved. Measured: median "
        "(p10–p90) over the timed steps, max over ranks. Predicted: simulator with this "
        "run's calibration (band: every calibrated cost at its p10 / p90). In band: the "
        f"prediction lies in the measured p10–p90 widened by {MAX_ERROR:.0%}. "
        f"Wall time {meta['wall_s']:.0f} s.", "",
        "| world | seq_len | algorithm | source | measured ms (p10–p90) | predicted ms (band) "
        "| error | in band |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for world, res in result.items():
        for p in res["points"]:
            lines.append(
                f"| {world} | {p['seq_len'] // K}k | {p['requested']} "
                f"| {SOURCES.get(p['requested'], '')} | {_ms(p['measured_s'])} "
                f"({_ms(p['measured_p10_s'])}–{_ms(p['measured_p90_s'])}) "
                f"| {_ms(p['predicted_s'])} ({_ms(p['predicted_lo_s'])}–"
                f"{_ms(p['predicted_hi_s'])}) | {p['error']:.1%} "
                f"| {'yes' if p['within_band'] else 'no'} |")
    lines += ["", "Planner's pick (calibrated models) against the fastest *measured* baseline "
              "(ratio = baseline / pick, measured interleaved; > 1 means the pick was faster):",
              "", "| world | seq_len | pick | pick ms | best baseline | baseline ms "
              "| measured ratio | predicted ratio (vs predicted best baseline) "
              "| fastest measured |", "|---|---|---|---|---|---|---|---|---|"]
    for world, res in result.items():
        for r in res["rows"]:
            ratio = "—" if r["measured_ratio"] is None else f"{r['measured_ratio']:.2f}×"
            pred = "—" if r["predicted_ratio"] is None else f"{r['predicted_ratio']:.2f}×"
            lines.append(
                f"| {world} | {r['seq_len'] // K}k | {r['pick']} | {_ms(r['pick_measured_s'])} "
                f"| {r['best_baseline']} | {_ms(r['best_baseline_measured_s'])} | {ratio} "
                f"| {pred} ({r['best_baseline_predicted']}) | {r['fastest_measured']} |")
    lines += ["", f"Geometric-mean prediction error: {meta['geo_mean_error']:.1%}; points "
              f"in band: {meta['in_band']} of {meta['points']}.", "", "Calibration:", ""]
    for world, res in result.items():
        prof = res["profile"]
        ex = prof["exchange"]
        lines.append(
            f"- world {world}: p2p α {prof['p2p']['latency_s'] * 1e6:.1f} µs; exchange "
            f"{ex['bandwidth_Bps'] / 1e9:.2f} GB/s per message, calibrated up to "
            f"{max(ex['sizes']) / 2**20:.0f} MiB; attention "
            f"{prof['attention']['bandwidth_Bps'] / 1e9:.2f} GB/s per rank, spread "
            f"{prof['attention']['spread']}; cores {prof['cores']}.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    testbed.plug_in()  # CPU ranks of one host: the transport `treeattn run` uses
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="16k and 64k, 3 steps floor, 0.3 s per point (a few minutes)")
    args = parser.parse_args(argv)
    seq_lens = QUICK_SEQ_LENS if args.quick else SEQ_LENS
    t0, load_start = time.time(), os.getloadavg()
    result = {}
    for world in WORLDS:
        result[world] = run_world(world, seq_lens, args.quick)
        print(f"world {world} done after {time.time() - t0:.0f} s", file=sys.stderr)
    points = [p for res in result.values() for p in res["points"]]
    settings = QUICK if args.quick else {"steps": BASE.steps, "min_time_s": BASE.min_time_s}
    meta = {"machine": machine_info(), "mode": "quick" if args.quick else "full", **settings,
            "wall_s": time.time() - t0, "load_avg_start": load_start,
            "load_avg_end": os.getloadavg(), "geo_mean_error": geo_mean_error(points),
            "in_band": sum(bool(p["within_band"]) for p in points), "points": len(points)}
    for res in result.values():
        for p in res["points"]:
            p.pop("timeline", None), p.pop("predicted_timeline", None)  # keep the file small
    text = markdown(result, meta)
    write_results("algorithms", {"meta": meta, "worlds": {str(w): r for w, r in result.items()}},
                  text)  # the mode is in the file
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
