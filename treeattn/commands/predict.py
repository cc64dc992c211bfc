"""`treeattn predict` and `treeattn plan`: simulate the reductions of one decode step.

``predict`` prints, per sequence length, the predicted latency of the best tree-style plan
(``tree``: tree shapes, butterfly and all-gather), of each named algorithm, of the paper's
three all-reduces and of Ring Attention. ``plan`` prints the chosen tree and the ranking.
"""

from __future__ import annotations

import argparse
import json
import sys

from rich.console import Console

from treeattn import atomic
from treeattn.atomic import check_distinct, check_output_path
from treeattn.commands._args import (
    add_nccl_env_flag,
    parse_tokens,
    positive_int,
    record_flags,
    refuse_unread,
)
from treeattn.commands.tables import Column, add_wide_flag, print_table, say
from treeattn.commands.token import (
    add_token_flags,
    handle_plan_gpus,
    handle_predict_token,
    memory_rows_check,
    transports_of,
)
from treeattn.schedule.algorithms import ALGORITHM_NAMES, SOURCES
from treeattn.schedule.payloads import PARTIAL_DTYPES
from treeattn.sim import DecodeWorkload, SimError, plan_workload
from treeattn.sim.deploy.engines import EMIT_TARGETS, describe, emit
from treeattn.sim.files.export import schedule_to_json, tagged, trace_json
from treeattn.sim.files.profiles import plan_overrides
from treeattn.sim.planning.plan_size import check_planning_size, planning_limits
from treeattn.sim.prefill.pricing import SOURCES as SOURCES_PREFILL
from treeattn.sweep.rows import PICK, algorithm_rows

PLAN_PREFILL_GPUS = 1024  # plan prices the prefill beside the decode up to here (~1.4 s)
# The flags (argparse dests) each mode of the two commands reads; any other flag given a
# value is refused (treeattn.commands._args.refuse_unread), with the reason where one helps.
SHARED_READS = frozenset({"topology", "model", "seq_len", "json", "wide", "profile",
                          "nccl_env"})
DECODE_READS = SHARED_READS | {"batch", "tp", "layout", "trace",
                               "weights_dtype", "kv_dtype", "transport", "partial_dtype"}
PREFILL_READS = SHARED_READS | {"prefill", "context_tokens"}
NOT_DECODE = {
    "context_tokens": "--context-tokens prices a prefill after cached tokens: use it with "
                      "--prefill (a decode's context is its --seq-len)",
    "dcp": "--dcp shards a TP group's cache in a whole decode step: use it with --token",
}
NOT_PREFILL = {
    "batch": "the prefill is priced for one sequence without tensor parallelism",
    "tp": "the prefill is priced for one sequence without tensor parallelism",
    "transport": "the prefill is priced on NCCL's send/recv; --transport restricts the "
                 "decode's collectives",
    "trace": "--trace draws decode timelines; the prefill is priced in closed form",
    "token": "--token prices a decode step",
    "weights_dtype": "the prefill is priced in the model's own dtype",
    "kv_dtype": "the prefill is priced in the model's own dtype",
    "dcp": "--dcp shards a TP group's cache in a whole decode step",
    "layout": "--layout places a decode's merged output",
}
MAX_SEQ_LENS = 16  # predict's --seq-len values: each is a planner run (a second or more)
DEMO_TOPOLOGIES = ("dgx-h100:nodes=1", "dgx-h100:nodes=16", "mi300x", "pcie-4090:gpus=8")
DEMO_SEQ_LENS = (32 * 1024, 128 * 1024, 1024 * 1024)
DEMO_MODEL = "llama-3.1-8b"


def _common(parser: argparse.ArgumentParser, many: bool) -> None:
    parser.add_argument("--topology", required=True, help="topology spec, e.g. dgx-h100:nodes=2")
    parser.add_argument("--model", required=True, help="model name, e.g. llama-3.1-8b")
    parser.add_argument("--seq-len", type=parse_tokens, required=True,
                        action="append" if many else None,
                        help="cached tokens" + (" (repeatable)" if many else ""))
    parser.add_argument("--batch", type=positive_int, default=1, help="sequences decoded together")
    parser.add_argument("--tp", type=positive_int, default=1,
                        help="tensor-parallel size: heads split over this many GPUs (a host's "
                             "first), the sequence over the rest")
    parser.add_argument("--layout", choices=("replicated", "head_sharded"), default="replicated",
                        help="where the merged output must land (head_sharded: a "
                             "tensor-parallel output projection follows)")
    parser.add_argument("--profile", help="calibration profile JSON: CPU ranks (calibrate) or "
                                          "a GPU cluster (calibrate --nccl-tests)")
    add_nccl_env_flag(parser)
    parser.add_argument("--partial-dtype", choices=PARTIAL_DTYPES, default=None,
                        help="how partials travel for every algorithm: fp32, or bf16 (o in "
                             "bf16, lse in fp32); default: treeattn's schedules fp32, each "
                             "baseline its engine's format (bf16 o for a 16-bit model)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    add_wide_flag(parser)
    parser.add_argument("--trace", metavar="FILE", default=None,
                        help="write the simulated timelines as a Chrome/Perfetto trace")
    add_token_flags(parser)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("predict", help="predict decode-step latency per algorithm")
    _common(p, many=True)
    p.add_argument("--prefill", action="store_true",
                   help="price the prefill of a --seq-len token prompt instead: time to first "
                        "token of pass-KV, pass-Q and all-gather-KV (plan always shows the "
                        "prefill pick beside the decode pick)")
    p.add_argument("--context-tokens", type=parse_tokens, default=0, metavar="C",
                   help="with --prefill: tokens before the prompt whose K/V are already in "
                        "the shards (a document, earlier turns); pass-Q moves only the "
                        "prompt's queries, so it wins when C dwarfs the prompt")
    p.add_argument("--token", action="store_true",
                   help="price one whole decode step (weights, TP all-reduces, attention and "
                        "its merge, LM head): TPOT and tokens/s")
    p.set_defaults(func=handle_predict)
    record_flags(p)
    q = subparsers.add_parser("plan", help="choose the reduction tree for a cluster")
    _common(q, many=False)
    q.add_argument("-o", "--output", metavar="PLAN.json", default=None,
                   help="write the plan file (with its schedule) that run/generate --plan execute")
    q.add_argument("--emit", choices=EMIT_TARGETS, default=None,
                   help="print the serving engine's flags for the best plan it can express "
                        "(--tp sets its DCP size: GPUs / tp), beside treeattn's pick")
    q.add_argument("--gpus", type=positive_int, default=None,
                   help="search the TP × DCP × CP splits of this many GPUs (the topology's "
                        "first) for the lowest time per output token")
    q.set_defaults(func=handle_plan)
    record_flags(q)


def _load(args: argparse.Namespace, seq_len: int):
    """Topology, workload and (hardware, backend) overrides for one sequence length."""
    from treeattn.topo import Topology

    with planning_limits():
        topo = Topology.load(args.topology)
    if topo.num_gpus < 2:
        raise SimError(f"topology {args.topology!r} has one GPU: there is no reduction to plan")
    note = check_planning_size(topo.num_gpus, f"topology {args.topology!r}")
    if note:
        say(note, sys.stderr)
    workload = DecodeWorkload(args.model, seq_len, batch=args.batch, layout=args.layout,
                              tp=args.tp, partial_dtype=args.partial_dtype)
    return topo, workload, plan_overrides(args.profile, topo, args.nccl_env)


def _prefill(args: argparse.Namespace, seq_len: int) -> list:
    """The prefill predictions of one prompt length, fastest first."""
    from treeattn.sim.prefill.pricing import predict_prefill
    from treeattn.topo import Topology

    with planning_limits():
        topo = Topology.load(args.topology)
    overrides = plan_overrides(args.profile, topo, args.nccl_env)
    return predict_prefill(topo, args.model, seq_len, overrides.get("hardware"),
                           overrides.get("backend"),
                           context=getattr(args, "context_tokens", 0))


def handle_prefill(args: argparse.Namespace) -> int:
    rows = []
    for seq_len in args.seq_len:
        rows += [{"seq_len": seq_len, "context_tokens": args.context_tokens, **p.to_json()}
                 for p in _prefill(args, seq_len)]
    if args.json:
        print(json.dumps(tagged("prefill_predictions", rows), indent=2, allow_nan=False))
        return 0
    columns = [Column("seq_len", key=True), Column("algorithm", key=True, justify="left"),
               Column("TTFT", key=True), Column("peak", key=True),
               Column("attention / layer"), Column("sent / layer"),
               Column("system", justify="left")]
    cells = [[f"{r['seq_len']:,}", r["algorithm"], _ttft(r["ttft_s"]),
              _size(r["peak_memory_bytes"]) + ("" if r["fits"] else " ✗"),
              _time(r["attention_s"]), _size(r["comm_bytes"]), r["system"]] for r in rows]
    print_table(Console(), columns, cells, wide=args.wide,
                title=f"Predicted prefill (time to first token): {args.topology}, "
                      f"{args.model}, zig-zag causal balance"
                      + (f", after {args.context_tokens:,} cached tokens"
                         if args.context_tokens else ""),
                caption="peak: shard + blocks in flight per rank (weights apart); "
                        "✗: does not fit beside the weights")
    return 0


def _decode_merge_only(args: argparse.Namespace, flag: str) -> None:
    """``--partial-dtype`` prices the decode's merge; the whole-step searches do not take it."""
    if args.partial_dtype:
        raise SimError(f"--partial-dtype sets how the decode's partials travel; {flag} does "
                       "not take it (drop one)")


def handle_predict(args: argparse.Namespace) -> int:
    args.seq_len = list(dict.fromkeys(args.seq_len))  # each length once, in the given order
    if len(args.seq_len) > MAX_SEQ_LENS:
        raise SimError(f"{len(args.seq_len)} --seq-len values, expected at most "
                       f"{MAX_SEQ_LENS} (each is one planner run): predict fewer at a time")
    for flag, on in (("--prefill", args.prefill), ("--token", args.token)):
        if on:
            _decode_merge_only(args, flag)
    if args.prefill:
        refuse_unread(args, "predict --prefill", PREFILL_READS, NOT_PREFILL)
        return handle_prefill(args)
    if args.token:
        return handle_predict_token(args)
    refuse_unread(args, "predict", DECODE_READS, NOT_DECODE)
    if args.trace is not None:  # "" included: refused as an empty path
        check_output_path(args.trace)
    rows, timelines, unfit, refused = [], [], [], {}
    for seq_len in args.seq_len:
        topo, workload, overrides = _load(args, seq_len)
        memory = memory_rows_check(args, topo, seq_len, args.tp)
        if not memory["fits"]:
            unfit.append((seq_len, memory["memory"]))
        chosen = plan_workload(topo, workload, simulate_each=True,
                               transports=transports_of(args, topo), **overrides)
        refused.update(chosen.refused)
        rows += [{**r.to_json(), **memory} for r in algorithm_rows(chosen, args.topology)]
        for algorithm in ALGORITHM_NAMES:
            cand = chosen.best(algorithm)
            if cand is not None and cand.result is not None and cand.result.timeline:
                timelines.append((f"predicted: {cand.name} @ {seq_len}", cand.result.timeline))
    if args.trace:
        atomic.write_text(args.trace, json.dumps(trace_json(timelines), allow_nan=False))
    if args.json:
        print(json.dumps(tagged("predictions", rows), indent=2, allow_nan=False))
        return 0
    columns = [Column("seq_len", key=True), Column("algorithm", key=True, justify="left"),
               Column("transport", key=True, justify="left"),
               Column("layer", key=True), Column("vs best baseline", key=True),
               Column("token"), Column("plan", justify="left"), Column("vs ring pass-KV"),
               Column("peak mem"), Column("comm"), Column("system", justify="left")]
    cells = [[f"{r['seq_len']:,}", r["algorithm"], r["transport"],
              _time(r["latency_s"]) + ("" if r["method"] == "simulated" else "†"),
              f"{r['speedup_vs_best_baseline']:.2f}×", _time(r["token_latency_s"]), r["name"],
              f"{r['speedup_vs_ring']:.1f}×", _size(r["peak_memory_bytes"]),
              _size(r["comm_bytes"]), r["system"]] for r in rows]
    print_table(Console(), columns, cells, wide=args.wide,
                title=f"Predicted attention per layer: {args.topology}, {args.model}, "
                      f"batch {args.batch}, output {rows[0]['layout']}",
                caption="† closed form only (not simulated). vs best baseline: against the "
                        "fastest of what serving systems run today, on any transport (>1: "
                        "faster). nccl-symm: NCCL's symmetric kernels; symm_mem: torch's; "
                        "mnnvl_ll128: FlashInfer's LL128 all-to-all.",
                row_styles=["bold" if r["algorithm"] == PICK else None for r in rows])
    for reason in refused.values():
        say(f"Not priced: {reason}.")
    for r in rows:
        if r["algorithm"] == PICK and r["speedup_vs_best_baseline"] <= 1.0:
            say(f"At {r['seq_len']:,} tokens a baseline wins: {r['name']} "
                f"({r['system']}) is the fastest, and the planner picks it.")
    for seq_len, why in unfit:
        say(f"At {seq_len:,} tokens the model does not fit ({why}): these rows cannot run.")
    return 0


def handle_plan(args: argparse.Namespace) -> int:
    if args.gpus is not None:
        _decode_merge_only(args, "--gpus")
        return handle_plan_gpus(args)
    refuse_unread(args, "plan", DECODE_READS | {"output", "emit"}, NOT_DECODE)
    check_distinct(args.output, args.trace)
    for path in (args.output, args.trace):
        if path:
            check_output_path(path)
    topo, workload, overrides = _load(args, args.seq_len)
    memory = memory_rows_check(args, topo, args.seq_len, args.tp)
    if not memory["fits"]:
        raise SimError(f"{workload.describe()} with --tp {args.tp} does not fit: "
                       f"{memory['memory']}")
    allowed = transports_of(args, topo)
    engine = emit(args.emit, topo, workload, overrides, allowed) if args.emit else None
    chosen = plan_workload(topo, workload, transports=allowed, **overrides)
    extras = {k: v for k, v in memory.items() if k != "memory"}
    # one sequence without tensor parallelism: what the prefill pricing covers
    priced = args.batch == 1 and args.tp == 1 and topo.num_gpus <= PLAN_PREFILL_GPUS
    prefill = _prefill(args, args.seq_len) if priced else None
    if prefill:
        extras["prefill"] = [p.to_json() for p in prefill]
    if engine is not None:
        extras["emit"] = engine
    record = {**plan_file(chosen, args.topology), **extras}
    runnable = chosen
    if args.output and chosen.winner.transport != "nccl":
        # the file is for run/generate --plan, whose runtime sends on regular collectives
        runnable = plan_workload(topo, workload, transports=("nccl",), **overrides)
    if args.output:
        written = record if runnable is chosen else {**plan_file(runnable, args.topology),
                                                     **extras}
        atomic.write_text(args.output, json.dumps(written, indent=1, allow_nan=False) + "\n")
    if args.trace:
        timeline = chosen.prediction.timeline
        atomic.write_text(args.trace, json.dumps(
            trace_json([(f"predicted: {chosen.name}", timeline)]), allow_nan=False))
    if args.json:
        print(json.dumps(record, indent=2, default=float, allow_nan=False))
        return 0
    console = Console()
    console.print(f"[bold]{chosen.name}[/bold] ({SOURCES[chosen.algorithm]}): "
                  f"{_time(chosen.latency_s)} per layer, "
                  f"{_time(chosen.token_latency_s())} per token ({chosen.prediction.method}); "
                  f"output {workload.layout}")
    if chosen.tp > 1:
        model = chosen.workload.model
        console.print(f"Tensor parallel {chosen.tp}: each of the {chosen.tp} context-parallel "
                      f"groups ({chosen.topology.num_gpus} GPUs, one per TP group) merges "
                      f"{model.n_heads} query / {model.n_kv_heads} KV heads on its own; "
                      "group 0 is planned.")
    if args.batch == 1 and args.tp == 1 and not priced:
        console.print(f"The prefill pick is left out past {PLAN_PREFILL_GPUS:,} GPUs (its "
                      "price walks every GPU pair's route): `treeattn predict --prefill` "
                      "prices it.")
    if prefill:
        pick, *others = prefill
        rest = ", ".join(f"{p.algorithm} {_ttft(p.ttft_s)}" for p in others)
        console.print(f"Prefill of {args.seq_len:,} tokens: [bold]{pick.algorithm}[/bold] "
                      f"({SOURCES_PREFILL[pick.algorithm]}), time to first token "
                      f"{_ttft(pick.ttft_s)} (then {rest})"
                      + ("; priced on NCCL's send/recv, --transport applies to the decode"
                         if args.transport else ""))
    if runnable is not chosen:
        console.print(f"{args.output} holds the best plan treeattn's runtime executes, on "
                      f"regular NCCL: {runnable.name}, {_time(runnable.latency_s)} per layer "
                      f"(the pick runs on {chosen.winner.transport})")
    baseline = chosen.best_baseline()
    if baseline is not None and baseline is chosen.winner:
        console.print(f"A baseline wins here: {baseline.name} ({SOURCES[baseline.algorithm]}) "
                      "is the fastest plan.")
    elif baseline is not None:
        console.print(f"{baseline.latency_s / chosen.latency_s:.2f}× faster than the best "
                      f"baseline, {baseline.name} ({SOURCES[baseline.algorithm]}, "
                      f"{_time(baseline.latency_s)})")
    tree = chosen.tree
    if tree is None:
        best_tree = next((c for c in chosen.candidates if c.algorithm == "tree"), None)
        console.print(f"{chosen.algorithm} uses no single tree."
                      + (f" Best tree, {best_tree.name}:" if best_tree else ""))
        tree = best_tree.trees[0] if best_tree else None
    if tree is not None:
        console.print(tree.ascii(), markup=False, highlight=False)
    print_table(console, [Column("#"), Column("candidate", key=True, justify="left"),
                          Column("latency", key=True), Column("method", justify="left")],
                [[str(i), c.name, _time(c.latency_s), c.method]
                 for i, c in enumerate(chosen.candidates[:15], 1)],
                title="Candidates (closed_form = lower bound, not simulated)", wide=args.wide)
    console.print(chosen.explain())
    if engine is not None:
        print("\n".join(describe(engine)))  # plain: the flags line is copied as is
    return 0


def plan_file(chosen, topology_spec: str) -> dict:
    """The versioned plan: what was chosen, for which workload and cluster, and the schedule
    itself, which ``run --plan`` and ``generate --plan`` execute step for step."""
    w = chosen.workload
    body = chosen.to_json()
    body.update(topology=topology_spec, model=w.model.name, seq_len=w.seq_len,
                shard_lengths=list(w.shards(chosen.topology.num_gpus)),
                schedule=schedule_to_json(chosen.schedule))
    return tagged("plan", body)


def _time(seconds: float) -> str:
    return f"{seconds * 1e6:,.1f} µs" if seconds < 1e-2 else f"{seconds * 1e3:,.2f} ms"


def _ttft(seconds: float) -> str:
    return f"{seconds:,.2f} s" if seconds >= 1 else _time(seconds)


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return str(n)


def demo_speedups() -> list[dict]:
    """The planner's pick on the demo clusters against the strongest baseline at each point
    (and against Ring Attention's pass-KV, the paper's comparison)."""
    from treeattn.topo import Topology

    out = []
    for spec in DEMO_TOPOLOGIES:
        topo = Topology.from_spec(spec)
        for seq_len in DEMO_SEQ_LENS:
            chosen = plan_workload(topo, DecodeWorkload(DEMO_MODEL, seq_len), simulate_each=True)
            pick, baseline, ring = chosen.winner, chosen.best_baseline(), chosen.best("ring")
            out.append({"topology": spec, "gpus": topo.num_gpus, "seq_len": seq_len,
                        "pick": pick.name, "pick_s": pick.latency_s,
                        "baseline": baseline.name, "baseline_s": baseline.latency_s,
                        "vs_baseline": baseline.latency_s / pick.latency_s,
                        "ring_s": ring.latency_s, "vs_ring": ring.latency_s / pick.latency_s,
                        "ring_method": ring.method})
    return out


def demo_section(console: Console) -> int:
    """Predicted decode attention: the planner's pick against the strongest baseline."""
    columns = [Column("topology", key=True, justify="left"), Column("seq_len", key=True),
               Column("pick", key=True, justify="left"), Column("time", key=True),
               Column("vs best baseline", key=True), Column("best baseline", justify="left"),
               Column("baseline time"), Column("vs ring pass-KV"), Column("GPUs")]
    cells = [[r["topology"], f"{r['seq_len']:,}", r["pick"], _time(r["pick_s"]),
              f"{r['vs_baseline']:.2f}×", r["baseline"], _time(r["baseline_s"]),
              f"{r['vs_ring']:.0f}×" + ("" if r["ring_method"] == "simulated" else "†"),
              str(r["gpus"])] for r in demo_speedups()]
    print_table(console, columns, cells,
                title=f"Predicted decode attention per layer, {DEMO_MODEL}: the planner's "
                      "pick against the strongest baseline",
                caption="best baseline: the fastest of what serving systems run today "
                        "(1.00×: a baseline is the pick). † ring by its closed form.")
    return 0
