"""Regenerate the README gallery: the predictions that tell the story at a glance.

Run with ``make gallery``. Writes PNGs plus the rows behind them (JSON and a Markdown table)
into ``docs/gallery/``; commit them when the numbers change so the README stays true.

1. ``speedup_vs_gpus.png``: treeattn's best own schedule against the strongest baseline
   (the fastest of what serving systems run today) vs the number of GPUs, 1 to 16 DGX H100
   nodes, contexts from 80k to 5M tokens. Below 1× a baseline is the pick.
2. ``latency_vs_seq_len.png``: per-layer latency vs context length on DGX H100, MI300X and
   an 8×RTX 4090 PCIe box: every algorithm's time over the fastest at that point, and the
   fastest's absolute time beside ring pass-KV's in a panel of their own.
3. ``memory_vs_hidden.png``: peak memory per GPU, tree vs ring, vs hidden size.
"""

from __future__ import annotations

import json
import platform
import sys
import time
from pathlib import Path

from treeattn import atomic
from treeattn.sweep import plots
from treeattn.sweep.grid import expand_grid, memory_rows, run_sweep

OUT = Path(__file__).resolve().parent.parent / "docs" / "gallery"
MODEL = "llama-3.1-8b"
K, M = 1 << 10, 1 << 20


def _table(rows: list[dict]) -> str:
    lines = ["| topology | GPUs | seq_len | algorithm | system | latency/layer (µs) | "
             "vs best baseline | vs ring pass-KV |", "|---|---:|---:|---|---|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['spec']} | {r['gpus']} | {r['seq_len']} | {r['algorithm']} "
                     f"({r['name']}) | {r['system']} | {r['latency_s'] * 1e6:.1f} | "
                     f"{r['speedup_vs_best_baseline']:.2f} | {r['speedup_vs_ring']:.1f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    scaling = run_sweep(expand_grid(["dgx-h100"], [MODEL], [80 * K, 512 * K, 2 * M, 5 * M],
                                    [1, 2, 4, 8, 16]),
                        ("tree", "butterfly", "allgather", "ring"))  # plus the pick row
    plots.speedup_vs_gpus(scaling, OUT / "speedup_vs_gpus.png")
    lengths = [16 * K, 64 * K, 256 * K, 1 * M, 4 * M]
    latency = run_sweep(expand_grid(["dgx-h100", "mi300x", "pcie-4090:gpus=8"], [MODEL],
                                    lengths))
    plots.latency_vs_seq_len(latency, OUT / "latency_vs_seq_len.png")
    memory = memory_rows("dgx-h100", 1 * M)
    plots.memory_vs_hidden(memory, OUT / "memory_vs_hidden.png")
    rows = scaling + latency + memory
    meta = {"python": sys.version.split()[0], "machine": platform.machine(),
            "model": MODEL, "seconds": round(time.perf_counter() - start, 2)}
    atomic.write_text(OUT / "gallery.json", json.dumps({"meta": meta, "rows": rows}, indent=1,
                                                       allow_nan=False) + "\n")
    picks = [r for r in scaling + latency if r["algorithm"] == "pick"]
    atomic.write_text(OUT / "gallery.md", "# Gallery data (predicted)\n\nThe planner's pick at "
                      "every point, against the strongest baseline and against Ring "
                      "Attention's pass-KV.\n\n" + _table(picks))
    print(f"wrote {OUT} in {meta['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
