"""Tree vs Ring decode of a real model (SmolLM2-135M) at long context, on local CPU ranks.

For each context length L (default 32k and 64k tokens) the KV cache is filled with L tokens
of a repeated document (``treeattn generate --context-tokens L``), sharded over ``world``
ranks (gloo on loopback, one torch thread per rank), and a short prompt is decoded greedily:

* in a single process (the reference for the tokens and for the attention time),
* with ``--algorithm tree``, with the planner's pick and with ``--algorithm ring``. The
  pick is what ``treeattn plan --profile`` would choose: this machine is calibrated once
  (``calibrate_in_group`` on ``world`` ranks, the model's head shape, one thread per rank,
  before any decoding) and the planner prices every algorithm with that profile;
* tree and the pick again, mirrored (single, tree, pick, ring, pick, tree, single), and in
  a single process again: this box's memory bandwidth drifts by tens of percent from
  minute to minute, so each of single, tree and the pick is the faster of its two runs,
  and the mirrored order cancels a steady drift out of their ratios.

Reported per point: tokens/s, attention time per token (all 30 layers: the executor running
the schedule, the new token's own key being part of its owner's shard), the single/tree,
single/planned and ring/tree ratios measured in the same run, whether the greedy tokens equal
the single-process ones, and tree's attention time against a floor: the KV bytes one rank
holds, read once at this machine's copy bandwidth (STREAM convention, one thread, measured
in this run). The ranks share the machine's cores, so the floor is a lower bound, not a
promise.

Run: ``.venv/bin/python benchmarks/generate.py [--contexts 32768 65536] [--world 2]``.
Writes ``benchmarks/results/generate.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from treeattn import testbed  # noqa: E402
from treeattn.commands.run import CalibrateJob  # noqa: E402
from treeattn.llm.formats.weights import load_model  # noqa: E402
from treeattn.llm.generate import generate_local  # noqa: E402
from treeattn.llm.generate_context import document_segment  # noqa: E402
from treeattn.llm.generate_dist import (  # noqa: E402
    GenerateRequest,
    generate_distributed,
    make_schedule,
    split_lengths,
)
from treeattn.runtime.launch import LaunchOptions, launch  # noqa: E402
from treeattn.runtime.measure.check import predictor  # noqa: E402
from treeattn.runtime.plans import build, workload_for  # noqa: E402
from treeattn.runtime.wire import AttnDims  # noqa: E402
from treeattn.testbed.calibration.calibrate import machine_info  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
PROMPT = " The keeper's daughter wrote that"


def copy_bandwidth(nbytes: int = 1 << 28, reps: int = 5) -> float:
    """Single-thread copy bandwidth in bytes/s (read + write counted), best of ``reps``."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best


def calibrated_pick(profile: dict, world: int, dims: AttnDims, lengths: list[int]):
    """The planner's choice for these shard lengths, priced with the calibrated profile."""
    topology, hardware, backend = predictor(profile, world)
    return build("auto", topology, workload_for(dims, lengths), (hardware, backend))


def run_point(loaded, prompt, segment, context, world, schedule, new_tokens) -> dict:
    algorithm = schedule.algorithm
    request = GenerateRequest(loaded.source, tuple(prompt), new_tokens, schedule,
                              None, context, tuple(segment))
    t0 = time.perf_counter()
    result = generate_distributed(request, world, timeout_s=600, loaded=loaded)
    gen = result["generation"]
    return {"algorithm": algorithm, "world": world, "context_tokens": context,
            "tokens": gen.tokens, "tokens_per_s": gen.tokens_per_s,
            "attention_s_per_token": gen.attention_per_token_s,
            "attention_median_s": gen.attention_median_s,
            "attention_steps_s": gen.attention_steps, "prefill_s": gen.prefill_s,
            "wall_s": time.perf_counter() - t0, "bytes_sent_rank0": result["bytes_sent"],
            "logits": gen.logits}


def run(contexts: list[int], world: int, new_tokens: int, model: str | None) -> dict:
    torch.set_num_threads(1)
    loaded = load_model(model)
    cfg = loaded.model.config
    prompt = loaded.tokenizer.encode(PROMPT)
    segment = document_segment(loaded.tokenizer)
    bandwidth = copy_bandwidth()
    dims = AttnDims(1, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, torch.float32)
    t0 = time.perf_counter()
    profile = launch(CalibrateJob(dims), world, LaunchOptions(threads=1))
    print(f"calibrated in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    points = []
    for context in contexts:
        lengths = split_lengths(context + len(prompt), world)
        schedules = {"tree": make_schedule("tree", world, cfg, lengths),
                     "planned": calibrated_pick(profile, world, dims, lengths),
                     "ring": make_schedule("ring", world, cfg, lengths)}
        ref = generate_local(loaded.model, prompt, new_tokens, None, None, context, segment)
        row = {"context_tokens": context, "single_tokens_per_s": ref.tokens_per_s,
               "single_attention_s_per_token": ref.attention_per_token_s,
               "single_prefill_s": ref.prefill_s}
        # tree and the pick run twice, mirrored around ring (A B C B A), so that a drift of
        # the machine's speed over the minutes of the run cancels out of their ratios.
        for key in ("tree", "planned", "ring", "planned", "tree"):
            point = run_point(loaded, prompt, segment, context, world, schedules[key],
                              new_tokens)
            logits = point.pop("logits")
            point["identical_to_single_process"] = point["tokens"] == ref.tokens
            point["max_abs_logit_diff"] = max(
                float((a - b).abs().max()) for a, b in zip(logits, ref.logits, strict=False))
            print(f"L={context} {point['algorithm']}: {point['attention_median_s'] * 1e3:.1f} ms "
                  f"attention/token, {point['tokens_per_s']:.2f} tokens/s", file=sys.stderr)
            if key not in row:
                point["attention_medians_s"] = [point["attention_median_s"]]
                row[key] = point
                continue
            first = row[key]
            first["attention_medians_s"].append(point["attention_median_s"])
            first["attention_median_s"] = min(first["attention_medians_s"])
            first["identical_to_single_process"] &= point["identical_to_single_process"]
        again = generate_local(loaded.model, prompt, new_tokens, None, None, context, segment)
        row["single_attention_medians_s"] = [ref.attention_median_s, again.attention_median_s]
        row["single_attention_median_s"] = min(row["single_attention_medians_s"])
        row["single_tokens_repeat"] = again.tokens == ref.tokens
        for key in ("tree", "planned"):
            row[f"single_over_{key}_attention"] = (row["single_attention_median_s"]
                                                   / row[key]["attention_median_s"])
        shard = max(lengths)
        kv_bytes = cfg.n_layers * 2 * cfg.n_kv_heads * cfg.head_dim * 4 * shard
        row["tree_floor_s_per_token"] = kv_bytes / bandwidth
        row["ring_over_tree_attention"] = (row["ring"]["attention_median_s"]
                                           / row["tree"]["attention_median_s"])
        row["tree_over_ring_tokens_per_s"] = (row["tree"]["tokens_per_s"]
                                              / row["ring"]["tokens_per_s"])
        points.append(row)
    return {"benchmark": "generate", "model": loaded.source, "world": world,
            "new_tokens": new_tokens, "prompt": PROMPT, "copy_bandwidth_Bps": bandwidth,
            "profile": profile,
            "machine": machine_info(), "points": points}


def markdown(result: dict) -> str:
    lines = [
        "# Real decoding, tree, the planner's pick and ring "
        f"(SmolLM2-135M, world {result['world']}, CPU ranks)",
        "",
        f"Model `{Path(result['model']).name}`, fp32, {result['new_tokens']} new tokens after "
        f"the prompt {result['prompt']!r}; copy bandwidth "
        f"{result['copy_bandwidth_Bps'] / 1e9:.1f} GB/s (1 thread). Machine: "
        f"{result['machine']['cpu']} × {result['machine']['cpu_count']}, "
        f"torch {result['machine']['torch']}.",
        "",
        "| context | single attn ms/tok (two runs) | tree attn ms/tok (two runs) "
        "| single/tree attn | planned attn ms/tok (two runs) | single/planned attn "
        "| ring attn ms/tok | ring/tree attn | tree tok/s | ring tok/s | tree floor ms/tok "
        "| tree/floor | prefill s (tree rank 0) | same tokens (tree, planned, ring) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for p in result["points"]:
        t, a, r = p["tree"], p["planned"], p["ring"]
        singles = " / ".join(f"{x * 1e3:.1f}" for x in p["single_attention_medians_s"])
        trees = " / ".join(f"{x * 1e3:.1f}" for x in t["attention_medians_s"])
        picks = " / ".join(f"{x * 1e3:.1f}" for x in a["attention_medians_s"])
        lines.append(
            f"| {p['context_tokens']} | {singles} "
            f"| {trees} | {p['single_over_tree_attention']:.2f}× "
            f"| {picks} ({a['algorithm']}) "
            f"| {p['single_over_planned_attention']:.2f}× "
            f"| {r['attention_median_s'] * 1e3:.1f} "
            f"| {p['ring_over_tree_attention']:.2f}× | {t['tokens_per_s']:.2f} "
            f"| {r['tokens_per_s']:.2f} | {p['tree_floor_s_per_token'] * 1e3:.1f} "
            f"| {t['attention_median_s'] / p['tree_floor_s_per_token']:.1f}× "
            f"| {t['prefill_s']:.1f} "
            f"| {t['identical_to_single_process']}, {a['identical_to_single_process']}, "
            f"{r['identical_to_single_process']} |")
    lines += ["", "Attention time is the median over the decode steps of one step's attention, "
              "all 30 layers; single/tree divides the faster single-process run by the "
              "faster tree run, single/planned likewise for the planner's pick with this "
              "machine's calibration. Runs are ordered single, tree, pick, ring, pick, tree, "
              "single, so a drift of the machine's speed cancels out of the ratios. "
              "The long context is "
              "a repeated document whose copies are encoded independently (see "
              "`treeattn/llm/generate_context.py`); past the model's trained context of "
              "8192 the text is not meaningful, the timing is."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    testbed.plug_in()  # CPU ranks of one host: the transport `treeattn run` uses
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[32768, 65536])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=12)  # 11 timed decode steps
    parser.add_argument("--model", default=None)
    args = parser.parse_args(argv)
    result = run(args.contexts, args.world, args.new_tokens, args.model)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "generate.json").write_text(json.dumps(result, indent=2))
    (RESULTS / "generate.md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
