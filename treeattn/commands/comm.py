"""`treeattn comm`: a predicted nccl-tests run, to compare line by line with your own.

    treeattn comm --topology dgx-h100:nodes=2 --op all_reduce --min-bytes 8 --max-bytes 1G

prints, for each size from ``--min-bytes`` to ``--max-bytes`` (doubling, like nccl-tests'
``-f 2``), the predicted time (µs), algorithm and bus bandwidth (GB/s, with nccl-tests'
busbw factor), and the algorithm and protocol NCCL (or RCCL) would choose. The group is
every GPU of the topology, in rank order, as ``mpirun -np N`` of an nccl-tests binary.
``--transport NAME`` prices the op on a one-sided transport instead (:mod:`treeattn.sim.
onesided`: NCCL's symmetric kernels, torch's ``symm_mem``, the MNNVL LL128 all-to-all, each
inside one NVLink domain); each row names its transport. A transport the cluster cannot
offer, or one with no kernel for the op, is one error line (``predict``/``plan`` fall back to
NCCL's regular path for such an op; here the user asked for that transport's price).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import replace

from rich.console import Console

from treeattn.commands.tables import Column, add_wide_flag, print_table
from treeattn.errors import UserError
from treeattn.schedule.payloads import busbw_factor
from treeattn.sim.files.export import tagged
from treeattn.sim.nccl.collectives import OPS, GroupShape, collective_cost
from treeattn.sim.network import TRANSPORTS
from treeattn.sim.onesided import one_sided

SIZE_SUFFIX = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
MAX_BYTES = 1 << 44  # 16 TiB: far past any real buffer, small enough to stay exact


def parse_bytes(text: str) -> int:
    """``"8"``, ``"64K"``, ``"1G"`` (binary multiples, nccl-tests' ``-b``/``-e`` syntax).

    >>> parse_bytes("8"), parse_bytes("64k"), parse_bytes("1G")
    (8, 65536, 1073741824)
    """
    match = re.fullmatch(r"\s*(\d{1,16})\s*([kKmMgGtTbB]?)\s*", text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r} (e.g. 8, 64K, 1G)")
    value = int(match.group(1)) * SIZE_SUFFIX[match.group(2).upper()]
    if value > MAX_BYTES:
        raise argparse.ArgumentTypeError(f"size {text!r} is larger than {MAX_BYTES} bytes")
    return value


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("comm", help="predicted nccl-tests table for one collective")
    parser.add_argument("--topology", required=True, help="topology spec or file")
    parser.add_argument("--op", required=True, choices=OPS, help="collective to price")
    parser.add_argument("--min-bytes", type=parse_bytes, default=8, help="first size (8)")
    parser.add_argument("--max-bytes", type=parse_bytes, default=1 << 30, help="last size (1G)")
    parser.add_argument("--profile", default=None,
                        help="a GPU cluster's calibration (calibrate --nccl-tests)")
    parser.add_argument("--transport", choices=TRANSPORTS, default="nccl",
                        help="nccl: NCCL's (RCCL's) regular algorithms; nccl-symm: NCCL's "
                             "symmetric kernels (NCCL >= 2.27); symm_mem: torch's one-shot, "
                             "two-shot and multimem kernels; mnnvl_ll128: FlashInfer's LL128 "
                             "all-to-all (MNNVL fabric). One NVLink domain; sums only")
    parser.add_argument("--json", action="store_true", help="print JSON rows instead")
    add_wide_flag(parser)
    parser.add_argument("--rccl-msccl", action="store_true",
                        help="MI300X: price RCCL 2.21.5-2.2x (ROCm 6.3 to MSCCL's removal), "
                             "whose small all-reduces on one 8-GPU node run MSCCL's all-pairs "
                             "schedule instead of the tuner's pick")
    parser.set_defaults(func=handle)


def comm_rows(topology, op: str, min_bytes: int, max_bytes: int,
              calibration=None, rccl_msccl: bool = False, transport: str = "nccl") -> list[dict]:
    """One row per doubling size, with the keys the issue's JSON contract names."""
    if min_bytes < 1:
        raise UserError(f"--min-bytes must be at least 1, got {min_bytes}")
    if min_bytes > max_bytes:
        raise UserError(f"--min-bytes ({min_bytes}) is above --max-bytes ({max_bytes})")
    if topology.num_gpus < 2:
        raise UserError(f"topology {topology.name!r} has {topology.num_gpus} GPU(s); "
                        "a collective needs at least 2")
    shape = replace(GroupShape.of(topology, range(topology.num_gpus)), rccl_msccl=rccl_msccl)
    onesided = one_sided(transport)
    if onesided is not None:
        reason = onesided.unavailable(op, shape, "sum")
        if reason is not None:
            raise UserError(f"--transport {transport} on {topology.name}: {reason}")
        if calibration is not None:
            raise UserError("--profile calibrates NCCL's regular algorithms; it does not apply "
                            f"to --transport {transport}")
    factor = busbw_factor(op, shape.nranks)
    rows, size = [], min_bytes
    while size <= max_bytes:
        if onesided is not None:
            cost = onesided.cost(op, size, shape, "sum")
        else:
            cost = collective_cost(op, size, calibration.shape(shape) if calibration else shape)
        time_s = calibration.time_s(op, size, shape) if calibration else cost.time_s
        algbw = size / time_s / 1e9
        rows.append({"op": op, "bytes": size, "time_us": round(time_s * 1e6, 3),
                     "algbw_gbps": round(algbw, 3), "busbw_gbps": round(algbw * factor, 3),
                     "algorithm": cost.algorithm, "protocol": cost.protocol,
                     "transport": transport})
        size *= 2
    return rows


def handle(args: argparse.Namespace) -> int:
    from treeattn.topo import Topology

    topology = Topology.load(args.topology)
    calibration = None
    if args.profile:
        from treeattn.sim.files.profiles import plan_overrides

        backend = plan_overrides(args.profile, topology).get("backend")
        calibration = getattr(backend, "calibration", None)
        if calibration is None:
            raise UserError(f"{args.profile} calibrates CPU ranks, not a GPU cluster's "
                            "collectives (use calibrate --nccl-tests)")
    rows = comm_rows(topology, args.op, args.min_bytes, args.max_bytes, calibration,
                     args.rccl_msccl, args.transport)
    if args.json:
        sys.stdout.write(json.dumps(tagged("comm", rows), indent=2, allow_nan=False) + "\n")
        return 0
    columns = [Column("size (B)", key=True), Column("time (us)", key=True),
               Column("algorithm", key=True, justify="left"),
               Column("protocol", key=True, justify="left"), Column("busbw (GB/s)"),
               Column("algbw (GB/s)")]
    cells = [[str(r["bytes"]), f"{r['time_us']:.2f}", r["algorithm"], r["protocol"],
              f"{r['busbw_gbps']:.2f}", f"{r['algbw_gbps']:.2f}"] for r in rows]
    print_table(Console(), columns, cells, wide=args.wide,
                title=f"predicted {args.op} on {topology.name} ({topology.num_gpus} ranks, "
                      f"{args.transport})")
    return 0
