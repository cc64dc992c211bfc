"""The executor's fixed host cost per schedule step, against raw isend/irecv.

World 2 on this machine (gloo on loopback, one torch thread per rank), tiny payloads (B=1,
Hq=Hkv=1, D=8, 4 tokens per shard) so data costs nothing. For each schedule (butterfly,
tree) the variants ``executor``, ``program``, ``raw``, ``raw+kernels`` and ``raw-gloo`` of
:func:`treeattn.testbed.calibration.overhead.time_variants` run the same messages in one process
group, interleaved within every repetition. ``raw`` goes through the executor's transport (small
messages between ranks of one host take shared memory, ``treeattn/testbed/transport/shm.py``);
``raw-gloo`` is the same loop on ``torch.distributed`` directly.

One repetition times ``INNER`` back-to-back runs of a variant (after a tiny all-reduce that
lines the ranks up, not timed) and takes the max over ranks; per-run time is that over
``INNER``. Per-step time divides by the steps of the busiest rank's schedule. Reported:
median and p10–p90 over repetitions, and the ratio executor / raw computed per repetition
(so both sides of a ratio saw the same machine load).

``program`` is the executor running each rank's steps as one C call
(:mod:`treeattn.testbed.transport.shm_program`), as ``run`` and ``generate`` do on CPU ranks of one
host;
``executor`` keeps its Python steps. ``treeattn calibrate`` uses the same timing to record
``executor.step_overhead_s`` and ``executor.program_step_s``. Run:
``.venv/bin/python benchmarks/executor_overhead.py [--reps N]``. Writes
``benchmarks/results/executor_overhead.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from results_io import write_results  # noqa: E402  (benchmarks/, beside this script)

from treeattn import testbed  # noqa: E402
from treeattn.runtime.launch import LaunchOptions, launch  # noqa: E402
from treeattn.runtime.transport import transport_for  # noqa: E402
from treeattn.testbed.calibration.calibrate import machine_info  # noqa: E402
from treeattn.testbed.calibration.overhead import INNER, overhead_per_message, time_variants  # noqa: E402

WORLD = 2
ALGORITHMS = ("butterfly", "tree")


@dataclass
class OverheadJob:
    reps: int

    def __call__(self, ctx):
        out = {algorithm: time_variants(ctx, algorithm, self.reps) for algorithm in ALGORITHMS}
        out["transport"] = transport_for(ctx).kind
        return out if ctx.rank == 0 else None


def _stats(values) -> dict:
    a = np.asarray(values, dtype=float)
    return {"median": float(np.median(a)), "p10": float(np.percentile(a, 10)),
            "p90": float(np.percentile(a, 90))}


def summarize(raw: dict) -> dict:
    rows = {}
    for algorithm, r in raw.items():
        per_run = {v: np.asarray(t) for v, t in r["per_run_s"].items()}
        steps = r["steps_busiest_rank"]
        rows[algorithm] = {
            "steps_busiest_rank": steps,
            "messages_busiest_rank": r["messages_busiest_rank"],
            "per_step_s": {v: _stats(t / steps) for v, t in per_run.items()},
            "ratio_executor_raw": _stats(per_run["executor"] / per_run["raw"]),
            "ratio_executor_raw_gloo": _stats(per_run["executor"] / per_run["raw-gloo"]),
            "ratio_executor_raw_kernels": _stats(per_run["executor"] / per_run["raw+kernels"]),
            "overhead_per_step_s": _stats((per_run["executor"] - per_run["raw+kernels"]) / steps),
            "overhead_per_message_s": _stats(overhead_per_message(r)),
            "programs": r["programs"],
            "ratio_program_raw": _stats(per_run["program"] / per_run["raw"]),
            "ratio_program_executor": _stats(per_run["program"] / per_run["executor"]),
            "program_per_message_s": _stats(overhead_per_message(r, "program")),
        }
    return rows


def profile_section(rows: dict) -> dict:
    """The optional profile key the simulator reads (``sim.profiles.executor_step_overhead``):
    the executor's cost beyond raw messages + kernels, per Send/Recv step, the smallest median
    over the schedules (never negative)."""
    per_msg = min(r["overhead_per_message_s"]["median"] for r in rows.values())
    section = {"step_overhead_s": max(0.0, per_msg)}
    if all(r["programs"] for r in rows.values()):  # as calibration records it (tree's)
        section["program_step_s"] = rows["tree"]["program_per_message_s"]["median"]
    return {"executor": section}


def markdown(rows: dict, meta: dict) -> str:
    us = lambda s: f"{s['median'] * 1e6:.1f} ({s['p10'] * 1e6:.1f}–{s['p90'] * 1e6:.1f})"  # noqa: E731
    x = lambda s: f"{s['median']:.2f}× ({s['p10']:.2f}–{s['p90']:.2f})"  # noqa: E731
    lines = [
        "# Executor overhead per schedule step, world 2, CPU ranks of one host", "",
        f"Machine: {meta['machine']['cpu']}, {meta['machine']['cpu_count']} cores, "
        f"torch {meta['machine']['torch']}. B=1, Hq=Hkv=1, D=8, 4 tokens per shard (data "
        f"negligible). {meta['reps']} repetitions of {INNER} runs per variant, interleaved, "
        f"max over ranks. Load average at start {meta['load_avg_start'][0]:.1f}, at end "
        f"{meta['load_avg_end'][0]:.1f}: the machine is shared; compare ratios, not times.", "",
        "Per-step host time in µs, median (p10–p90); ratio per repetition, median (p10–p90).", "",
        "| schedule | steps | msgs | executor | program | raw | raw+kernels | raw gloo "
        "| exec/raw | exec/(raw+kernels) | exec/raw gloo | exec − (raw+kernels) per step "
        "| program/raw | program/exec |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for algorithm, r in rows.items():
        p = r["per_step_s"]
        lines.append(
            f"| {algorithm} | {r['steps_busiest_rank']} | {r['messages_busiest_rank']} "
            f"| {us(p['executor'])} | {us(p['program'])} | {us(p['raw'])} "
            f"| {us(p['raw+kernels'])} | {us(p['raw-gloo'])} | {x(r['ratio_executor_raw'])} "
            f"| {x(r['ratio_executor_raw_kernels'])} | {x(r['ratio_executor_raw_gloo'])} "
            f"| {us(r['overhead_per_step_s'])} | {x(r['ratio_program_raw'])} "
            f"| {x(r['ratio_program_executor'])} |")
    lines += ["", f"raw: plain isend/irecv + wait of preallocated buffers, same sizes, "
              f"order, peers and tags, through the executor's transport "
              f"(`{meta['transport']}`). raw+kernels adds the same kernel calls "
              "(partial_attention, merge) on preallocated tensors. raw gloo: raw through "
              "torch.distributed's gloo directly. program: the executor running the rank's "
              "steps as one C call (`treeattn/testbed/transport/shm_program.py`)"
              + ("" if all(r["programs"] for r in rows.values())
                 else "; it did not apply here, so it repeats the executor") + ".", "",
              "Profile key for the simulator (the JSON's `profile`): "
              f"`executor.step_overhead_s` = "
              f"{profile_section(rows)['executor']['step_overhead_s'] * 1e6:.1f} µs "
              "per Send/Recv step for the Python steps; `executor.program_step_s` = "
              f"{profile_section(rows)['executor'].get('program_step_s', float('nan')) * 1e6:.1f}"
              " µs for the program (relative to raw+kernels, so it may be negative).", ""]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    testbed.plug_in()  # CPU ranks of one host: the transport `treeattn run` uses
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=300)
    parser.add_argument("--out", default="executor_overhead", help="results file stem")
    args = parser.parse_args(argv)
    load_start = os.getloadavg()
    raw = launch(OverheadJob(args.reps), WORLD, LaunchOptions(timeout_s=60.0))
    transport = raw.pop("transport")
    rows = summarize(raw)
    meta = {"machine": machine_info(), "reps": args.reps, "inner": INNER, "transport": transport,
            "load_avg_start": load_start, "load_avg_end": os.getloadavg()}
    text = markdown(rows, meta)
    write_results(args.out, {"meta": meta, "rows": rows, "profile": profile_section(rows),
                             "raw": raw}, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
