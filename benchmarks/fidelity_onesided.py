"""Fidelity of the one-sided transports against published, measured microbenchmarks.

For every row of ``benchmarks/data/published_onesided.json`` (a kernel someone timed and
published: op, kernel, size, GPUs, with its source URL, hardware and method), price the same
kernel with :mod:`treeattn.sim.onesided` on the matching built-in topology and compare: a
torch ``symm_mem`` kernel by name, or the kernel a run's ``priced_as`` names for it (an
engine's own one-shot or two-shot kernel priced as torch's, which loads and stores the same
bytes behind the same barriers), or the kernel NCCL picks on the ``nccl-symm`` transport.
The model's constants are NCCL's symmetric-kernel figures, torch's launch configuration
(``treeattn/sim/onesided/torch_symm.py``) and one published graph-replayed kernel per GPU
generation (``treeattn/sim/onesided/fixed_costs.py``); the rows that are those kernels are
shown here as "source, not scored".

vLLM's benchmark times its communicator, which stages the input into the registered buffer
and copies the result out (``SymmMemCommunicator.all_reduce``): those two copy kernels are
added, each priced as the hardware model prices every kernel of a step
(:meth:`treeattn.sim.devices.HardwareModel.compute_time`: a read and a write of the buffer
at the GPU's modelled bandwidth, plus its fixed cost ``launch_s``, 4 µs, as a Compute step
is priced; the whole-token model charges a small graph-replayed kernel less,
``graph_kernel_s``, 2.4 µs on Hopper). Rows whose method or hardware the model cannot match
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
from treeattn.sim.onesided import ONE_SIDED
from treeattn.sim.onesided.torch_symm import symm_mem_kernels
from treeattn.topo import Topology

ROOT = Path(__file__).resolve().parent
SOURCES = ROOT / "data" / "published_onesided.json"
TARGET = 0.30  # the bound

# Where scored rows of a run's kernel miss the target, and why (checked by
# tests/test_fidelity_onesided.py: every miss explained, every explanation a miss)
_TWO_STAGE = (
    "vLLM's own two-stage kernel (cross_device_reduce_2stage), priced as torch's two-shot "
    "(the same (n-1)/n loads twice), runs at 0.36-0.65 of that price: its rows rise from "
    "about 15 us at 0.5 MiB, where its one-stage kernel takes 10-13 us, so it pays a fixed "
    "cost well above two barriers (its middle barrier waits, through a device-wide counter, "
    "for every block of every rank) and moves its bytes at 200-265 GB/s against the "
    "one-stage kernel's 300-375. No transport here runs vLLM's custom all-reduce, so the "
    "model has no price of its own for it.")
_SGLANG = (
    "SGLang's custom one-shot kernel, timed back to back without a graph and staging its "
    "input itself, is priced as torch's one-shot at the kilobyte fixed cost it sources. At "
    "256 KiB and above it grows by 45-72 GB/s per peer (2 ranks: 72 GB/s in all), well below "
    "the load/store ceiling torch's and vLLM's one-shot kernels reach in graph replays (the "
    "ca_1stage rows, within 17%); at 8 ranks its fixed cost is 5.7-5.9 us against the 3.7 us "
    "of 2 ranks, where the price has one barrier cost whatever the peers.")
# Where the published order of multimem and two-shot is not the predicted one
ORDER_MISS = (
    "On 4 ranks vLLM measured two-shot ahead of multimem from 1.5 MiB up (19-29 against "
    "21-33 us); the model keeps multimem ahead there, as on 6 ranks at every size. With 4 "
    "ranks the switch reduces 4 streams per load, and the model gives the multimem kernel's "
    "8 blocks NCCL's multiplier of the rank count, which reaches the 480 GB/s ceiling "
    "already; the measured rows say the multimem kernel falls short of it at 4 ranks. vLLM "
    "still runs multimem for 4 ranks on Hopper.")
_B200 = (
    "On 2 B200s the published rows rise 4 us per MiB from 17 us at 0.5 MiB; the price "
    "rises 2.4 us per MiB (the loads at 24 blocks' outstanding loads per NVLink round "
    "trip, the stores at the 600 GB/s ceiling) from 13.5. Blackwell's graph-replay "
    "fraction comes from NCCL's LL all-reduce, not from torch's two-shot or the two "
    "staging copies, and no graph replay of those on B200 with its sizes was found to set "
    "it from.")
MISSES = {
    ("vllm-42324-b200-tp2", "two_shot"): _B200,
    ("vllm-24111-h100-tp4-custom-ar", "ca_2stage"): _TWO_STAGE,
    ("vllm-24111-h100-tp6-custom-ar", "ca_2stage"): _TWO_STAGE,
    ("sglang-2904-h100-tp2", "sglang_custom_ar"): _SGLANG,
    ("sglang-2904-h100-tp4", "sglang_custom_ar"): _SGLANG,
    ("sglang-2904-h100-tp8", "sglang_custom_ar"): _SGLANG,
}


def score_rows(data: dict | None = None) -> list[dict]:
    data = data or json.loads(SOURCES.read_text())
    out = []
    for run in data["runs"]:
        topo = Topology.from_spec(run["topology"])
        shape = GroupShape.of(topo, range(run["ranks"]))
        gpu = resolve_hardware(topo, None)[0]
        priced_as = run.get("priced_as", {})
        for row in run["rows"]:
            if run["transport"] == "nccl-symm":
                kernel = ONE_SIDED["nccl-symm"].cost(run["op"], row["bytes"], shape, "sum")
            else:
                kernels = {c.algorithm: c
                           for c in symm_mem_kernels(run["op"], row["bytes"], shape)}
                kernel = kernels[f"symm_mem_{priced_as.get(row['kernel'], row['kernel'])}"]
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
                        "scored": run["scored"] and row.get("scored", True),
                        "why_not_scored": row.get("why_not_scored", run.get("why_not_scored")),
                        "miss": MISSES.get((run["id"], row["kernel"])),
                        "priced_as": priced_as.get(row["kernel"], row["kernel"])})
    return out


def _stats(scored: list[dict]) -> dict:
    within = [r for r in scored if r["error"] <= TARGET]
    geo = math.exp(sum(math.log(1 + r["error"]) for r in scored) / len(scored)) - 1
    return {"scored": len(scored), "within_target": len(within), "geo_error": round(geo, 4),
            "ratio_min": min(r["ratio"] for r in scored),
            "ratio_max": max(r["ratio"] for r in scored)}


def summary(rows: list[dict]) -> dict:
    """All scored rows, and apart: the kernels priced as themselves (torch's symm_mem
    kernels) and the engines' own kernels priced as torch's (``priced_as``)."""
    scored = [r for r in rows if r["scored"]]
    own = [r for r in scored if r["priced_as"] == r["kernel"]]
    engines = [r for r in scored if r["priced_as"] != r["kernel"]]
    return {**_stats(scored), "torch_kernels": _stats(own), "engine_kernels": _stats(engines)}


def markdown(rows: list[dict], s: dict, unpriced: list[dict]) -> str:
    lines = ["# One-sided transports vs published microbenchmarks", "",
             f"Scored rows: {s['scored']}, within ±{TARGET:.0%}: {s['within_target']}; "
             f"geometric-mean error {s['geo_error']:.0%}; predicted / published from "
             f"{s['ratio_min']:.2f} to {s['ratio_max']:.2f}.", ""]
    for key, what in (("torch_kernels", "torch's symm_mem kernels, priced as themselves"),
                      ("engine_kernels", "the engines' own kernels, priced as torch's")):
        k = s[key]
        lines.append(f"- {what}: {k['scored']} rows, {k['within_target']} within "
                     f"±{TARGET:.0%}, geometric-mean error {k['geo_error']:.0%}, "
                     f"{k['ratio_min']:.2f} to {k['ratio_max']:.2f}.")
    lines += ["",
             "| run | ranks | kernel | bytes | published µs | predicted µs | ratio | scored |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| [{r['run']}]({r['url']}) | {r['ranks']} | {r['kernel']} | "
                     f"{r['bytes']:,} | {r['published_us']:g} | {r['predicted_us']:.1f} | "
                     f"{r['ratio']:.2f} | {'yes' if r['scored'] else 'no'} |")
    lines += ["", "## Where the model misses, and why", ""]
    missed = {}
    for r in rows:
        if r["scored"] and r["error"] > TARGET:
            missed.setdefault((r["run"], r["kernel"], r["miss"]), []).append(r["bytes"])
    lines += [f"- `{run}` {kernel} ({', '.join(f'{b:,}' for b in sizes)} B): {why}"
              for (run, kernel, why), sizes in missed.items()]
    lines += [f"- Kernel order: {ORDER_MISS}"]
    lines += ["", "## Not scored, and why", ""]
    seen = set()
    for r in rows:
        if not r["scored"] and (r["run"], r["why_not_scored"]) not in seen:
            seen.add((r["run"], r["why_not_scored"]))
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
