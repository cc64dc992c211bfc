"""Fidelity of the token model's kernel prices against published kernel measurements.

For every table in ``benchmarks/data/published_kernels.json`` (decode GEMMs, fused-MoE calls
and decode attention kernels, each with its source), price the same kernel as
:func:`treeattn.sim.deploy.token.predict_token` charges it and compare. The rows a constant
was read from are listed and not scored. ``benchmarks/fidelity.py`` writes this section into
``benchmarks/results/fidelity.{json,md}``.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scoring import geo_error, pct  # noqa: E402

ROOT = Path(__file__).resolve().parent
KERNELS = ROOT / "data" / "published_kernels.json"


def score_kernels() -> list[dict]:
    """Every published kernel row against the token model's price of the same kernel: the
    GPU's hardware model reading the row's bytes at its dtype's sourced rate
    (:func:`treeattn.sim.devices.weight_read_factor`), or its FLOPs at the dense peak, plus
    one graph-replayed kernel's fixed cost (``graph_kernel_s``), as the token model charges
    each GEMM. A row's bytes are its published time × its published bandwidth where the
    source gives one (as the source counts them), else the weight's ``N·K`` elements and the
    ``M·(N + K)`` 16-bit activations.
    """
    from treeattn.sim.devices import hardware_for, weight_read_factor

    width = {"fp4": 4.5 / 8, "fp8": 1, "bf16": 2, "fp16": 2}
    out = []
    for table in json.loads(KERNELS.read_text())["tables"]:
        hw = hardware_for(table["gpu"])
        if table["kind"] == "attention":
            out += [_attention_point(table, p, hw, width[table["dtype"]])
                    for p in table["points"]]
            continue
        if table["kind"] == "moe":
            out += [_moe_point(table, p, hw) for p in table["points"]]
            continue
        dtype = {"fp4": "float4", "fp8": "float8", "bf16": "bfloat16"}.get(table["dtype"],
                                                                         table["dtype"])
        slower = weight_read_factor(table["gpu"], dtype, hw.name)
        for p in table["points"]:
            flops = 2.0 * p["m"] * p["n"] * p["k"]
            published = (p["time_us"] * 1e-6 if "time_us" in p
                         else flops / (p["tflops"] * 1e12))
            if "gbps" in p:
                nbytes = published * p["gbps"] * 1e9
            else:
                nbytes = (p["n"] * p["k"] * width[table["dtype"]]
                          + p["m"] * (p["n"] + p["k"]) * 2)
            predicted = (hw.compute_time(nbytes * slower, flops) - hw.launch_s
                         + hw.graph_kernel_s)
            out.append({"table": table["id"], "url": table["url"], "gpu": table["gpu"],
                        "dtype": table["dtype"], "m": p["m"], "n": p["n"], "k": p["k"],
                        "scored": p["scored"], "unscored_as": _unscored_as(table),
                        "published_us": round(published * 1e6, 3),
                        "predicted_us": round(predicted * 1e6, 3),
                        "ratio": round(predicted / published, 4)})
    return out


def _unscored_as(table: dict) -> str:
    """How a GEMM table's unscored rows are labelled: a constant was read from them, unless
    the table says it sets none (``sets_a_constant: false``; its ``why_not_scored`` says
    why its rows are left out)."""
    return "source, not scored" if table.get("sets_a_constant", True) else "not scored"


def _moe_point(table: dict, p: dict, hw) -> dict:
    """A published fused-MoE call (one layer's routed experts, as the engine's benchmark
    script times it) against :func:`treeattn.sim.moe_gemm.fused_moe_span_s`: the touched
    experts' bytes at the fused-MoE rate plus its span's kernels' fixed costs."""
    from treeattn.sim.moe_gemm import fused_moe_span_s

    s = table["shape"]
    shape = (s["experts"], s["topk"], s["hidden"], s["n"])
    dtype = {"fp8": "float8", "bf16": "bfloat16"}[table["dtype"]]
    predicted = fused_moe_span_s(hw, table["gpu"], shape, p["m"], dtype, table["engine"])
    return {"table": table["id"], "url": table["url"], "gpu": table["gpu"],
            "dtype": table["dtype"], "kind": "moe", "m": p["m"],
            "experts": f"{s['topk']}/{s['experts']}", "k": s["hidden"], "n": s["n"],
            "scored": p["scored"], "unscored_as": _unscored_as(table),
            "published_us": p["time_us"], "predicted_us": round(predicted * 1e6, 3),
            "ratio": round(predicted / (p["time_us"] * 1e-6), 4)}


def _attention_point(table: dict, p: dict, hw, width: int) -> dict:
    """A published decode attention against :func:`treeattn.sim.decode_kernels.
    engine_decode_attention_s` for the kernel the source ran: its K and V bytes over the
    kernel's split-KV grid, plus its kernels' fixed costs."""
    from treeattn.sim.decode_kernels import engine_decode_attention_s

    kv = 2 * p["batch"] * p["kv_heads"] * p["context"] * p["head_dim"] * width
    predicted = engine_decode_attention_s(hw, table["gpu"], kv, kv, 0, batch=p["batch"],
                                          kv_heads=p["kv_heads"], q_heads=p["q_heads"],
                                          context=p["context"], kernel=table["kernel"])
    published = p["time_us"] * 1e-6
    return {"table": table["id"], "url": table["url"], "gpu": table["gpu"],
            "dtype": table["dtype"], "kind": "attention", "kernel": table["kernel"],
            "batch": p["batch"], "heads": f"{p['q_heads']}/{p['kv_heads']}",
            "context": p["context"], "scored": p["scored"],
            "published_us": p["time_us"], "predicted_us": round(predicted * 1e6, 3),
            "ratio": round(predicted / published, 4)}


def kernel_summary(points: list[dict]) -> list[dict]:
    """Per GPU and dtype: the scored rows' count and geometric-mean error."""
    groups: dict[tuple[str, str], list[float]] = defaultdict(list)
    for p in points:
        if p["scored"]:
            moe = " MoE" if p.get("kind") == "moe" else ""
            groups[(p["gpu"], p["dtype"] + moe)].append(p["ratio"])
    return [{"gpu": gpu, "dtype": dtype, "points": len(r), "geo_error": geo_error(r),
             "low": min(r), "high": max(r)} for (gpu, dtype), r in sorted(groups.items())]


def _row(p: dict, middle: list, unscored: str) -> str:
    """One kernel row: its table and GPU, the ``middle`` cells, the published and predicted
    µs, their ratio, and "yes" where it is scored (else ``unscored``)."""
    cells = [f"[{p['table']}]({p['url']})", p["gpu"], *middle, f"{p['published_us']:g}",
             f"{p['predicted_us']:g}", f"{p['ratio']:.2f}", "yes" if p["scored"] else unscored]
    return "| " + " | ".join(str(c) for c in cells) + " |"


def kernel_markdown(points: list[dict]) -> str:
    scored = [p["ratio"] for p in points if p["scored"]]
    lines = ["## Kernels against published measurements", "",
             "The token model's price of a decode-sized kernel (the GPU's hardware model at "
             "its dtype's sourced rate, plus one graph-replayed kernel's fixed cost) against "
             "published, measured kernels. Rows a constant was read from are listed as "
             "\"source, not scored\"; rows left out for another reason as \"not scored\", "
             "with the reason under the tables.", "",
             f"Scored rows: {len(scored)}; geometric-mean error {pct(geo_error(scored))}; "
             f"predicted / published from {min(scored):.2f} to {max(scored):.2f}.", "",
             "| GPU | dtype | scored rows | error | predicted / published |",
             "|---|---|---:|---:|---|"]
    for g in kernel_summary(points):
        lines.append(f"| {g['gpu']} | {g['dtype']} | {g['points']} | "
                     f"{pct(g['geo_error'])} | {g['low']:.2f}-{g['high']:.2f} |")
    lines += ["", "| table | GPU | dtype | M | N | K | published µs | predicted µs | ratio | "
              "scored |", "|---|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for p in (p for p in points if p.get("kind") is None):
        lines.append(_row(p, [p["dtype"], p["m"], p["n"], p["k"]], p["unscored_as"]))
    moe = [p for p in points if p.get("kind") == "moe"]
    if moe:
        lines += ["", "Fused-MoE calls (one layer's routed experts at M tokens, as the engine's "
                  "benchmark script times them), priced as the touched experts' bytes at the "
                  "fused-MoE rate plus the span's kernels' fixed costs "
                  "(`treeattn.sim.moe_gemm`):", "",
                  "| table | GPU | dtype | top-k/experts | hidden | N | M | published µs | "
                  "predicted µs | ratio | scored |",
                  "|---|---|---|---|---:|---:|---:|---:|---:|---:|---|"]
        for p in moe:
            lines.append(_row(p, [p["dtype"], p["experts"], p["k"], p["n"], p["m"]],
                              p["unscored_as"]))
    attention = [p for p in points if p.get("kind") == "attention"]
    if attention:
        lines += ["", "Decode attention at batch 1 with few KV heads per GPU, priced by the "
                  "split-KV grid model for the kernel the source ran "
                  "(`treeattn.sim.decode_kernels`):", "",
                  "| table | GPU | kernel | dtype | batch | heads (q/kv) | context | "
                  "published µs | predicted µs | ratio | scored |",
                  "|---|---|---|---|---:|---|---:|---:|---:|---:|---|"]
        for p in attention:
            lines.append(_row(p, [p["kernel"], p["dtype"], p["batch"], p["heads"],
                                  p["context"]], "no"))
    for table in json.loads(KERNELS.read_text())["tables"]:
        lines.append("")
        unscored = any(not p["scored"] for p in table["points"])
        label = ("Source, not scored" if table["kind"] in ("gemm", "moe")
                 and table.get("sets_a_constant", True) else "Not scored")
        note = f" {label}: {table['why_not_scored']}." if unscored else ""
        lines.append(f"- `{table['id']}`: {table['hardware']}; {table['library']}; "
                     f"{table['source']}.{note}")
    return "\n".join(lines) + "\n"
