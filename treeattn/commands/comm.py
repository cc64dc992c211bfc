"""`treeattn comm`: a predicted nccl-tests run, to compare line by line with your own.

    treeattn comm --topology dgx-h100:nodes=2 --op all_reduce --min-bytes 8 --max-bytes 1G

prints, for each size from ``--min-bytes`` to ``--max-bytes`` (doubling, like nccl-tests'
``-f 2``), the predicted time (µs), algorithm and bus bandwidth (GB/s, with nccl-tests'
busbw factor), and the algorithm and protocol NCCL (or RCCL) would choose (``--op sendrecv``
between hosts is Simple unless ``--nccl-env NCCL_ALLOC_P2P_NET_LL_BUFFERS=1`` or
``NCCL_NET_SHARED_BUFFERS=0``). The group is
every GPU of the topology, in rank order, as ``mpirun -np N`` of an nccl-tests binary;
``--gpus N`` takes the first N GPUs of one node (``CUDA_VISIBLE_DEVICES=0,..,N-1`` on its
host), ``--ranks 0,2,4,6`` any list of the topology's GPUs. ``--dtype`` is nccl-tests' ``-d``:
NCCL runs NVLS reductions only on some dtypes, and fp8 reductions only from Hopper on.
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

from treeattn.commands._args import add_nccl_env_flag
from treeattn.commands.tables import Column, add_wide_flag, print_table
from treeattn.errors import UserError
from treeattn.schedule.payloads import SimError, busbw_factor
from treeattn.sim.files.export import tagged
from treeattn.sim.nccl.collectives import OPS, GroupShape, collective_cost
from treeattn.sim.nccl.dtypes import check_dtype
from treeattn.sim.nccl.env import parse_nccl_env, with_env
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
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--gpus", type=int, default=None, metavar="N",
                       help="the first N GPUs of the first node (default: every GPU)")
    group.add_argument("--ranks", default=None, metavar="LIST",
                       help="comma-separated GPU ranks of the topology, e.g. 0,2,4,6")
    parser.add_argument("--dtype", default="float32",
                        help="element type, as nccl-tests' -d (float32; bfloat16, float16, "
                             "float8_e4m3, int8, ...)")
    add_nccl_env_flag(parser)
    parser.add_argument("--json", action="store_true", help="print JSON rows instead")
    add_wide_flag(parser)
    parser.add_argument("--rccl-msccl", action="store_true",
                        help="MI300X: price RCCL 2.21.5-2.2x (ROCm 6.3 to MSCCL's removal), "
                             "whose small all-reduces on one 8-GPU node run MSCCL's all-pairs "
                             "schedule instead of the tuner's pick")
    parser.set_defaults(func=handle)


def group_ranks(topology, gpus: int | None = None, ranks: str | None = None) -> list[int]:
    """The ranks ``--gpus N`` (the first N GPUs of the first host) or ``--ranks LIST`` name;
    every GPU when neither is given. UserError for a group larger than the node, a rank out
    of range or repeated, or fewer than 2 GPUs."""
    if gpus is not None:
        host = topology.hosts[0] if topology.hosts else None
        on_node = topology.gpus_on(host) if host is not None else []
        if gpus < 2:
            raise UserError(f"--gpus {gpus}: a collective needs at least 2 GPUs")
        if gpus > len(on_node):
            raise UserError(f"--gpus {gpus}: a node of {topology.name} has {len(on_node)} "
                            "GPU(s); use --ranks for a group across nodes")
        return [topology.rank(g) for g in on_node[:gpus]]
    if ranks is not None:
        items = [r.strip() for r in ranks.split(",")]
        if "" in items:
            raise UserError(f"--ranks {ranks!r}: an empty item (expected GPU ranks separated "
                            "by single commas, e.g. 0,2,4,6)")
        try:
            chosen = [int(r) for r in items]
        except ValueError:
            raise UserError(f"--ranks {ranks!r}: not a comma-separated list of GPU ranks") \
                from None
        bad = [r for r in chosen if not 0 <= r < topology.num_gpus]
        if bad:
            raise UserError(f"--ranks: GPU {bad[0]} is out of range (the topology has "
                            f"{topology.num_gpus}: 0..{topology.num_gpus - 1})")
        if len(set(chosen)) != len(chosen):
            raise UserError(f"--ranks {ranks!r}: a GPU is listed twice")
        if len(chosen) < 2:
            raise UserError(f"--ranks {ranks!r}: a collective needs at least 2 GPUs")
        return chosen
    if topology.num_gpus < 2:
        raise UserError(f"topology {topology.name!r} has {topology.num_gpus} GPU(s); "
                        "a collective needs at least 2")
    return list(range(topology.num_gpus))


def comm_rows(topology, op: str, min_bytes: int, max_bytes: int,
              calibration=None, rccl_msccl: bool = False, transport: str = "nccl",
              ranks: list[int] | None = None, dtype: str = "float32",
              nccl_env=()) -> list[dict]:
    """One row per doubling size, with the keys the issue's JSON contract names, for the
    GPUs ``ranks`` (every GPU by default) on ``dtype`` data."""
    if min_bytes < 1:
        raise UserError(f"--min-bytes must be at least 1, got {min_bytes}")
    if min_bytes > max_bytes:
        raise UserError(f"--min-bytes ({min_bytes}) is above --max-bytes ({max_bytes})")
    ranks = group_ranks(topology) if ranks is None else ranks
    shape = replace(with_env(GroupShape.of(topology, ranks), parse_nccl_env(nccl_env)),
                    rccl_msccl=rccl_msccl)
    try:
        dtype = check_dtype(op, dtype, shape)
    except SimError as err:
        raise UserError(f"--dtype {dtype}: {err}") from None
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
            cost = collective_cost(op, size, calibration.shape(shape) if calibration else shape,
                                   dtype=dtype)
        time_s = calibration.time_s(op, size, shape) if calibration else cost.time_s
        algbw = size / time_s / 1e9
        rows.append({"op": op, "bytes": size, "time_us": round(time_s * 1e6, 3),
                     "algbw_gbps": round(algbw, 3), "busbw_gbps": round(algbw * factor, 3),
                     "algorithm": cost.algorithm, "protocol": cost.protocol,
                     "transport": transport, "ranks": shape.nranks, "dtype": dtype})
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
            raise UserError(f"{args.profile} does not calibrate a GPU cluster's "
                            "collectives (use calibrate --nccl-tests)")
    ranks = group_ranks(topology, args.gpus, args.ranks)
    rows = comm_rows(topology, args.op, args.min_bytes, args.max_bytes, calibration,
                     args.rccl_msccl, args.transport, ranks, args.dtype, args.nccl_env)
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
                title=f"predicted {args.op} on {topology.name} ({len(ranks)} ranks, "
                      f"{rows[0]['dtype'] if rows else args.dtype}, {args.transport})")
    return 0
