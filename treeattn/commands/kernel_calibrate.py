"""``treeattn calibrate --kernels FILE --topology SPEC``: a GPU's measured kernel table.

Reads a CSV of measured decode GEMMs and attention points (format: ``docs/token.md``,
:mod:`treeattn.sim.deploy.kernel_table`), fits each kind's fixed cost and HBM rate, and
writes a profile that ``predict --token --profile`` uses in place of the sourced kernel
defaults for that GPU model. The fit's residuals are printed and kept in the profile. No
torch: this runs wherever the planner runs.
"""

from __future__ import annotations

import argparse
import math

from rich.console import Console

from treeattn.atomic import check_output_path
from treeattn.commands.nccl_calibrate import write_profile
from treeattn.commands.tables import Column, print_table
from treeattn.errors import UserError
from treeattn.sim.deploy.kernel_table import (
    check_table_gpu,
    fit_kernels,
    kernel_profile,
    read_kernel_table,
)
from treeattn.topo.hardware import normalize_model


def handle(args: argparse.Namespace) -> int:
    from treeattn.topo import Topology

    if not args.topology:
        raise UserError("--kernels needs --topology (the GPUs the kernels were measured on)")
    if args.output:
        check_output_path(args.output)
    topology = Topology.load(args.topology)
    model = normalize_model(topology.gpu_model(0))
    if model.lower() == "cpu":
        raise UserError(f"topology {args.topology!r} has CPU ranks; a kernel table "
                        "calibrates a GPU")
    rows = read_kernel_table(args.kernels)
    check_table_gpu(rows, model, f"kernel table {args.kernels}")
    profile = kernel_profile(rows, fit_kernels(rows, f"kernel table {args.kernels}"), model,
                             args.kernels)
    return write_profile(profile, args.output, _report)


def _report(profile: dict, console: Console) -> None:
    section = profile["kernels"]
    fits = ", ".join(f"{f['kind']} {f['dtype']}: {f['fixed_s'] * 1e6:.2f} µs + bytes at "
                     f"{f['bytes_per_s'] / 1e9:.0f} GB/s" for f in section["fits"])
    errors = [abs(r["error"]) for r in section["residuals"]]
    geo = math.exp(sum(math.log1p(e) for e in errors) / len(errors)) - 1
    columns = [Column("kind", key=True, justify="left"), Column("dtype", key=True),
               Column("bytes", key=True), Column("measured µs", key=True),
               Column("model µs", key=True), Column("error", key=True)]
    print_table(console, columns,
                [[r["kind"], r["dtype"], f"{r['bytes']:.0f}", f"{r['measured_s'] * 1e6:.2f}",
                  f"{r['model_s'] * 1e6:.2f}", f"{100 * r['error']:+.0f}%"]
                 for r in section["residuals"]],
                title=f"fit of {profile['gpu_model']}'s kernels ({len(errors)} rows): {fits}")
    console.print(f"residual: geometric mean {100 * geo:.0f}%, worst {100 * max(errors):.0f}%")
