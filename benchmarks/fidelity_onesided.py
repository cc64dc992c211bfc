"""Fidelity of the one-sided transports against published, measured microbenchmarks.

For every row of ``benchmarks/data/published_onesided.json`` (a kernel someone timed and
published: op, kernel, size, GPUs, with its source URL, hardware and method), price the same
kernel with :mod:`treeattn.sim.onesided` on the matching built-in topology and compare.
Nothing in the model was fitted to these rows: its constants are NCCL's symmetric-kernel
figures and torch's launch configuration (see ``treeattn/sim/onesided/torch_symm.py``).

vLLM's benchmark times its communicator, which stages the input into the registered buffer
and copies the result out (``SymmMemCommunicator.all_reduce``): those two copy kernels are
added, each priced as the hardware model prices every kernel of a step
(:meth:`treeattn.sim.devices.HardwareModel.compute_time`: a read and a write of the buffer
at the GPU's modelled bandwidth, plus its fixed cost ``launch_s``, the same 4 µs the whole
token charges each kernel). Rows whose method or hardware the model cannot match
(eager calls timed one by one, a world size not stated) are shown, not scored, with the
reason. The error of a row is ``max(p, m) / min(p, m) - 1``.

Writes ``benchmarks/results/fidelity_onesided.{json,md}``.

    PYTHONPATH=. .venv/bin/python benchmarks/fidelity_onesided.py
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_io import write_results  # noqa: E402

from treeattn.sim.nccl.group_shape import GroupShape
from treeattn.sim.network import resolve_hardware
from treeattn.sim.onesided.torch_symm import symm_mem_kernels
from treeattn.topo import Topology

ROOT = Path(__file__).resolve().parent
SOURCES = ROOT / "data" / "published_onesided.json"
TARGET = 0.30  # the bound

# Where a scored row misses the target, and why (checked by tests/test_fidelity_onesided.py)
MISSES = {
    ("vllm-24111-h100-tp6", "multimem", 524288): (
        "At half a MiB the fixed costs are nearly all of the time; the communicator's two "
        "copies are priced at the hardware model's 4 us fixed cost each, the figure the "
        "whole token charges every kernel, which errs high for a copy this small (the "
        "unscored 8-rank rows of vllm-42324-sm90 show the same, up to 1.6x)."),
}


def score_rows(data: dict | None = None) -> list[dict]:
    data = data or json.loads(SOURCES.read_text())
    out = []
    for run in data["runs"]:
        topo = Topology.from_spec(run["topology"])
        shape = GroupShape.of(topo, range(run["ranks"]))
        gpu = resolve_hardware(topo, None)[0]
        for row in run["rows"]:
            kernels = {c.algorithm: c for c in symm_mem_kernels(run["op"], row["bytes"], shape)}
            kernel = kernels[f"symm_mem_{row['kernel']}"]
            # each copy reads and writes the buffer once, and is one kernel of the graph
            copies = run["staging_copies"] * gpu.compute_time(2 * row["bytes"])
            predicted = (kernel.time_s + copies) * 1e6
            ratio = predicted / row["published_us"]
            out.append({"run": run["id"], "url": run["url"], "hardware": run["hardware"],
                        "ranks": run["ranks"], "kernel": row["kernel"], "bytes": row["bytes"],
                        "published_us": row["published_us"],
                        "predicted_us": round(predicted, 3),
                        "kernel_us": round(kernel.time_s * 1e6, 3),
                        "ratio": round(ratio, 4), "error": round(max(ratio, 1 / ratio) - 1, 4),
                        "scored": run["scored"], "why_not_scored": run.get("why_not_scored"),
                        "miss": MISSES.get((run["id"], row["kernel"], row["bytes"]))})
    return out


def summary(rows: list[dict]) -> dict:
    scored = [r for r in rows if r["scored"]]
    within = [r for r in scored if r["error"] <= TARGET]
    geo = math.exp(sum(math.log(1 + r["error"]) for r in scored) / len(scored)) - 1
    return {"scored": len(scored), "within_target": len(within), "geo_error": round(geo, 4),
            "ratio_min": min(r["ratio"] for r in scored),
            "ratio_max": max(r["ratio"] for r in scored)}


def markdown(rows: list[dict], s: dict, unpriced: list[dict]) -> str:
    lines = ["# One-sided transports vs published microbenchmarks", "",
             f"Scored rows: {s['scored']}, within ±{TARGET:.0%}: {s['within_target']}; "
             f"geometric-mean error {s['geo_error']:.0%}; predicted / published from "
             f"{s['ratio_min']:.2f} to {s['ratio_max']:.2f}.", "",
             "| run | ranks | kernel | bytes | published µs | predicted µs | ratio | scored |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| [{r['run']}]({r['url']}) | {r['ranks']} | {r['kernel']} | "
                     f"{r['bytes']:,} | {r['published_us']:g} | {r['predicted_us']:.1f} | "
                     f"{r['ratio']:.2f} | {'yes' if r['scored'] else 'no'} |")
    lines += ["", "## Where the model misses, and why", ""]
    lines += [f"- `{r['run']}` {r['kernel']} {r['bytes']:,} B: {r['miss']}"
              for r in rows if r["miss"]]
    lines += ["", "## Not scored, and why", ""]
    seen = set()
    for r in rows:
        if not r["scored"] and r["run"] not in seen:
            seen.add(r["run"])
            lines.append(f"- `{r['run']}` ({r['hardware']}): {r['why_not_scored']}.")
    for u in unpriced:
        lines.append(f"- `{u['id']}` (<{u['url']}>): {u['what']}; not priced: {u['why']}.")
    return "\n".join(lines) + "\n"


def main() -> int:
    data = json.loads(SOURCES.read_text())
    rows = score_rows(data)
    s = summary(rows)
    text = markdown(rows, s, data["unpriced"])
    write_results("fidelity_onesided", {"rows": rows, "summary": s}, text)
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
