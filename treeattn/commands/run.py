"""`treeattn run` and `treeattn calibrate`: execute plans for real and check the predictions.

``--nproc N`` spawns N local ranks (gloo on CPU, NCCL on CUDA). Started by torchrun instead
(``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` set), the same command joins that
group, and rank 0 prints.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from rich.console import Console

from treeattn import atomic, testbed
from treeattn.atomic import check_output_path
from treeattn.commands._args import parse_bytes, parse_tokens
from treeattn.commands.tables import Column, add_wide_flag, print_table
from treeattn.errors import UserError
from treeattn.runtime import RankLost, RankTimeout, RuntimeFailure
from treeattn.schedule.algorithms import CLI_CHOICES
from treeattn.schedule.payloads import PARTIAL_DTYPES
from treeattn.schedule.workload import DTYPE_BYTES
from treeattn.sim.files.export import tagged
from treeattn.testbed.transport.binding import BIND_CHOICES

DEMO_SEQ_LENS = (16384, 65536, 262144)
# The parser's choices come from the torch-free registries, so that `treeattn --help` does not
# import torch (the runtime modules are imported where they run).
ALGORITHMS = CLI_CHOICES
DTYPES = tuple(DTYPE_BYTES)

def _add_group_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nproc", type=int, default=None,
                        help="local ranks to spawn (default 2; under torchrun: its world)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--timeout", type=float, default=30.0,
                        help="seconds any rank waits on a peer before giving up; a lost or "
                             "hung rank is named within about this long (default 30)")
    parser.add_argument("--port", type=int, default=None, help="rendezvous port (default: free)")
    parser.add_argument("--bind", choices=BIND_CHOICES, default="auto",
                        help="pin local ranks to cores, round-robin: auto (default) when "
                             "the ranks outnumber the cores, cores always, none never")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=32, help="query heads Hq")
    parser.add_argument("--kv-heads", type=int, default=8, help="KV heads Hkv")
    parser.add_argument("--head-dim", type=int, default=128, help="head dim D")
    parser.add_argument("--dtype", choices=DTYPES, default="float32")


def register(subparsers: argparse._SubParsersAction) -> None:
    run = subparsers.add_parser("run", help="run a plan on real ranks and measure it")
    _add_group_options(run)
    run.add_argument("--seq-len", type=parse_tokens, action="append", default=None,
                     help="cached tokens (repeatable; 16k, 1M accepted; required without --plan)")
    run.add_argument("--plan", metavar="PLAN.json", default=None,
                     help="execute exactly this plan file (from `plan -o`): its schedule, "
                          "model shape, batch and shard lengths")
    run.add_argument("--trace", metavar="FILE", default=None,
                     help="write predicted and measured timelines as a Chrome/Perfetto trace")
    run.add_argument("--algorithm", action="append", choices=ALGORITHMS, default=None,
                     help="algorithm (repeatable; default auto: the planner's choice)")
    run.add_argument("--shape", default=None, help="tree shape for tree/allreduce3 (tree)")
    run.add_argument("--partial-dtype", choices=PARTIAL_DTYPES, default=None,
                     help="how partials travel: fp32, or bf16 (o rounded to bf16 on its "
                          "sender, lse fp32); default: each algorithm's own")
    run.add_argument("--native", action="store_true",
                     help="run allreduce3 on the backend's own all_reduce")
    run.add_argument("--check", action="store_true",
                     help="calibrate (or --profile), predict, then measure and compare")
    run.add_argument("--max-error", type=float, default=0.25,
                     help="with --check, fail if a prediction is outside its measured "
                          "p10-p90 band widened by this (0.25: /1.25 below, x1.25 above)")
    run.add_argument("--profile", default=None, help="calibration profile (skips calibrating)")
    run.add_argument("--topology", default=None,
                     help="predict on this topology (spec or file, e.g. dgx-h100:nodes=2) "
                          "instead of the calibrated local one; for multi-node runs")
    run.add_argument("--steps", type=int, default=10,
                     help="timed decode steps per point, at least (see --min-time)")
    run.add_argument("--min-time", type=float, default=1.0,
                     help="time more steps until this many seconds per point (default 1)")
    run.add_argument("--warmup", type=int, default=2, help="untimed warm-up steps")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--no-reference", action="store_true",
                     help="skip the single-process reference (max_abs_diff)")
    run.add_argument("--json", action="store_true",
                     help="print JSON (format treeattn.run): one row per point")
    add_wide_flag(run)
    run.set_defaults(func=guarded(handle_run))

    cal = subparsers.add_parser("calibrate", help="measure the local backend (microbenchmarks)")
    _add_group_options(cal)
    cal.add_argument("-o", "--output", default=None, help="write the profile here (JSON)")
    cal.add_argument("--nccl-tests", nargs="+", metavar="FILE", default=None,
                     help="calibrate a GPU cluster from nccl-tests/rccl-tests outputs instead")
    cal.add_argument("--kernels", metavar="FILE", default=None,
                     help="calibrate a GPU's kernels from a measured table (CSV: GEMM shapes "
                          "and attention points with times; format in docs/token.md)")
    cal.add_argument("--topology", default=None,
                     help="with --nccl-tests or --kernels: the cluster (spec or file) they "
                          "were run on")
    cal.add_argument("--max-bytes", type=parse_bytes, default=None, metavar="SIZE",
                     help="measure the concurrent exchange up to messages of SIZE (e.g. 1G; "
                          "default 64M, at most 1G): a profile for runs whose schedules move "
                          "bigger blocks (a ring's KV) then prices them from measurements, "
                          "not an extrapolation; `run --check` does this by itself")
    cal.set_defaults(func=guarded(handle_calibrate))


def _options(args: argparse.Namespace):
    from treeattn.runtime.launch import LaunchOptions, check_timeout

    testbed.plug_in()  # CPU ranks of one host: the shared-memory transport, core pinning

    if args.threads < 1:
        raise RuntimeFailure(f"--threads must be at least 1, got {args.threads}")
    check_timeout(args.timeout)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise RuntimeFailure("--device cuda was asked for, but CUDA is not available")
    return LaunchOptions(timeout_s=args.timeout, threads=args.threads, device=args.device,
                         port=args.port, bind=args.bind)


EXIT_RUN_FAILED = 1


class _RunFailed(Exception):
    """A rank died or timed out: reported in one line, exit status 1 (not bad input)."""


def _execute(job, args: argparse.Namespace, world: int):
    """Run ``job`` on every rank; returns (is_rank_0, rank 0's result)."""
    from treeattn.runtime.group import in_torchrun_env
    from treeattn.runtime.launch import launch, run_in_group

    options = _options(args)
    try:
        if in_torchrun_env() and args.nproc is None:
            ctx, result = run_in_group(job, options)
            return ctx.rank == 0, result
        return True, launch(job, world, options)
    except (RankLost, RankTimeout) as exc:
        raise _RunFailed(str(exc).strip().splitlines()[0]) from exc


def guarded(handler):
    """Turn a dead or hung rank (RankLost, RankTimeout) into one ``error: ...`` line and exit
    status 1: the input was fine, the run failed. ``generate`` uses it too."""

    def run(args: argparse.Namespace) -> int:
        try:
            return handler(args)
        except (_RunFailed, RankLost, RankTimeout) as exc:
            text = str(exc).strip().splitlines()
            sys.stderr.write(f"error: {text[0] if text else type(exc).__name__}\n")
            return EXIT_RUN_FAILED

    run.__doc__ = handler.__doc__
    return run


def json_safe(obj):
    """``obj`` with every NaN or infinite float replaced by None, for strict JSON.

    Python's json writes NaN and Infinity by default, which no JSON parser has to accept;
    every dump here also passes ``allow_nan=False`` so a missed value fails loudly.
    """
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def dumps(obj) -> str:
    """Strict JSON (no NaN/Infinity) of ``obj``, indented."""
    return json.dumps(json_safe(obj), indent=2, allow_nan=False)


def _world(args: argparse.Namespace) -> int:
    from treeattn.runtime.group import in_torchrun_env
    from treeattn.runtime.launch import check_world

    if in_torchrun_env() and args.nproc is None:
        import os

        return int(os.environ["WORLD_SIZE"])
    world = 2 if args.nproc is None else args.nproc
    check_world(world)
    return world


def _local_ranks(args: argparse.Namespace, world: int) -> int:
    """How many of the ``world`` ranks run on this machine (torchrun: LOCAL_WORLD_SIZE)."""
    import os

    from treeattn.runtime.group import in_torchrun_env

    if in_torchrun_env() and args.nproc is None:
        return int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return world


def _apply_plan(args: argparse.Namespace) -> tuple[dict | None, tuple[int, ...] | None]:
    """Load ``--plan``: its schedule, and the shapes the run must take from it."""
    if not args.plan:
        if not args.seq_len:
            raise UserError("run needs --seq-len (or --plan)")
        return None, None
    from treeattn.sim.files.plan_file import read_plan

    if args.seq_len or args.algorithm or args.partial_dtype:
        raise UserError("--plan fixes the context, the algorithm and its wire format: drop "
                        "--seq-len, --algorithm and --partial-dtype")
    checked = read_plan(args.plan)  # every field, every size, deadlock: before any rank
    model = checked.model
    args.seq_len, args.algorithm = [checked.workload.seq_len], ["plan"]
    args.batch = checked.workload.batch
    args.heads, args.kv_heads, args.head_dim = model.n_heads, model.n_kv_heads, model.head_dim
    args.dtype = model.dtype
    return checked.record["schedule"], checked.shard_lengths


def check_partial_dtype(algorithms, partial_dtype: str | None) -> None:
    """Refuse a wire format that a named algorithm cannot use, before any rank starts."""
    if partial_dtype is None:
        return
    from treeattn.schedule.algorithms import partial_dtype_for
    from treeattn.schedule.workload import DecodeWorkload

    probe = DecodeWorkload("debug", 1, partial_dtype=partial_dtype)
    for name in algorithms:
        if name not in ("auto", "plan"):
            try:
                partial_dtype_for(name, probe)
            except ValueError as exc:
                raise UserError(str(exc)) from None


def build_request(args: argparse.Namespace):
    from treeattn.runtime.measure.check import RunRequest
    from treeattn.testbed.calibration.calibrate import read_profile

    plan, plan_lengths = _apply_plan(args)
    check_partial_dtype(args.algorithm or [], args.partial_dtype)
    profile = read_profile(args.profile) if args.profile else None
    params = {"shape": args.shape} if args.shape else {}
    return RunRequest(
        seq_lens=tuple(args.seq_len), algorithms=tuple(args.algorithm or ["auto"]),
        batch=args.batch, n_heads=args.heads, n_kv_heads=args.kv_heads,
        head_dim=args.head_dim, dtype=args.dtype, warmup=args.warmup, steps=args.steps,
        min_time_s=args.min_time,
        check=args.check, profile=profile, native=args.native,
        reference=not args.no_reference, seed=args.seed, params=params,
        topology=args.topology, plan=plan, plan_lengths=plan_lengths,
        partial_dtype=args.partial_dtype,
    )


def handle_run(args: argparse.Namespace) -> int:
    from treeattn.runtime.measure.check import mark_bands, validate

    world = _world(args)
    if args.trace is not None:  # "" included: refused as an empty path
        check_output_path(args.trace)
    req = build_request(args)
    validate(req, world, args.device, _local_ranks(args, world))
    chosen = args.algorithm or ["auto"]
    if args.native and "allreduce3" not in chosen and "auto" not in chosen:
        raise RuntimeFailure("--native runs allreduce3 on the backend's all_reduce: "
                             "add --algorithm allreduce3")
    if not math.isfinite(args.max_error) or args.max_error <= 0:
        raise RuntimeFailure(f"--max-error must be a positive number, got {args.max_error}")
    if not math.isfinite(args.min_time) or args.min_time < 0:
        raise RuntimeFailure(f"--min-time must be a non-negative number, got {args.min_time}")
    is_root, points = _execute(req, args, world)
    if not is_root:
        return 0
    mark_bands(points, args.max_error)
    if args.trace:
        write_trace(args.trace, points)
    if args.json:
        sys.stdout.write(dumps(tagged("run", points)) + "\n")
    else:
        print_points(Console(), points, wide=args.wide)
    for p in points:  # a forced algorithm that cannot differ from another here says so
        if p["params"].get("degenerate"):
            sys.stderr.write(f"note: {p['algorithm']} at {p['seq_len']} tokens: "
                             f"{p['params']['degenerate']}\n")
    outside = [p for p in points if p["within_band"] is False]
    for p in outside:
        sys.stderr.write(
            f"error: {p['algorithm']} at {p['seq_len']} tokens: predicted "
            f"{p['predicted_s'] * 1e3:.3f} ms is outside the measured p10-p90 band "
            f"[{p['measured_p10_s'] * 1e3:.3f}, {p['measured_p90_s'] * 1e3:.3f}] ms widened "
            f"by --max-error (error {p['error']:.1%} exceeds --max-error "
            f"{args.max_error:.1%})\n")
    return 1 if args.check and outside else 0


def write_trace(path: str, points: list[dict]) -> None:
    """Predicted and measured timelines of every point, side by side, one track per rank."""
    from treeattn.sim.files.export import trace_json

    timelines = []
    for p in points:
        label = f"{p['algorithm']} @ {p['seq_len']}"
        if p.get("predicted_timeline"):
            timelines.append((f"predicted: {label}", p["predicted_timeline"]))
        timelines.append((f"measured: {label}", p.get("timeline") or []))
    atomic.write_text(path, json.dumps(trace_json(timelines), allow_nan=False))


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _fmt_range(lo: float | None, hi: float | None) -> str:
    """``"10.100-15.000"`` in ms; ``-`` when there is no band."""
    if lo is None or hi is None:
        return "-"
    return f"{lo * 1e3:.3f}-{hi * 1e3:.3f}"


def print_points(console: Console, points: list[dict], wide: bool = False) -> None:
    """The predicted-vs-measured table, one row per point."""
    from treeattn.runtime.measure.check import geo_mean_error

    columns = [Column("algorithm", key=True, justify="left"), Column("world", key=True),
               Column("seq_len", key=True), Column("measured ms", key=True),
               Column("predicted ms", key=True), Column("error", key=True),
               Column("in band", key=True), Column("measured p10-p90"),
               Column("predicted band"), Column("max|diff|"), Column("peak mem/rank"),
               Column("sent/rank"), Column("steps")]
    cells = []
    for p in points:
        pred = p["predicted_s"]
        band = p.get("within_band")
        lo, hi = p.get("predicted_lo_s"), p.get("predicted_hi_s")
        cells.append([
            p["algorithm"], str(p["world"]), str(p["seq_len"]), f"{p['measured_s'] * 1e3:.3f}",
            f"{pred * 1e3:.3f}" if pred else "-",
            f"{p['error']:.1%}" if p["error"] is not None else "-",
            "-" if band is None else ("yes" if band else "NO"),
            _fmt_range(p["measured_p10_s"], p["measured_p90_s"]),
            _fmt_range(lo, hi) if pred else "-",
            f"{p['max_abs_diff']:.1e}" if p["max_abs_diff"] is not None else "-",
            _fmt_bytes(max(p["peak_memory_bytes"])), _fmt_bytes(max(p["bytes_sent"])),
            str(p.get("steps_timed", "-"))])
    print_table(console, columns, cells, wide=wide,
                title="decode step: measured median (p10-p90 over timed steps, max over "
                      "ranks); predicted (band from the calibration's spread)")
    error = geo_mean_error(points)
    if error is not None:
        console.print(f"geometric-mean prediction error: {error:.1%}")
    extrapolated = [p for p in points if (p.get("profile") or {}).get("extrapolated")]
    if extrapolated:
        top = extrapolated[0]["profile"]["calibrated_up_to_bytes"]
        console.print(f"note: {len(extrapolated)} point(s) move messages larger than the "
                      f"largest calibrated ({_fmt_bytes(top)}): their bandwidth is "
                      "extrapolated")


class CalibrateJob:
    """Picklable job: calibrate in the group, rank 0 returns the profile."""

    def __init__(self, dims, max_bytes: int | None = None) -> None:
        self.dims = dims  # a treeattn.runtime.wire.AttnDims
        self.max_bytes = max_bytes

    def __call__(self, ctx):
        from treeattn.testbed.calibration.calibrate import calibrate_in_group

        return calibrate_in_group(ctx, self.dims, self.max_bytes)


def handle_calibrate(args: argparse.Namespace) -> int:
    if args.kernels and args.nccl_tests:
        raise UserError("--kernels and --nccl-tests calibrate different things; give one")
    if args.kernels:  # a GPU's kernels, from a measured table: no ranks, no torch
        from treeattn.commands import kernel_calibrate

        return kernel_calibrate.handle(args)
    if args.nccl_tests:  # a GPU cluster, from its nccl-tests tables: no ranks, no torch
        from treeattn.commands import nccl_calibrate

        return nccl_calibrate.handle(args)
    from treeattn.runtime.measure.check import RunRequest, validate
    from treeattn.testbed.calibration.calibrate import EXCHANGE_CAP, write_profile

    world = _world(args)
    if world < 2:
        raise RuntimeFailure("calibrate needs --nproc of at least 2 (ping-pong)")
    req = RunRequest(seq_lens=(world,), batch=args.batch, n_heads=args.heads,
                     n_kv_heads=args.kv_heads, head_dim=args.head_dim, dtype=args.dtype)
    validate(req, world)
    if args.output is not None:  # before the calibration, not after it; "" is refused
        check_output_path(args.output)
    if args.max_bytes is not None and args.max_bytes > EXCHANGE_CAP:
        raise RuntimeFailure(f"--max-bytes {args.max_bytes} is above the largest exchange "
                             f"calibrated, {EXCHANGE_CAP} bytes (1 GiB); larger messages are "
                             "extrapolated from it")
    is_root, profile = _execute(CalibrateJob(req.dims, args.max_bytes), args, world)
    if not is_root:
        return 0
    if args.output:
        write_profile(profile, args.output)
        Console(stderr=True).print(f"wrote {args.output}")
    else:
        sys.stdout.write(dumps(profile) + "\n")
    return 0


def demo_section(console: Console) -> int:
    """Tree vs ring on 2 local ranks: calibrate, predict, measure, compare."""
    from treeattn.runtime.launch import LaunchOptions, launch
    from treeattn.runtime.measure.check import RunRequest, mark_bands, validate

    console.rule("real runs: tree vs ring on 2 local ranks (gloo, CPU)")
    req = RunRequest(seq_lens=DEMO_SEQ_LENS, algorithms=("tree", "ring"), check=True,
                     steps=3, warmup=1, ref_limit_bytes=512 << 20)
    validate(req, 2)
    testbed.plug_in()
    points = launch(req, 2, LaunchOptions(timeout_s=60.0))
    print_points(console, mark_bands(points, 0.25))
    return 0


demo_section.is_real_run = True
