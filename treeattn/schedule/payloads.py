"""The names and shapes of the schedule IR: payload buffers, compute labels, merge and
collective ops, the one table of payload layouts, and the one sharding rule.

Split from :mod:`treeattn.schedule.ir` (which defines the steps and their semantics) so
that every executor, the memory model and the wire format read one table without pulling in
the validator. Plain data: no simpy, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from math import prod

from treeattn.errors import TreeattnError


class SimError(TreeattnError, ValueError):
    """Bad simulator input: an unknown model, an impossible plan, a bad parameter."""


class ScheduleError(SimError):
    """A schedule that cannot run: an unmatched send, a deadlock. Names the rank and step."""


class _Name(str, Enum):
    """A name that *is* its string: ``Payload.PARTIAL == "partial"``, prints as ``partial``
    and hashes like the string, so old spellings and dict keys keep working."""

    __hash__ = str.__hash__

    def __str__(self) -> str:
        return self.value


class Payload(_Name):
    """The named per-rank buffers a Send/Recv moves (see the module docstring)."""

    PARTIAL = "partial"
    KV = "kv"
    MAX = "max"
    NUM = "num"
    DEN = "den"
    RESIDUE = "residue"
    NUMDEN = "numden"
    QUERY = "query"
    QBLOCK = "qblock"
    OUTBOX = "outbox"


class ComputeLabel(_Name):
    """What a :class:`Compute` step does."""

    ATTENTION = "attention"
    ATTENTION_BLOCK = "attention_block"
    RESCALE = "rescale"
    RESCALE_PACKED = "rescale_packed"
    FINALIZE_PACKED = "finalize_packed"
    FINALIZE_GLOBAL = "finalize_global"
    FINALIZE = "finalize"
    INIT_MAX = "init_max"
    ATTENTION_QBLOCK = "attention_qblock"
    PLACE_ROWS = "place_rows"


class MergeOp(_Name):
    """How a :class:`Merge` folds a message in."""

    PARTIAL = "partial"
    MAX = "max"
    SUM = "sum"
    RESIDUE = "residue"
    LSE = "lse"


class CollectiveOp(_Name):
    """Which collective a :class:`~treeattn.schedule.ir.Collective` step runs."""

    ALL_REDUCE_SUM = "all_reduce_sum"
    ALL_REDUCE_MAX = "all_reduce_max"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"
    BROADCAST = "broadcast"

    @property
    def library_op(self) -> str:
        """The op as NCCL and nccl-tests name it (what the cost model prices)."""
        return "all_reduce" if self.value.startswith("all_reduce") else self.value


def busbw_factor(op: str, nranks: int) -> float:
    """nccl-tests' bus-bandwidth factor (its doc/PERFORMANCE.md): busbw = algbw × factor, which
    is also the bytes each member sends per byte of the op's nccl-tests size. ``op`` is a
    library op name (:attr:`CollectiveOp.library_op`)."""
    n = nranks
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    return 1.0


PAYLOADS = tuple(Payload)
COMPUTE_LABELS = tuple(ComputeLabel)
MERGE_OPS = tuple(MergeOp)
COLLECTIVE_OPS = tuple(CollectiveOp)


@dataclass(frozen=True)
class PayloadLayout:
    """How one payload buffer is laid out: the arrays packed one after the other into one
    flat buffer, each a shape over the symbols ``B`` (batch), ``Hq``/``Hkv`` (query / KV
    heads), ``D`` (head dim), ``T`` (a KV block's tokens), ``P`` (the world) and ``Bq``
    (``ceil(B / P)``, the query slots a rank owns in ``ring-passq``); the element type
    (``fp32`` or the KV ``cache`` dtype); and ``chunk_axis``: ``"Hq"`` when a chunk is a
    range of query heads of every array (the partial), ``"P"`` when it is a range of origin
    slots of every array (the pass-Q outbox), ``None`` when it is a slice of the flat
    buffer."""

    arrays: tuple[tuple[str, ...], ...]
    dtype: str = "fp32"
    chunk_axis: str | None = None
    # A partial's (o, lse): its first array (o) travels in the schedule's partial wire
    # format (:data:`PARTIAL_DTYPES`), the others (lse) stay fp32.
    wire: bool = False


# The partial wire formats: bytes per element of ``o`` (``lse`` stays fp32). ``bf16`` is what
# the serving engines move (vLLM's DCP all-to-all, Star Attention's all-gather): o in the
# attention dtype, lse in fp32. A bf16 partial is rounded once on its sender, which keeps
# the rounded copy too (every replica merges the same values).
PARTIAL_DTYPES = {"fp32": 4, "bf16": 2}

_PARTIAL_LAYOUT = PayloadLayout((("B", "Hq", "D"), ("B", "Hq")), chunk_axis="Hq",
                                wire=True)  # o, lse
# THE table of payload shapes: the memory model, the simulator's message sizes, the numpy
# reference executor and the runtime's wire format all read it.
PAYLOAD_LAYOUTS: dict[Payload, PayloadLayout] = {
    Payload.PARTIAL: _PARTIAL_LAYOUT,
    Payload.RESIDUE: _PARTIAL_LAYOUT,
    Payload.NUMDEN: PayloadLayout((("B", "Hq", "D"), ("B", "Hq")),
                                  chunk_axis="Hq"),  # num then den, packed (allreduce2)
    Payload.QUERY: PayloadLayout((("B", "Hq", "D"),), dtype="cache", chunk_axis="Hq"),
    Payload.MAX: PayloadLayout((("B", "Hq"),)),
    Payload.NUM: PayloadLayout((("B", "Hq", "D"),)),
    Payload.DEN: PayloadLayout((("B", "Hq"),)),
    Payload.KV: PayloadLayout((("2", "B", "Hkv", "T", "D"),), dtype="cache"),  # K then V
    # ring-passq: the query block a rank holds, and one (o, lse) slot per origin rank.
    Payload.QBLOCK: PayloadLayout((("Bq", "Hq", "D"),), dtype="cache"),
    Payload.OUTBOX: PayloadLayout((("P", "Bq", "Hq", "D"), ("P", "Bq", "Hq")), chunk_axis="P",
                                  wire=True),
}
# Which buffers each Compute label sets (the memory model counts them from then on).
COMPUTE_SETS: dict[ComputeLabel, tuple[Payload, ...]] = {
    ComputeLabel.ATTENTION: (Payload.PARTIAL,),
    ComputeLabel.ATTENTION_BLOCK: (),
    ComputeLabel.INIT_MAX: (Payload.MAX,),
    ComputeLabel.RESCALE_PACKED: (Payload.NUMDEN,),
    ComputeLabel.FINALIZE_PACKED: (Payload.PARTIAL,),
    ComputeLabel.FINALIZE_GLOBAL: (Payload.PARTIAL,),
    ComputeLabel.RESCALE: (Payload.NUM, Payload.DEN),
    ComputeLabel.FINALIZE: (Payload.PARTIAL,),
    ComputeLabel.ATTENTION_QBLOCK: (Payload.OUTBOX,),
    ComputeLabel.PLACE_ROWS: (Payload.PARTIAL,),
}


def payload_numel(payload: str, dims: dict[str, int]) -> int:
    """Elements of ``payload``'s flat buffer for the symbol values ``dims``.

    >>> payload_numel("partial", {"B": 1, "Hq": 4, "D": 16})
    68
    >>> payload_numel("kv", {"B": 1, "Hkv": 2, "T": 3, "D": 16})
    192
    >>> payload_numel("outbox", {"P": 3, "Bq": 2, "Hq": 4, "D": 16})
    408
    """
    layout = PAYLOAD_LAYOUTS[Payload(payload)]
    return sum(prod(int(s) if s.isdigit() else dims[s] for s in shape)
               for shape in layout.arrays)


def payload_bytes(payload: str, dims: dict[str, int], cache_bytes: int,
                  partial_dtype: str = "fp32") -> int:
    """Bytes of ``payload``'s buffer: :func:`payload_numel`'s elements, each array in its
    element type (the KV cache's, fp32, or for a partial's ``o`` the wire format's).

    >>> payload_bytes("partial", {"B": 1, "Hq": 4, "D": 16}, 2, "bf16")  # 64·2 + 4·4
    144
    """
    layout = PAYLOAD_LAYOUTS[Payload(payload)]
    total = 0
    for index, shape in enumerate(layout.arrays):
        numel = prod(int(s) if s.isdigit() else dims[s] for s in shape)
        total += numel * element_bytes(layout, index, cache_bytes, partial_dtype)
    return total


def element_bytes(layout: PayloadLayout, index: int, cache_bytes: int,
                  partial_dtype: str = "fp32") -> int:
    """Bytes per element of array ``index`` of ``layout``."""
    if layout.dtype == "cache":
        return cache_bytes
    if layout.wire and index == 0:
        return PARTIAL_DTYPES[partial_dtype]
    return 4


def query_slots(batch: int, world: int) -> int:
    """``Bq``: the query slots each rank owns when ``batch`` queries are dealt round-robin
    over ``world`` ranks, padded with dummies to a multiple of the world (``ring-passq``).

    >>> query_slots(1, 4), query_slots(4, 4), query_slots(5, 4)
    (1, 1, 2)
    """
    return -(-batch // world)


def shard_sizes(total: int, count: int) -> list[int]:
    """THE sharding rule: ``numpy.array_split`` sizes of ``total`` items in ``count``
    contiguous parts, the first ``total % count`` one larger (a part may be empty).

    Sequence shards, chunks of a payload and the heads of a partial all follow it.

    >>> shard_sizes(10, 4)
    [3, 3, 2, 2]
    """
    base, extra = divmod(total, count)
    return [base + (1 if i < extra else 0) for i in range(count)]


def shard_bounds(total: int, count: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` of each part of :func:`shard_sizes`.

    >>> shard_bounds(10, 3)
    [(0, 4), (4, 7), (7, 10)]
    """
    out, lo = [], 0
    for size in shard_sizes(total, count):
        out.append((lo, lo + size))
        lo += size
    return out


class GroupIds:
    """Small integer ids for collective groups, without hashing a group's ranks every time.

    A group is a tuple of up to tens of thousands of ranks, and tuples do not cache their
    hash: keying dictionaries by the tuple itself made each lookup O(p) and the walk over a
    16k-rank schedule O(p²). Generators share one tuple object per group, so the object's
    identity is the fast key; equal tuples that are distinct objects (a schedule read from a
    plan file) still get the same id, at one hash per object.
    """

    def __init__(self) -> None:
        self._by_identity: dict[int, int] = {}
        self._by_value: dict[tuple, int] = {}
        self._keep: list[tuple] = []  # keep the objects alive, so identities stay unique

    def __call__(self, group: tuple[int, ...]) -> int:
        found = self._by_identity.get(id(group))
        if found is None:
            found = self._by_value.setdefault(group, len(self._by_value))
            self._by_identity[id(group)] = found
            self._keep.append(group)
        return found
