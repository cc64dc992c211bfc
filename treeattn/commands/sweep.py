"""`treeattn sweep`: predict (and optionally measure) over a grid, write tables and plots.

Prediction sweeps run the planner at every (topology, nodes, model, seq_len) point and write
``results.csv``, ``results.json`` and PNG plots into ``-o DIR``. With ``--measure`` the sweep
instead runs tree and ring for real on ``--nproc`` local ranks (calibrate, predict, measure,
in that order) and plots measured against predicted.
"""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from treeattn import testbed
from treeattn.atomic import atomic_folder, check_output_path
from treeattn.commands._args import parse_tokens
from treeattn.errors import UserError
from treeattn.sim import ALGORITHM_NAMES
from treeattn.sim.files.export import tagged
from treeattn.sweep import plots
from treeattn.sweep.grid import check_points, expand_grid, memory_rows, run_sweep


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("sweep", help="predict (or measure) over a grid and plot it")
    parser.add_argument("--topology", action="append", default=None,
                        help="topology spec (repeatable; default dgx-h100)")
    parser.add_argument("--model", action="append", default=None,
                        help="model name (repeatable; default llama-3.1-8b)")
    parser.add_argument("--seq-len", type=parse_tokens, action="append", default=None,
                        help="context length (repeatable; 80k, 1M accepted)")
    parser.add_argument("--batch", type=int, action="append", default=None,
                        help="decode batch, sequences per step (repeatable; default 1)")
    parser.add_argument("--tp", type=int, default=1,
                        help="tensor-parallel size: heads over this many GPUs, sequence over "
                             "the rest")
    parser.add_argument("--profile", default=None,
                        help="calibration profile: CPU ranks, or a GPU cluster's (calibrate "
                             "--nccl-tests; every topology must then have its GPU count)")
    parser.add_argument("--nodes", type=int, action="append", default=None,
                        help="node count applied to each topology (repeatable)")
    parser.add_argument("--algorithms", nargs="+", choices=ALGORITHM_NAMES,
                        default=list(ALGORITHM_NAMES))
    parser.add_argument("-o", "--output", required=True, help="output directory")
    parser.add_argument("--measure", action="store_true",
                        help="run tree/ring for real on local ranks and plot vs prediction")
    parser.add_argument("--nproc", type=int, default=2, help="local ranks for --measure")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per measured point")
    parser.set_defaults(func=handle)


def handle(args: argparse.Namespace) -> int:
    out = check_output_path(args.output, folder=True)  # before any work
    seq_lens = args.seq_len or [32768, 131072, 1048576]
    if any(n <= 0 for n in seq_lens):
        raise UserError("--seq-len must be positive")
    if args.nodes and any(n < 1 for n in args.nodes):
        raise UserError("--nodes must be at least 1")
    console = Console(stderr=True)
    rows = _measure(args, seq_lens, console) if args.measure else _predict(args, seq_lens,
                                                                             console)
    # The whole folder is built aside and swapped in, so an interrupted or failed sweep
    # leaves the previous run's tables and plots together and untouched.
    with atomic_folder(out) as staging:
        _write_tables(rows, staging)
        pictures = [out / p.name for p in _plot(rows, staging, measured=args.measure)]
    console.print(f"wrote {len(rows)} rows to {out}/results.csv and results.json")
    for picture in pictures:
        console.print(f"  plot: {picture}")
    return 0


def _predict(args, seq_lens: list[int], console: Console) -> list[dict]:
    models = args.model or ["llama-3.1-8b"]
    if any(b < 1 for b in args.batch or [1]) or args.tp < 1:
        raise UserError("--batch and --tp must be at least 1")
    points = expand_grid(args.topology or ["dgx-h100"], models, seq_lens, args.nodes,
                         args.batch or [1], args.tp)
    from treeattn.sim.planning.plan_size import check_planning_size, planning_limits

    with planning_limits():  # fail on bad input before any work or progress output
        topologies = check_points(points)

    for spec, topology in topologies.items():
        check_planning_size(topology.num_gpus, f"topology {spec!r}")
    profile = None
    if args.profile:
        from treeattn.sim.files.profiles import load_profile, plan_overrides

        profile = load_profile(args.profile)
        for topology in topologies.values():
            plan_overrides(profile, topology)  # a GPU profile must fit every topology
    columns = (TextColumn("[bold]sweep"), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.description}"), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task("", total=len(points))

        def advance(point) -> None:
            progress.update(task, advance=1,
                            description=f"{point.topology} {point.model} {point.seq_len}")

        return run_sweep(points, args.algorithms, progress=advance, profile=profile)


def _measure(args, seq_lens: list[int], console: Console) -> list[dict]:
    from treeattn.runtime.launch import LaunchOptions, launch
    from treeattn.runtime.measure.check import RunRequest, validate

    if args.nproc < 2:
        raise UserError(f"--measure needs --nproc of at least 2, got {args.nproc}")
    algorithms = tuple(a for a in args.algorithms if a in ("tree", "ring", "butterfly",
                                                           "allgather", "allreduce3"))
    request = RunRequest(seq_lens=tuple(seq_lens), algorithms=algorithms, check=True,
                         steps=args.steps)
    validate(request, args.nproc)
    console.print(f"measuring {len(algorithms)} algorithm(s) × {len(seq_lens)} length(s) "
                  f"on {args.nproc} local ranks (calibrate, predict, then measure)…")
    testbed.plug_in()  # the shared-memory transport, as `run` has it
    points = launch(request, args.nproc, LaunchOptions())
    for point in points:
        point["topology"] = f"local:{args.nproc}"
        point["gpus"] = point["world"]
    return points


def _write_tables(rows: list[dict], out: Path) -> None:
    (out / "results.json").write_text(json.dumps(tagged("sweep", rows), indent=2,
                                                 allow_nan=False) + "\n")
    scalar_keys = [k for k in rows[0] if not isinstance(rows[0][k], list | dict)] if rows else []
    with open(out / "results.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=scalar_keys, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def _plot(rows: list[dict], out: Path, measured: bool) -> list[Path]:
    if not rows:
        return []
    if measured:
        return [plots.measured_vs_predicted(rows, out / "measured_vs_predicted.png")]
    pictures = [plots.latency_vs_seq_len(rows, out / "latency_vs_seq_len.png")]
    if len({r["gpus"] for r in rows}) > 1:
        pictures.append(plots.speedup_vs_gpus(rows, out / "speedup_vs_gpus.png"))
    smallest = min(rows, key=lambda r: (r["gpus"], -r["seq_len"]))
    memory = memory_rows(smallest["spec"], smallest["seq_len"])
    pictures.append(plots.memory_vs_hidden(memory, out / "memory_vs_hidden.png"))
    pictures.append(_draw_chosen_tree(rows, out))
    return [p for p in pictures if p is not None]


def _draw_chosen_tree(rows: list[dict], out: Path) -> Path | None:
    """Plan the smallest topology of the sweep again and draw its tree over the cluster."""
    from treeattn.sim import DecodeWorkload, plan_workload
    from treeattn.topo import Topology

    first = min(rows, key=lambda r: (r["gpus"], -r["seq_len"]))
    topology = Topology.load(first["spec"])
    chosen = plan_workload(topology, DecodeWorkload(first["model"], first["seq_len"]),
                           algorithms=("tree",))
    if chosen.tree is None:
        return None
    parent = list(chosen.tree.to_dict()["parent"])
    title = (f"chosen tree on {first['spec']} ({chosen.name}), "
             f"{first['model']} at {first['seq_len']} tokens")
    return plots.tree_over_topology(topology, parent, out / "chosen_tree.png", title)
