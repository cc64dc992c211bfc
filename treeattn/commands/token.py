"""``predict --token`` and ``plan --gpus N``: whole decode steps, and the deployment search.

``predict --token`` prices one whole decode step per output token of the deployment given
by ``--tp`` (and ``--dcp``) on all of the topology's GPUs (``cp = GPUs / tp``), for each
``--seq-len`` (:func:`treeattn.sim.deploy.token.predict_token`). ``plan --gpus N`` searches every
TP × DCP × CP split of ``N`` GPUs and the merge algorithm for each
(:func:`treeattn.sim.deploy.deployments.search`), and shows the best by TPOT with those it beat.

Both carry the whole-model memory check (:mod:`treeattn.sim.deploy.capacity`); the plain
``predict`` and ``plan`` commands use :func:`memory_rows_check` for theirs.
"""

from __future__ import annotations

import argparse
import json
import sys

from rich.console import Console

from treeattn.commands._args import positive_int, refuse_unread
from treeattn.commands.tables import Column, print_table
from treeattn.schedule.payloads import SimError
from treeattn.schedule.workload import ModelConfig
from treeattn.sim.deploy.capacity import Split, dtype_name, memory_check
from treeattn.sim.network import TRANSPORTS
from treeattn.topo.hardware import normalize_model

# plan --gpus prices every split of its budget, each a planner run on its CP ranks: measured
# 20 s for --gpus 512 (treeattn plan --gpus 512 --topology dgx-h100:nodes=64 --model
# llama-3.1-8b --seq-len 1M, the 2-core CPU host), about SEARCH_SECONDS_PER_GPU each. Past
# SEARCH_NOTE_GPUS a note gives that estimate first; past MAX_SEARCH_GPUS (over a minute) the
# search is refused before any work: search a slice, or plan one split with predict --token.
SEARCH_SECONDS_PER_GPU = 0.04
SEARCH_NOTE_GPUS = 256
MAX_SEARCH_GPUS = 2048

# The flags (argparse dests) each mode reads; any other flag given a value is refused.
TOKEN_READS = frozenset({"topology", "model", "seq_len", "json", "wide", "profile", "token",
                         "batch", "tp", "dcp", "weights_dtype", "kv_dtype", "transport",
                         "nccl_env"})
GPUS_READS = frozenset({"topology", "model", "seq_len", "json", "wide", "profile", "gpus",
                        "batch", "weights_dtype", "kv_dtype", "transport", "nccl_env"})
NOT_TOKEN = {
    "trace": "a whole step is priced without drawing its timeline: `treeattn predict "
             "--trace` draws the merge's",
    "layout": "a whole step places the merged output as its split needs: head-sharded for "
              "TP alone, else replicated",
    "context_tokens": "--context-tokens prices a prefill after cached tokens: use it with "
                      "--prefill",
}
NOT_GPUS = {
    "tp": "the search tries every TP × DCP × CP split",
    "dcp": "the search tries every TP × DCP × CP split",
    "layout": "each split places the merged output as it needs",
    "output": "-o writes one merge's plan for run/generate --plan: plan without --gpus",
    "trace": "--trace draws one merge's timeline: plan without --gpus",
    "emit": "--emit prints one merge's engine flags: plan without --gpus",
}


def add_token_flags(parser: argparse.ArgumentParser) -> None:
    """The whole-model flags ``predict`` and ``plan`` share."""
    parser.add_argument("--weights-dtype", choices=("bf16", "fp16", "fp8", "fp4", "fp32"),
                        default=None, help="weight dtype of the deployment (default: the "
                        "model's; fp4: NVFP4, Blackwell only)")
    parser.add_argument("--kv-dtype", choices=("bf16", "fp16", "fp8", "fp32"), default=None,
                        help="KV-cache dtype (default: the model's)")
    parser.add_argument("--dcp", type=positive_int, default=1,
                        help="decode context parallelism inside the TP group (with --token): "
                             "the KV cache sharded over this many of the TP ranks")
    parser.add_argument("--transport", action="append", choices=TRANSPORTS, default=None,
                        help="allow only this transport for collectives and messages "
                             "(repeatable; default: every one the cluster offers). nccl-symm, "
                             "symm_mem and mnnvl_ll128 run inside one NVLink domain")


def transports_of(args, topology, groups: list[list[int]] | None = None) -> tuple[str, ...]:
    """The transports ``--transport`` allows, each checked against the GPUs it would serve:
    one that none of ``groups`` (rank lists; default: every GPU) can use is an error, not
    a silent fallback (symmetric memory across InfiniBand, LL128 FIFOs without an MNNVL
    fabric)."""
    if not args.transport:
        return TRANSPORTS
    from treeattn.sim.nccl.group_shape import GroupShape
    from treeattn.sim.onesided import unoffered_reason

    groups = [g for g in groups or [list(range(topology.num_gpus))] if len(g) > 1]
    for name in args.transport:
        if name == "nccl":
            continue
        reasons = []
        for group in groups:
            try:
                reasons.append(unoffered_reason(name, GroupShape.of(topology, group)))
            except SimError as exc:  # GPUs the library model does not know, CPU ranks
                reasons.append(str(exc))
        if not groups or all(reasons):
            why = reasons[0] if reasons else "a transport needs at least two GPUs"
            raise SimError(f"--transport {name} on {args.topology}: {why}")
    return tuple(dict.fromkeys(args.transport))


def _dtypes(args, model: ModelConfig) -> tuple[str, str]:
    return (dtype_name(args.weights_dtype, model.dtype, weights=True),
            dtype_name(args.kv_dtype, model.dtype))


def _topology(spec: str):
    """The topology of ``spec``, built within the planner's bounds (a note on stderr before a
    long plan, a refusal past the largest)."""
    from treeattn.sim.planning.plan_size import check_planning_size, planning_limits
    from treeattn.topo import Topology

    with planning_limits():
        topology = Topology.load(spec)
    note = check_planning_size(topology.num_gpus, f"topology {spec!r}")
    if note:
        print(note, file=sys.stderr, flush=True)
    return topology


def check_search_size(gpus: int) -> None:
    """Refuse a deployment search past MAX_SEARCH_GPUS; a note on stderr past
    SEARCH_NOTE_GPUS (see the constants)."""
    seconds = gpus * SEARCH_SECONDS_PER_GPU
    if gpus > MAX_SEARCH_GPUS:
        raise SimError(f"plan --gpus {gpus:,}: expected at most {MAX_SEARCH_GPUS:,} GPUs for "
                       f"the deployment search (about {seconds:.0f} s on one core); search "
                       "fewer GPUs, or price one split with predict --token --tp")
    if gpus > SEARCH_NOTE_GPUS:
        print(f"note: searching the splits of {gpus:,} GPUs takes about {seconds:.0f} s on one "
              "core", file=sys.stderr, flush=True)


def _capacity(topology) -> float:
    from treeattn.sim.network import resolve_hardware

    return resolve_hardware(topology, None)[0].memory_bytes


def memory_rows_check(args, topology, seq_len: int, tp: int) -> dict:
    """The whole-model memory fields of a plain ``predict``/``plan`` row (its ``--tp`` over
    the topology's GPUs, the sequence over the rest)."""
    model = ModelConfig.from_name(args.model)
    if topology.num_gpus % tp:
        raise SimError(f"--tp {tp} must divide the {topology.num_gpus} GPUs")
    split = Split(tp=tp, cp=topology.num_gpus // tp)
    weights, kv = _dtypes(args, model)
    check = memory_check(model, split, seq_len, args.batch, _capacity(topology), weights, kv,
                         gpu_model=normalize_model(topology.gpu_model(0)))
    return {**check.to_json(), "memory": check.describe()}


def _time(seconds: float | None) -> str:
    if seconds is None:
        return "does not fit"
    return f"{seconds * 1e6:,.1f} µs" if seconds < 1e-2 else f"{seconds * 1e3:,.2f} ms"


def _gib(n: float) -> str:
    return f"{n / 1024 ** 3:,.1f} GiB"


def handle_predict_token(args: argparse.Namespace) -> int:
    from treeattn.sim.deploy.token import predict_token
    from treeattn.sim.files.export import tagged
    from treeattn.sim.files.profiles import plan_overrides

    refuse_unread(args, "predict --token", TOKEN_READS, NOT_TOKEN)
    topo = _topology(args.topology)
    model = ModelConfig.from_name(args.model)
    weights, kv = _dtypes(args, model)
    if topo.num_gpus % args.tp:
        raise SimError(f"--tp {args.tp} must divide the {topo.num_gpus} GPUs")
    split = Split(tp=args.tp, cp=topo.num_gpus // args.tp, dcp=args.dcp)
    overrides = plan_overrides(args.profile, topo, args.nccl_env)
    # the merge's GPUs, and the TP group whose all-reduces may use a transport on their own
    allowed = transports_of(args, topo, [list(range(topo.num_gpus)), list(range(args.tp))])
    rows = []
    for seq_len in args.seq_len:
        p = predict_token(topo, model, seq_len, split, batch=args.batch, weights_dtype=weights,
                          kv_dtype=kv, transports=allowed, **overrides)
        row = {"topology": args.topology, **p.to_json()}
        if not p.memory.fits:  # never priced as if it ran
            row.update(tpot_s=None, tokens_per_s=None, batch_tokens_per_s=None,
                       refused="does not fit: " + p.memory.describe())
        rows.append(row)
    if args.json:
        print(json.dumps(tagged("token_predictions", rows), indent=2, allow_nan=False))
        return 0
    console = Console()
    columns = [Column("seq_len", key=True), Column("TPOT", key=True),
               Column("tok/s/seq", key=True), Column("tok/s batch"), Column("merge",
                                                                            justify="left"),
               Column("weights"), Column("TP all-reduce"), Column("attention"),
               Column("memory/GPU")]
    cells = [[f"{r['seq_len']:,}", _time(r["tpot_s"]),
              "-" if r["tokens_per_s"] is None else f"{r['tokens_per_s']:,.1f}",
              "-" if r["batch_tokens_per_s"] is None else f"{r['batch_tokens_per_s']:,.0f}",
              r["merge"], _time(r["parts_s"]["weights"]), _time(r["parts_s"]["tp_all_reduce"]),
              _time(r["parts_s"]["attention"]),
              f"{_gib(r['memory_need_bytes'])} of {_gib(r['memory_capacity_bytes'])}"]
             for r in rows]
    print_table(console, columns, cells, wide=args.wide,
                title=f"Predicted decode step: {args.topology}, {model.name} {split.label}, "
                      f"batch {args.batch}, weights {weights}, KV {kv}")
    for r in rows:
        if r["tpot_s"] is None:
            console.print(f"At {r['seq_len']:,} tokens {split.label} {r['refused']}.",
                          highlight=False)
    return 0


def handle_plan_gpus(args: argparse.Namespace) -> int:
    from treeattn.sim.deploy.deployments import search
    from treeattn.sim.files.export import tagged
    from treeattn.sim.files.profiles import plan_overrides

    refuse_unread(args, "plan --gpus", GPUS_READS, NOT_GPUS)
    topo = _topology(args.topology)
    if args.gpus > topo.num_gpus:
        raise SimError(f"plan --gpus {args.gpus:,} needs {args.gpus:,} GPUs and the topology "
                       f"has {topo.num_gpus:,}")
    check_search_size(args.gpus)
    model = ModelConfig.from_name(args.model)
    weights, kv = _dtypes(args, model)
    if args.profile and topo.num_gpus != args.gpus:
        raise SimError(f"--profile calibrates all {topo.num_gpus} GPUs of {args.topology}; "
                       f"plan --gpus {args.gpus} searches a slice of them: drop --profile or "
                       f"give --gpus {topo.num_gpus}")
    overrides = plan_overrides(args.profile, topo, args.nccl_env)
    # the budget's GPUs, and a TP group inside the first host
    first_host = len(topo.gpus_on(topo.hosts[0]))
    groups = [list(range(min(args.gpus, topo.num_gpus))),
              list(range(min(args.gpus, first_host, topo.num_gpus)))]
    found = search(topo, model, args.seq_len, args.gpus, batch=args.batch,
                   weights_dtype=weights, kv_dtype=kv,
                   transports=transports_of(args, topo, groups), **overrides)
    rows = [{"topology": args.topology, **d.to_json()} for d in found]
    if args.json:
        print(json.dumps(tagged("deployments", {"best": rows[0], "rows": rows}), indent=2,
                         allow_nan=False))
        return 0
    console = Console()
    best = found[0]
    p = best.prediction
    console.print(f"[bold]{best.split.label}[/bold] on {args.gpus} GPUs: {_time(p.tpot_s)} per "
                  f"output token ({p.tokens_per_s:,.1f} tokens/s per sequence, "
                  f"{p.batch_tokens_per_s:,.0f} for the batch of {args.batch}); attention "
                  f"merge {p.merge} ({p.merge_system})")
    columns = [Column("#"), Column("deployment", key=True, justify="left"),
               Column("TPOT", key=True), Column("vs best", key=True),
               Column("merge", justify="left"), Column("memory/GPU"), Column("fits")]
    cells = [[str(i), d.split.label, _time(d.tpot_s),
              "-" if d.tpot_s is None else f"{d.tpot_s / best.tpot_s:.2f}×",
              d.prediction.merge if d.prediction else "-",
              f"{_gib(d.memory.need_bytes)} of {_gib(d.memory.capacity_bytes)}",
              "yes" if d.fits else "no"] for i, d in enumerate(found, 1)]
    print_table(console, columns, cells, wide=args.wide,
                title=f"Deployments of {model.name} on {args.gpus} GPUs at {args.seq_len:,} "
                      f"tokens, batch {args.batch} (weights {weights}, KV {kv})",
                caption="vs best: TPOT against the best deployment (>1: slower). memory: "
                        "weights + all layers' KV + 10% of HBM for activations and workspace.")
    return 0
