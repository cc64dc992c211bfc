"""Read the text output of nccl-tests and rccl-tests (``all_reduce_perf`` and friends).

Both print a ``#``-commented header (``# nThread 1 nGpus 1 ...``, one ``# Rank ...`` line per
rank, and for RCCL a version block), a two-line column header, then one row per size::

    size  count  type  redop  root  time algbw busbw #wrong  [time algbw busbw #wrong]

with out-of-place and (usually) in-place columns; releases before the ``root`` column (2020
and earlier) print ``size count type redop`` and, in place of ``#wrong``, the largest
difference from the expected result. Launchers may prefix every line with the
rank (``0: ...`` from ``srun -l``); ``#wrong`` is ``N/A`` when validation is off; sizes
below one element per rank print as 0-byte rows, which are skipped. The op is
named by newer versions (``# Collective test starting: all_gather_perf``), or by the file
name, or given by the caller: the columns alone cannot tell an all-gather from a sendrecv.

A row with ``#wrong`` > 0 is a broken run, so it is refused rather than calibrated against; so
is an older row whose difference is above that release's own tolerance
(``DeltaMaxValue(type) × (ranks − 1)`` in nccl-tests' ``src/common.cu``).

>>> table = parse_nccl_tests('''# nThread 1 nGpus 1 minBytes 8 maxBytes 16 step: 2(factor)
... #  Rank  0 Group  0 Pid 1 on a device  0 [0x18] NVIDIA H100 80GB HBM3
... #  Rank  1 Group  0 Pid 2 on a device  1 [0x19] NVIDIA H100 80GB HBM3
...            8             2     float     sum      -1    12.50    0.00    0.00      0
... ''', op="all_reduce")
>>> table.world, table.rows[0].size, table.rows[0].time_us
(2, 8, 12.5)
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from treeattn.schedule.payloads import SimError

NCCL_TESTS_OPS = {
    "all_reduce": "all_reduce_perf", "all_gather": "all_gather_perf",
    "reduce_scatter": "reduce_scatter_perf", "all_to_all": "alltoall_perf",
    "sendrecv": "sendrecv_perf", "broadcast": "broadcast_perf",
}
MAX_INPUT_BYTES = 8 << 20  # a full 8 B .. 16 GiB sweep is ~10 KB; refuse anything absurd
MAX_SIZES = 1024  # distinct sizes per op: a factor-2 sweep has ~32, a -f 1.1 one ~300
_PREFIX = re.compile(r"^\s*[0-9]{1,6}:\s?")  # "0: " from srun -l / mpirun --tag-output
# ASCII digits only: "²" is a digit to str.isdigit() and \d, and int() refuses it
_RANK = re.compile(r"^#\s*Rank\s+([0-9]{1,7})\b.*?\bon\s+(\S+)\s+device\s+([0-9]+)",
                   re.ASCII)
_THREADS = re.compile(r"nThread\s+([0-9]{1,7})\s+nGpus\s+([0-9]{1,7})", re.ASCII)
_STARTING = re.compile(r"Collective test starting:\s*(\w+)", re.ASCII)
_SIZE = re.compile(r"[0-9]{1,16}")
_NUMBER = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"
# nccl-tests' DeltaMaxValue (src/common.cu, before the #wrong column): per element type, the
# largest difference per peer a correct reduction may show; integers must be exact
_DELTA_MAX = {"half": 1e-2, "float16": 1e-2, "float": 1e-5, "float32": 1e-5, "double": 1e-12,
              "float64": 1e-12}


@dataclass(frozen=True)
class NcclTestsRow:
    """One size of a run: the out-of-place time (µs) and bus bandwidth (GB/s)."""

    size: int
    time_us: float
    algbw_gbps: float
    busbw_gbps: float
    in_place_time_us: float | None = None
    # older releases: the largest difference from the expected result, and the element type
    max_error: float | None = None
    dtype: str = ""


@dataclass(frozen=True)
class NcclTestsTable:
    """A parsed nccl-tests/rccl-tests output."""

    op: str
    world: int
    rows: tuple[NcclTestsRow, ...]
    hosts: int = 1
    library: str = "nccl"  # "nccl" or "rccl"
    source: str = ""
    notes: dict = field(default_factory=dict)


def op_from_name(name: str) -> str | None:
    """The op a file name or ``*_perf`` binary name points to, if any.

    >>> op_from_name("h100_alltoall_perf.txt"), op_from_name("notes.txt")
    ('all_to_all', None)
    """
    lowered = name.lower().replace("-", "_")
    if "alltoall" in lowered or "all_to_all" in lowered:
        return "all_to_all"
    for op in ("all_reduce", "all_gather", "reduce_scatter", "sendrecv", "broadcast"):
        if op in lowered or op.replace("_", "") in lowered:
            return op
    return None


def read_nccl_tests(path: str | Path, op: str | None = None) -> NcclTestsTable:
    """Parse the nccl-tests output in ``path`` (one op); ``op`` defaults to what the text or
    name says. A file holding several ops' sections is refused: :func:`read_nccl_sections`."""
    (table,) = _single(read_nccl_sections(path, op), str(path))
    return table


def _single(tables: list[NcclTestsTable], source: str) -> list[NcclTestsTable]:
    if len(tables) > 1:
        raise SimError(f"{source}: holds {len(tables)} sections "
                       f"({', '.join(t.op for t in tables)}); read it by sections")
    return tables


def read_nccl_sections(path: str | Path, op: str | None = None) -> list[NcclTestsTable]:
    """Every op's table in the nccl-tests output at ``path``, kept apart (one file may hold
    several runs, each after its ``# Collective test starting: OP_perf`` line)."""
    path = Path(path)
    if not path.is_file():
        raise SimError(f"nccl-tests file {str(path)!r}: not a regular file")
    if path.stat().st_size > MAX_INPUT_BYTES:
        raise SimError(f"nccl-tests file {str(path)!r}: larger than {MAX_INPUT_BYTES} bytes")
    try:
        text = path.read_bytes().decode("utf-8", errors="replace")
    except OSError as exc:
        raise SimError(f"cannot read {str(path)!r}: {exc.strerror}") from None
    return parse_nccl_sections(text, op=op, source=str(path), fallback_name=path.name)


def parse_nccl_tests(text: str, op: str | None = None, source: str = "<text>",
                     fallback_name: str = "") -> NcclTestsTable:
    """Parse nccl-tests/rccl-tests text of one op; see the module docstring for the format."""
    (table,) = _single(parse_nccl_sections(text, op, source, fallback_name), source)
    return table


def parse_nccl_sections(text: str, op: str | None = None, source: str = "<text>",
                        fallback_name: str = "") -> list[NcclTestsTable]:
    """Parse nccl-tests/rccl-tests text into one table per op section, in file order. Rows
    before any ``Collective test starting`` line belong to ``op`` (or what the name says).
    One pass over the lines; a section with more than :data:`MAX_SIZES` sizes is refused."""
    ranks: dict[int, str] = {}
    threads = gpus = None
    named_op = None
    library = "nccl"
    rows: list[NcclTestsRow] = []
    sections: list[tuple[str | None, list[NcclTestsRow]]] = [(None, rows)]
    for number, raw in enumerate(text.splitlines(), 1):
        line = _PREFIX.sub("", raw, count=1).rstrip()
        if not line.strip():
            continue
        if "rccl" in line.lower() and not line.lstrip()[:1].isdigit():
            library = "rccl"
        if line.lstrip().startswith("#"):
            body = line.lstrip()
            if m := _RANK.match(body):
                ranks[int(m.group(1))] = m.group(2)
            elif m := _THREADS.search(body):
                threads, gpus = int(m.group(1)), int(m.group(2))
            elif m := _STARTING.search(body):
                named_op = op_from_name(m.group(1))
                if named_op is None:
                    raise SimError(f"{source} line {number}: unknown collective "
                                   f"{m.group(1)!r} (ops: {', '.join(NCCL_TESTS_OPS)})")
                if named_op != sections[-1][0]:
                    if sections[-1][0] is None and not rows:
                        sections.pop()
                    rows = []
                    sections.append((named_op, rows))
            continue
        fields = line.split()
        if not fields[0][:1].isdigit():
            continue  # "NCCL version ...", "RCCL version : ...", launcher noise
        row = _row(fields, number, source)
        if row is not None:
            rows.append(row)
        if len(rows) > 4 * MAX_SIZES:
            raise SimError(f"{source} line {number}: more than {4 * MAX_SIZES} rows in one "
                           f"section; a sweep has at most {MAX_SIZES} sizes")
    world = len(ranks) if ranks else (threads or 1) * (gpus or 1)
    if ranks and sorted(ranks) != list(range(len(ranks))):
        raise SimError(f"{source}: rank lines are not 0..{len(ranks) - 1}")
    for _, section_rows in sections:
        for row in section_rows:
            limit = _DELTA_MAX.get(row.dtype, 0.0) * max(1, world - 1)
            if row.max_error is not None and row.max_error > limit:
                raise SimError(f"{source}: size {row.size}: error {row.max_error:g} is above "
                               f"nccl-tests' tolerance for {row.dtype or 'its type'} on "
                               f"{world} ranks: that run computed wrong results")
    hosts = len(set(ranks.values())) if ranks else 1
    tables = []
    for named, section_rows in sections:
        chosen = named or op or op_from_name(fallback_name)
        if named is None and not section_rows and len(sections) > 1:
            continue
        if chosen is None:
            raise SimError(f"{source}: cannot tell which collective this is; name it as "
                           f"OP:FILE (ops: {', '.join(NCCL_TESTS_OPS)})")
        if chosen not in NCCL_TESTS_OPS:
            raise SimError(f"{source}: unknown op {chosen!r} (ops: "
                           f"{', '.join(NCCL_TESTS_OPS)})")
        if not section_rows:
            raise SimError(f"{source}: no data rows for {chosen} (is this nccl-tests output?)")
        if len({r.size for r in section_rows}) > MAX_SIZES:
            raise SimError(f"{source}: {chosen} has more than {MAX_SIZES} distinct sizes")
        tables.append(NcclTestsTable(chosen, world, tuple(section_rows), hosts, library,
                                     source, {"ranked_hosts": bool(ranks)}))
    ops = [t.op for t in tables]
    if len(set(ops)) != len(ops):
        raise SimError(f"{source}: op {next(o for o in ops if ops.count(o) > 1)} has two "
                       "sections; give each run its own file")
    return tables


def _row(fields: list[str], number: int, source: str) -> NcclTestsRow | None:
    """One data row: size count type redop root, then groups of (time algbw busbw #wrong);
    before the root column, size count type redop, then groups of (time algbw busbw error).
    None for a 0-byte, 0-element row: an all-gather or reduce-scatter sweep from 8 B on 4 or
    more GPUs prints one for each size below one element per rank, which moves nothing."""
    where = f"{source} line {number}"
    if len(fields) not in (8, 9, 12, 13):
        raise SimError(f"{where}: expected 9 or 13 columns (8 or 12 before nccl-tests "
                       f"printed a root), got {len(fields)}")
    first = 5 if len(fields) in (9, 13) else 4
    groups = [fields[first:first + 4]] + ([fields[first + 4:first + 8]]
                                          if len(fields) > first + 4 else [])
    parsed, errors = [], []
    for time_s, algbw, busbw, wrong in groups:
        if first == 4:  # an older release's largest difference, checked against its tolerance
            if len(wrong) > 40 or not re.fullmatch(_NUMBER, wrong, re.ASCII):
                raise SimError(f"{where}: bad error column {wrong!r}")
            errors.append(float(wrong))
        elif wrong not in ("N/A", "0"):
            if re.fullmatch(r"\d+", wrong):
                raise SimError(f"{where}: #wrong is {wrong}: that run computed wrong results")
            raise SimError(f"{where}: bad #wrong column {wrong!r}")
        values = []
        for token in (time_s, algbw, busbw):
            if len(token) > 40 or not re.fullmatch(_NUMBER, token, re.ASCII):
                raise SimError(f"{where}: {token!r} is not a number")
            value = float(token)
            if not math.isfinite(value) or value < 0:
                raise SimError(f"{where}: {token!r} is out of range")
            values.append(value)
        parsed.append(values)
    if not _SIZE.fullmatch(fields[0]):
        raise SimError(f"{where}: size {fields[0][:24]!r} is not a byte count of at most 16 "
                       "ASCII digits")
    size = int(fields[0])
    if size == 0 and fields[1] == "0":
        return None  # nccl-tests' row for a size that leaves no element per rank
    if size <= 0 or size > 1 << 50:
        raise SimError(f"{where}: size {fields[0]} is out of range")
    if parsed[0][0] <= 0:
        raise SimError(f"{where}: time must be positive")
    in_place = parsed[1][0] if len(parsed) > 1 else None
    return NcclTestsRow(size, parsed[0][0], parsed[0][1], parsed[0][2], in_place,
                        max(errors) if errors else None, fields[2].lower())
