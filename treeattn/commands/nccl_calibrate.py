"""``treeattn calibrate --nccl-tests FILE... --topology SPEC|FILE``: calibrate a GPU cluster.

Reads nccl-tests/rccl-tests outputs (``all_reduce_perf``, ``all_gather_perf``,
``reduce_scatter_perf``, ``alltoall_perf``, ``sendrecv_perf``, ``broadcast_perf``; the op
comes from the text, the file name, or an ``OP:FILE`` prefix), fits the collective cost model
to them (:mod:`treeattn.sim.nccl.fit`) and writes a profile that ``predict``, ``plan``,
``comm`` and ``run --check --topology`` accept with ``--profile``. The fit's residuals are
printed and kept in the profile. No torch: this runs wherever the planner runs.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from rich.console import Console

from treeattn import atomic
from treeattn.atomic import check_output_path
from treeattn.commands.tables import Column, print_table
from treeattn.errors import UserError
from treeattn.sim.devices import default_backend
from treeattn.sim.files.profile_schema import NCCL_TESTS_KIND
from treeattn.sim.files.profiles import VERSION
from treeattn.sim.nccl.collectives import GroupShape
from treeattn.sim.nccl.fit import fit
from treeattn.sim.nccl.nccltests import NCCL_TESTS_OPS, read_nccl_sections


def _read(spec: str):
    """``FILE`` or ``OP:FILE`` (when the op cannot be read from the text or the name)."""
    op, _, path = spec.partition(":")
    if path and op in NCCL_TESTS_OPS and not Path(spec).exists():
        return read_nccl_sections(path, op=op)
    return read_nccl_sections(spec)


def calibration_profile(files: list[str], topology_spec: str) -> dict:
    """The profile for the tables in ``files`` measured on ``topology_spec`` (all its GPUs)."""
    from treeattn.topo import Topology

    topology = Topology.load(topology_spec)
    if topology.num_gpus < 2:
        raise UserError(f"topology {topology_spec!r} has {topology.num_gpus} GPU(s)")
    tables = [table for f in files for table in _read(f)]
    hosts = len({topology.host_of(i) for i in range(topology.num_gpus)})
    for table in tables:
        if (table.notes.get("ranked_hosts") and table.hosts != hosts
                and table.world == topology.num_gpus):  # else fit() names the rank count
            raise UserError(f"{table.source}: field hosts: expected the topology's {hosts} "
                            f"host(s), got {table.hosts} (its '# Rank' lines name "
                            f"{table.hosts} hosts)")
    shape = GroupShape.of(topology, range(topology.num_gpus))
    calibration = fit(tables, shape)
    return {"format": "treeattn.profile", "version": VERSION, "kind": NCCL_TESTS_KIND,
            "backend": default_backend(topology.gpu_model(0)).name,
            "topology": topology_spec, "world": topology.num_gpus,
            "gpu_model": topology.gpu_model(0),
            "hosts": len({topology.host_of(i) for i in range(topology.num_gpus)}),
            "nccl_tests": calibration.to_json()}


def handle(args: argparse.Namespace) -> int:
    if not args.topology:
        raise UserError("--nccl-tests needs --topology (the cluster the tables were measured on)")
    if args.output is not None:  # "" included: refused as an empty path
        check_output_path(args.output)
    profile = calibration_profile(args.nccl_tests, args.topology)
    return write_profile(profile, args.output, _report)


def write_profile(profile: dict, output: str | None, report) -> int:
    """Write a calibration profile to ``output`` atomically (stdout when None), then the fit's
    ``report(profile, console)`` on stderr."""
    text = json.dumps(profile, indent=2, allow_nan=False) + "\n"
    if output:
        atomic.write_text(output, text)
    else:
        sys.stdout.write(text)
    report(profile, Console(stderr=True))
    if output:
        Console(stderr=True).print(f"wrote {output}")
    return 0


def _report(profile: dict, console: Console) -> None:
    section = profile["nccl_tests"]
    scales = ", ".join(f"{k} ×{v:.3g}" for k, v in section["scales"].items())
    errors = [abs(r["error"]) for r in section["residuals"]]
    geo = math.exp(sum(math.log1p(e) for e in errors) / len(errors)) - 1
    columns = [Column("op", key=True, justify="left"), Column("bytes", key=True),
               Column("measured µs", key=True), Column("model µs", key=True),
               Column("error", key=True)]
    print_table(console, columns,
                [[r["op"], str(r["bytes"]), f"{r['measured_s'] * 1e6:.2f}",
                  f"{r['model_s'] * 1e6:.2f}", f"{100 * r['error']:+.0f}%"]
                 for r in section["residuals"]],
                title=f"fit of the collective model ({len(errors)} rows): {scales}")
    console.print(f"model residual: geometric mean {100 * geo:.0f}%, worst "
                  f"{100 * max(errors):.0f}%; measured sizes are predicted from the tables")
