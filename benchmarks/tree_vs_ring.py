"""Tree vs Ring Attention decode on local CPU ranks: measured, predicted, and against a floor.

For world 2 and 4 (gloo on loopback, one torch thread per rank), one process group per world:

1. calibrate with microbenchmarks only (``treeattn.runtime.calibrate``);
2. predict every point with the simulator from that profile;
3. measure tree and ring at seq_len 16k … 1M (Hq=32, Hkv=8, D=128, fp32, batch 1).

Reported per (world, seq_len): measured and predicted step time of both, the measured and
predicted speedup of tree over ring, the prediction errors, the peak-memory ratio ring/tree
(tensor bytes the runtime holds per rank, max over ranks), and tree's step time against its
floor: all KV bytes read at the machine's calibrated memory bandwidth (per-rank bandwidth ×
ranks that can run at once) plus the calibrated p2p latency × tree depth.

A ring point whose KV blocks would not fit in this machine's memory (own shard + block held +
block arriving, on every rank) is predicted but not run; the table says so.

Run: ``.venv/bin/python benchmarks/tree_vs_ring.py [--quick]``. Writes
``benchmarks/results/tree_vs_ring.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from treeattn.runtime.calibrate import calibrate_in_group, machine_info  # noqa: E402
from treeattn.runtime.check import (  # noqa: E402
    RunRequest,
    point_error,
    predictor,
    run_points,
)
from treeattn.runtime.group import broadcast_object  # noqa: E402
from treeattn.runtime.launch import LaunchOptions, launch  # noqa: E402
from treeattn.runtime.plans import build, shard_lengths, workload_for  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
K = 1024
SEQ_LENS = (16 * K, 64 * K, 256 * K, 1024 * K)
WORLDS = (2, 4)
BASE = RunRequest(seq_lens=(), algorithms=("tree", "ring"), steps=6, warmup=1, check=True,
                  ref_limit_bytes=512 << 20)
MEMORY_BUDGET = 0.6  # of MemAvailable, for one point's tensors on all ranks


@dataclass
class BenchJob:
    """One process group; before each request: calibrate, then predict and measure.

    Re-calibrating right before each point keeps the profile as fresh as the machine's load
    allows (this 2-core box is shared); it is still microbenchmarks only.
    """

    requests: list[RunRequest]

    def __call__(self, ctx):
        out = []
        for req in self.requests:
            profile = broadcast_object(ctx, calibrate_in_group(ctx, BASE.dims))
            out.append((profile, run_points(ctx, replace(req, profile=profile))))
        return out


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 8 << 30


def ring_bytes(seq_len: int, world: int) -> int:
    """Tensor bytes ring needs on all ranks: own shard + block held + block arriving."""
    shard = 2 * BASE.n_kv_heads * BASE.head_dim * 4 * math.ceil(seq_len / world)
    return world * shard * (2 if world == 2 else 3)


def tree_depth(parent: list[int]) -> int:
    def depth(v: int) -> int:
        return 0 if parent[v] < 0 else 1 + depth(parent[v])

    return max(depth(v) for v in range(len(parent)))


def predict(profile: dict, world: int, seq_len: int, algorithm: str):
    from treeattn.sim import simulate

    topology, hardware, backend = predictor(profile, world)
    workload = workload_for(BASE.dims, shard_lengths(seq_len, world))
    schedule = build(algorithm, topology, workload)
    return schedule, simulate(schedule, topology, workload, hardware, backend).makespan_s


def pingpong_profile(profile: dict) -> dict:
    """What-if: the same profile without the concurrent-exchange calibration, so the links
    get the lone ping-pong bandwidth (what the simulator would use without it)."""
    out = json.loads(json.dumps(profile))
    out.pop("exchange", None)
    return out


def floor_s(profile: dict, world: int, seq_len: int, depth: int) -> float:
    att = profile["attention"]
    machine_bw = att["bandwidth_Bps"] * att.get("concurrent_ranks", 1)
    kv_bytes = 2 * BASE.n_kv_heads * BASE.head_dim * 4 * seq_len
    return kv_bytes / machine_bw + att["launch_s"] + profile["p2p"]["latency_s"] * depth


def run_world(world: int, seq_lens: tuple[int, ...], steps: int) -> dict:
    budget = MEMORY_BUDGET * mem_available()
    both = tuple(n for n in seq_lens if ring_bytes(n, world) <= budget)
    tree_only = tuple(n for n in seq_lens if n not in both)
    requests = [replace(BASE, seq_lens=(n,), steps=steps,
                        algorithms=("tree", "ring") if n in both else ("tree",))
                for n in seq_lens]
    parts = launch(BenchJob(requests), world, LaunchOptions(timeout_s=120.0, deadline_s=1500.0))
    points, profiles = [], {}
    for profile, part in parts:
        points += part
        profiles[part[0]["seq_len"]] = profile
    for n in tree_only:  # predicted only: too big to hold here
        _, pred = predict(profiles[n], world, n, "ring")
        points.append({"algorithm": "ring", "world": world, "seq_len": n, "measured_s": None,
                       "predicted_s": pred, "error": None, "skipped": "does not fit in memory",
                       "peak_memory_bytes": None, "bytes_sent": None, "max_abs_diff": None})
    return {"profiles": profiles, "points": points}


def summarize(world: int, result: dict) -> list[dict]:
    by = {(p["algorithm"], p["seq_len"]): p for p in result["points"]}
    rows = []
    for n in sorted({p["seq_len"] for p in result["points"]}):
        tree, ring = by[("tree", n)], by[("ring", n)]
        depth = tree_depth(tree["params"]["parent"])
        profile = result["profiles"][n]
        floor = floor_s(profile, world, n, depth)
        whatif = pingpong_profile(profile)
        ring_x = predict(whatif, world, n, "ring")[1]
        tree_x = predict(whatif, world, n, "tree")[1]
        measured_ring = ring["measured_s"]
        rows.append({
            "world": world, "seq_len": n,
            "tree_measured_s": tree["measured_s"], "tree_predicted_s": tree["predicted_s"],
            "ring_measured_s": measured_ring, "ring_predicted_s": ring["predicted_s"],
            "speedup_measured": measured_ring / tree["measured_s"] if measured_ring else None,
            "speedup_predicted": ring["predicted_s"] / tree["predicted_s"],
            "tree_error": tree["error"], "ring_error": ring["error"],
            "ring_predicted_pingpong_s": ring_x, "tree_predicted_pingpong_s": tree_x,
            "ring_error_pingpong": point_error(ring_x, measured_ring) if measured_ring else None,
            "tree_error_pingpong": point_error(tree_x, tree["measured_s"]),
            "peak_mem_ratio": (max(ring["peak_memory_bytes"]) / max(tree["peak_memory_bytes"])
                               if ring["peak_memory_bytes"] else None),
            "tree_floor_s": floor, "tree_over_floor": tree["measured_s"] / floor,
            "tree_depth": depth, "tree_shape": tree["params"].get("shape"),
            "max_abs_diff": max((p["max_abs_diff"] or 0.0) for p in (tree, ring)),
            "ring_skipped": ring.get("skipped"),
        })  # fmt: skip
    return rows


def geo_mean_error(rows: list[dict], suffix: str = "s") -> float:
    logs = []
    for r in rows:
        for alg in ("tree", "ring"):
            meas = r[f"{alg}_measured_s"]
            pred = r[f"{alg}_predicted_{suffix}"]
            if meas and pred:
                logs.append(abs(math.log(pred / meas)))
    return math.exp(sum(logs) / len(logs)) - 1


def geo_mean_of_errors(rows: list[dict]) -> float:
    """The other reading: geometric mean of |predicted/measured − 1| (floored at 0.1%)."""
    errs = [max(r[f"{alg}_error"], 1e-3) for r in rows for alg in ("tree", "ring")
            if r[f"{alg}_error"] is not None]
    return math.exp(sum(math.log(e) for e in errs) / len(errs))


def _load(avg) -> str:
    return "/".join(f"{x:.1f}" for x in avg)


def _f(x, fmt: str) -> str:
    return "—" if x is None else format(x, fmt)


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [
        "# Tree vs Ring Attention decode, local CPU ranks (gloo)", "",
        f"Machine: {meta['machine']['cpu']}, {meta['machine']['cpu_count']} cores, "
        f"torch {meta['machine']['torch']}, python {meta['machine']['python']}. "
        f"Hq=32, Hkv=8, D=128, fp32, batch 1, one torch thread per rank. "
        f"Step time = median of {meta['steps']} timed steps, max over ranks. "
        f"Load average (1/5/15 min) at start {_load(meta['load_avg_start'])}, at end "
        f"{_load(meta['load_avg_end'])}: the machine is shared, so absolute times are noisy.",
        "",
        "| world | seq_len | tree meas | tree pred | ring meas | ring pred | speedup meas "
        "| speedup pred | err tree | err ring | ring/tree peak mem | tree/floor |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ms = lambda x: _f(x and x * 1e3, ".2f")  # noqa: E731
        lines.append(
            f"| {r['world']} | {r['seq_len'] // K}k | {ms(r['tree_measured_s'])} "
            f"| {ms(r['tree_predicted_s'])} | {ms(r['ring_measured_s'])} "
            f"| {ms(r['ring_predicted_s'])} | {_f(r['speedup_measured'], '.2f')}× "
            f"| {_f(r['speedup_predicted'], '.2f')}× | {_f(r['tree_error'], '.1%')} "
            f"| {_f(r['ring_error'], '.1%')} | {_f(r['peak_mem_ratio'], '.2f')}× "
            f"| {_f(r['tree_over_floor'], '.2f')}× |"
        )
    lines += ["", f"Geometric-mean prediction error over all measured points: "
              f"{meta['geo_mean_error']:.1%} (exp of the mean |ln(pred/meas)|, minus 1; "
              f"the geometric mean of the per-point errors max(p/m, m/p) − 1 is "
              f"{meta['geo_mean_of_errors']:.1%}).", "",
              "What-if: the simulator with the link bandwidth "
              "of a lone ping-pong instead of the concurrent exchange "
              f"(geo-mean error {meta['geo_mean_error_pingpong']:.1%}):", "",
              "| world | seq_len | tree pred | err | ring pred | err |",
              "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['world']} | {r['seq_len'] // K}k | {r['tree_predicted_pingpong_s'] * 1e3:.2f} "
            f"| {_f(r['tree_error_pingpong'], '.1%')} | {r['ring_predicted_pingpong_s'] * 1e3:.2f}"
            f" | {_f(r['ring_error_pingpong'], '.1%')} |")
    lines += ["",
              "Times in ms. A dash: ring not run (its blocks do not fit in this machine's "
              "memory); its prediction is still shown.", ""]
    lines.append("Calibration (re-run right before each point):")
    lines.append("")
    for (world, n), prof in sorted((((w, n), p) for w, ps in meta["profiles"].items()
                                    for n, p in ps.items())):
        lines.append(
            f"- world {world}, before {n // K}k: p2p α = {prof['p2p']['latency_s'] * 1e6:.1f} µs, "
            f"β = {prof['p2p']['bandwidth_Bps'] / 1e9:.2f} GB/s; attention "
            f"{prof['attention']['bandwidth_Bps'] / 1e9:.2f} GB/s per rank "
            f"({prof['attention']['concurrent_ranks']} at once), launch "
            f"{prof['attention']['launch_s'] * 1e6:.0f} µs; exchange (all ranks at once) "
            f"{prof['exchange']['bandwidth_Bps'] / 1e9:.2f} GB/s per message; "
            f"cores {prof['cores']}.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="16k and 64k only, 3 steps")
    parser.add_argument("--steps", type=int, default=BASE.steps)
    args = parser.parse_args(argv)
    seq_lens = SEQ_LENS[:2] if args.quick else SEQ_LENS
    steps = 3 if args.quick else args.steps
    t0, load_start = time.time(), os.getloadavg()
    rows, profiles, raw = [], {}, {}
    for world in WORLDS:
        result = run_world(world, seq_lens, steps)
        profiles[world], raw[world] = result["profiles"], result["points"]
        rows += summarize(world, result)
        print(f"world {world} done after {time.time() - t0:.0f} s", file=sys.stderr)
    meta = {"machine": machine_info(), "steps": steps, "profiles": profiles,
            "geo_mean_error": geo_mean_error(rows),
            "geo_mean_error_pingpong": geo_mean_error(rows, "pingpong_s"),
            "geo_mean_of_errors": geo_mean_of_errors(rows),
            "wall_s": time.time() - t0, "load_avg_start": load_start,
            "load_avg_end": os.getloadavg(),
            "env": {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")}}
    RESULTS.mkdir(parents=True, exist_ok=True)
    suffix = "-quick" if args.quick else ""
    (RESULTS / f"tree_vs_ring{suffix}.json").write_text(
        json.dumps({"meta": meta, "rows": rows, "points": raw}, indent=2) + "\n")
    text = markdown(rows, meta)
    (RESULTS / f"tree_vs_ring{suffix}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
