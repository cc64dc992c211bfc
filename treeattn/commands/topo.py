"""`treeattn topo`: show, import and draw cluster topologies.

* ``treeattn topo show SPEC_OR_FILE [--json]``: a summary table, or one JSON object with
  ``gpus``, ``hosts``, ``links`` (kind -> physical links), ``bandwidth`` and ``latency``
  (GPU x GPU route bottleneck in bytes/s and route latency in s, 0 on the diagonal).
* ``treeattn topo import FILE [--format ...] [--gpu MODEL] [--nodes N [--nic-gbps G]
  [--rails R] [--leaf K]] -o OUT.json``: with ``--nodes``, the host replicated N times over a
  rail fabric, the same as ``FILE:nodes=N,nic_gbps=G,rails=R,leaf=K`` anywhere a topology
  is accepted (see :mod:`treeattn.topo.replicate`).
* ``treeattn topo draw SPEC_OR_FILE -o OUT.png``
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console

from treeattn import atomic
from treeattn.atomic import check_output_path
from treeattn.commands.tables import Column, print_table
from treeattn.topo import Topology, TopologyError
from treeattn.topo.fabric import build_limits
from treeattn.topo.importers.detect import FORMATS, expected_gpus
from treeattn.topo.summary import span, summary_rows

MAX_JSON_GPUS = 4096  # 4096^2 matrix entries are ~0.3 GB of JSON already
DEMO_SPECS = ("dgx-h100:nodes=1", "dgx-h100:nodes=16", "gb200-nvl72:racks=2", "mi300x:nodes=1",
              "pcie-4090:gpus=8")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("topo", help="show, import and draw cluster topologies")
    sub = parser.add_subparsers(dest="topo_command", metavar="ACTION", required=True)
    show = sub.add_parser("show", help="summarise a topology (spec string or file)")
    show.add_argument("source", metavar="SPEC_OR_FILE")
    show.add_argument("--json", action="store_true", help="print one JSON object")
    _source_options(show)
    show.set_defaults(func=handle_show)
    imp = sub.add_parser("import", help="convert nvidia-smi/rocm-smi/NCCL XML output to JSON")
    imp.add_argument("file", metavar="FILE")
    _source_options(imp)
    imp.add_argument("--nodes", type=int, metavar="N",
                     help="replicate the host N times over a rail-optimized fabric")
    imp.add_argument("--nic-gbps", type=float, metavar="G", help="NIC speed, Gb/s (default 400)")
    imp.add_argument("--rails", type=int, metavar="R",
                     help="rails per host (default: the host's NICs, else one per GPU)")
    imp.add_argument("--leaf", type=int, metavar="K",
                     help="hosts per leaf switch; more add a spine level (default: automatic)")
    imp.add_argument("-o", "--output", required=True, metavar="OUT.json")
    imp.set_defaults(func=handle_import)
    draw = sub.add_parser("draw", help="write a PNG picture of a topology")
    draw.add_argument("source", metavar="SPEC_OR_FILE")
    _source_options(draw)
    draw.add_argument("-o", "--output", required=True, metavar="OUT.png")
    draw.set_defaults(func=handle_draw)


def _source_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--format", default="auto", choices=FORMATS,
                        help="input format of a file (default: auto-detect)")
    parser.add_argument("--gpu", metavar="MODEL", help="GPU model for link bandwidths (e.g. H100)")


def _load(args: argparse.Namespace, source: str) -> Topology:
    with build_limits(note=lambda line: print(line, file=sys.stderr, flush=True)):
        return Topology.load(source, fmt=args.format, gpu=args.gpu)


def show_json(t: Topology) -> dict:
    """The ``topo show --json`` object (tagged ``treeattn.topology-summary``, version 1)."""
    return {
        "format": "treeattn.topology-summary",
        "version": 1,
        "name": t.name,
        "gpus": t.num_gpus,
        "hosts": len(t.hosts),
        "links": t.links(),
        "gpu_names": t.gpus,
        "models": [t.gpu_model(g) for g in t.gpus],
        "host_of": [t.host_of(g) for g in t.gpus],
        "bandwidth": t.bandwidth_matrix().tolist(),
        "latency": t.latency_matrix().tolist(),
    }


def _check_json_size(gpus: int | None) -> None:
    if gpus is not None and gpus > MAX_JSON_GPUS:
        raise TopologyError(
            f"{gpus} GPUs is too many for --json matrices (limit {MAX_JSON_GPUS}); "
            "use the Python API (Topology.pair_matrices)"
        )


def handle_show(args: argparse.Namespace) -> int:
    if args.json:  # refuse a huge spec or JSON before building its graph
        _check_json_size(expected_gpus(args.source, args.format))
    t = _load(args, args.source)
    if args.json:
        _check_json_size(t.num_gpus)
        sys.stdout.write(json.dumps(show_json(t), allow_nan=False) + "\n")
        return 0
    print_table(Console(), [Column("field", key=True, justify="left", style="bold"),
                            Column("value", key=True, justify="left")],
                [list(row) for row in summary_rows(t)], title=f"topology {t.name}",
                show_header=False)
    return 0


def handle_import(args: argparse.Namespace) -> int:
    path = Path(args.file)
    if not path.is_file():
        raise TopologyError(f"no such file: {args.file!r}")
    check_output_path(args.output)  # before the (possibly long) import
    t = _load(args, str(path) + replicate_suffix(args))
    atomic.write_text(args.output, t.to_json())
    print(f"wrote {args.output}: {t.num_gpus} GPUs ({t.gpu_model(0)}), "
          f"{sum(t.links().values())} links")
    return 0


def replicate_suffix(args: argparse.Namespace) -> str:
    """``":nodes=N,..."`` from ``--nodes/--nic-gbps/--rails/--leaf`` ("" without ``--nodes``).

    >>> replicate_suffix(argparse.Namespace(nodes=4, nic_gbps=None, rails=8, leaf=None))
    ':nodes=4,rails=8'
    """
    extra = {"nic_gbps": args.nic_gbps, "rails": args.rails, "leaf": args.leaf}
    if args.nodes is None:
        given = [k for k, v in extra.items() if v is not None]
        if given:
            raise TopologyError(f"--{given[0].replace('_', '-')} needs --nodes")
        return ""
    opts = {"nodes": args.nodes, **{k: v for k, v in extra.items() if v is not None}}
    return ":" + ",".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}"
                          for k, v in opts.items())


def handle_draw(args: argparse.Namespace) -> int:
    out = check_output_path(args.output)
    t = _load(args, args.source)
    with atomic.atomic_path(out) as tmp:
        t.draw(tmp)
    print(f"wrote {out}")
    return 0


def demo_section(console: Console) -> int:
    """Print a compact table of the built-in topologies (the first part of `make demo`)."""
    columns = [Column("spec", key=True, justify="left"), Column("GPUs", key=True),
               Column("local GB/s", key=True), Column("local µs", key=True),
               Column("remote GB/s", key=True), Column("remote µs", key=True),
               Column("hosts")]
    cells = []
    for spec in DEMO_SPECS:
        t = Topology.from_spec(spec)
        cells.append([spec, str(t.num_gpus), *_route_cells(t), str(len(t.hosts))])
    print_table(console, columns, cells,
                title="Built-in topologies: GPU 0 to its peers on its own host (local) "
                      "and on other hosts (remote), per direction")
    return 0


def _route_cells(t: Topology) -> list[str]:
    first, cells = t.gpus[0], []
    for same in (True, False):
        group = [g for g in t.gpus[1:] if (t.host_of(g) == t.host_of(first)) == same]
        if not group:
            cells += ["-", "-"]
            continue
        cells.append(span([t.path_bandwidth(first, g) / 1e9 for g in group], "g"))
        cells.append(span([t.path_latency(first, g) * 1e6 for g in group], ".1f"))
    return cells
