"""The schedule IR: what every rank does, in order, for one attention decode step.

This module is plain data. It must not import simpy or torch: the simulator
(``treeattn.sim.engine``) and the runtime (``treeattn.runtime.executor``) execute *the same*
:class:`Schedule`, which is what lets a measurement be compared with its prediction step by
step.

Execution semantics (both executors follow them exactly)
--------------------------------------------------------
Each rank owns a few named buffers, the *payloads*:

* ``"partial"`` the rank's running partial ``(o, lse)``, shapes (B, Hq, D) and (B, Hq), fp32;
* ``"kv"``      the KV block the rank is currently attending over (ring only); at the start
  it is the rank's own shard;
* ``"max"``     a running maximum of shape (B, Hq) (``allreduce3``);
* ``"num"``     a running sum of shape (B, Hq, D) (``allreduce3``);
* ``"den"``     a running sum of shape (B, Hq) (``allreduce3``);
* ``"residue"`` a second running partial, laid out like ``"partial"`` (``butterfly`` when p is
  not a power of two; see :mod:`treeattn.sim.algorithms.butterfly`). Unset until a Merge sets it.

Steps, run in list order per rank:

* :class:`Compute` is local work on the device. Its ``label`` says which:

  - ``"attention"``: partial attention over the rank's own KV shard; sets ``"partial"``.
  - ``"attention_block"``: partial attention over the current ``"kv"`` block into a temporary
    *block partial*; a following ``Merge(op="partial", tag=None)`` folds it into ``"partial"``.
  - ``"rescale"`` (allreduce3): from ``"partial"`` and the all-reduced ``"max"``, set
    ``den = exp(lse - max)`` and ``num = o * den``.
  - ``"finalize"`` (allreduce3): ``o = num / den``, ``lse = max + log(den)``; sets ``"partial"``.
  - ``"init_max"`` (allreduce3): ``max = lse`` of ``"partial"``.

* :class:`Send` posts a non-blocking send of the rank's current ``payload`` buffer (or one
  ``chunk`` of it, see below) to ``dst``. The executor snapshots what it sends, so later steps
  may change the buffer freely. All sends complete before the rank's schedule ends.
* :class:`Recv` blocks until the message from ``src`` with ``tag`` has arrived. An executor may
  *post* the receive earlier (the runtime posts a rank's next receive as soon as its previous
  one completed, so at most one receive is in flight ahead); that is what lets ring overlap
  its transfer with compute. With ``reduce=False`` the message *replaces* the ``payload``
  buffer (a broadcast, a gather, a KV rotation). With ``reduce=True`` it is kept aside until
  the :class:`Merge` step with the same ``tag`` folds it in.
* :class:`Merge` folds the message received under ``tag`` into the rank's buffer with ``op``:
  ``"partial"`` (the log-sum-exp merge, into ``"partial"``), ``"max"`` or ``"sum"`` (into the
  buffer named by the matching Recv's payload), or ``"residue"``: ``residue ← partial ⊕
  message`` (the message received under ``tag`` is kept with ``reduce=True``; ``tag=None``
  means ``residue ← partial``, a copy). For ``op="partial"``, ``tag=None`` folds the block
  partial of the preceding ``attention_block`` Compute into ``"partial"`` (ring).

A ``chunk=(index, count)`` on Send/Recv restricts it to the ``index``-th of ``count``
equal slices of the flattened payload (ring all-reduce). ``None`` means the whole buffer.
Slices follow ``numpy.array_split``: when the length does not divide, the first
``length % count`` slices hold one element more (a slice may be empty). For the
``"partial"`` payload the slice is taken along the query-head axis Hq, ``o`` and ``lse``
together, so each slice merges on its own (the double binary tree sends each half of the
heads up a different tree); a Merge of a chunked message acts on that slice only.

Tags are unique per (src, dst) pair within one schedule.

``nbytes`` everywhere is what the step moves or touches, in bytes: what the simulator costs.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field
from enum import Enum
from math import prod


class SimError(ValueError):
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


class ComputeLabel(_Name):
    """What a :class:`Compute` step does."""

    ATTENTION = "attention"
    ATTENTION_BLOCK = "attention_block"
    RESCALE = "rescale"
    FINALIZE = "finalize"
    INIT_MAX = "init_max"


class MergeOp(_Name):
    """How a :class:`Merge` folds a message in."""

    PARTIAL = "partial"
    MAX = "max"
    SUM = "sum"
    RESIDUE = "residue"


PAYLOADS = tuple(Payload)
COMPUTE_LABELS = tuple(ComputeLabel)
MERGE_OPS = tuple(MergeOp)


@dataclass(frozen=True)
class PayloadLayout:
    """How one payload buffer is laid out: the arrays packed one after the other into one
    flat buffer, each a shape over the symbols ``B`` (batch), ``Hq``/``Hkv`` (query / KV
    heads), ``D`` (head dim) and ``T`` (a KV block's tokens); the element type (``fp32`` or
    the KV ``cache`` dtype); and ``chunk_axis``: ``"Hq"`` when a chunk is a range of query
    heads of every array (the partial), ``None`` when it is a slice of the flat buffer."""

    arrays: tuple[tuple[str, ...], ...]
    dtype: str = "fp32"
    chunk_axis: str | None = None


_PARTIAL_LAYOUT = PayloadLayout((("B", "Hq", "D"), ("B", "Hq")), chunk_axis="Hq")  # o, lse
# THE table of payload shapes: the memory model, the simulator's message sizes, the numpy
# reference executor and the runtime's wire format all read it.
PAYLOAD_LAYOUTS: dict[Payload, PayloadLayout] = {
    Payload.PARTIAL: _PARTIAL_LAYOUT,
    Payload.RESIDUE: _PARTIAL_LAYOUT,
    Payload.MAX: PayloadLayout((("B", "Hq"),)),
    Payload.NUM: PayloadLayout((("B", "Hq", "D"),)),
    Payload.DEN: PayloadLayout((("B", "Hq"),)),
    Payload.KV: PayloadLayout((("2", "B", "Hkv", "T", "D"),), dtype="cache"),  # K then V
}
# Which buffers each Compute label sets (the memory model counts them from then on).
COMPUTE_SETS: dict[ComputeLabel, tuple[Payload, ...]] = {
    ComputeLabel.ATTENTION: (Payload.PARTIAL,),
    ComputeLabel.ATTENTION_BLOCK: (),
    ComputeLabel.INIT_MAX: (Payload.MAX,),
    ComputeLabel.RESCALE: (Payload.NUM, Payload.DEN),
    ComputeLabel.FINALIZE: (Payload.PARTIAL,),
}


def payload_numel(payload: str, dims: dict[str, int]) -> int:
    """Elements of ``payload``'s flat buffer for the symbol values ``dims``.

    >>> payload_numel("partial", {"B": 1, "Hq": 4, "D": 16})
    68
    >>> payload_numel("kv", {"B": 1, "Hkv": 2, "T": 3, "D": 16})
    192
    """
    layout = PAYLOAD_LAYOUTS[Payload(payload)]
    return sum(prod(int(s) if s.isdigit() else dims[s] for s in shape)
               for shape in layout.arrays)


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


@dataclass(frozen=True)
class Compute:
    """Local work on the device, costed by the hardware model (bytes or FLOPs bound)."""

    label: ComputeLabel | str
    nbytes: int = 0
    flops: int = 0


@dataclass(frozen=True)
class Send:
    """Post a non-blocking send of ``payload`` (or one chunk of it) to rank ``dst``."""

    dst: int
    nbytes: int
    tag: int
    payload: Payload | str = Payload.PARTIAL
    chunk: tuple[int, int] | None = None


@dataclass(frozen=True)
class Recv:
    """Wait for the message from ``src`` with ``tag``; replace or keep it for a Merge."""

    src: int
    nbytes: int
    tag: int
    payload: Payload | str = Payload.PARTIAL
    chunk: tuple[int, int] | None = None
    reduce: bool = True


@dataclass(frozen=True)
class Merge:
    """Fold the message received under ``tag`` (or the ring block partial) into a buffer."""

    nbytes: int
    op: MergeOp | str = MergeOp.PARTIAL
    tag: int | None = None


Step = Compute | Send | Recv | Merge


class Tags:
    """Hands out tags unique per (src, dst) pair: 0, 1, 2, … in the order they are asked."""

    def __init__(self) -> None:
        self._next: dict[tuple[int, int], int] = defaultdict(int)

    def __call__(self, src: int, dst: int) -> int:
        tag = self._next[(src, dst)]
        self._next[(src, dst)] = tag + 1
        return tag


@dataclass
class Schedule:
    """The steps of every rank for one decode step, plus the algorithm that produced them.

    ``steps[r]`` is rank ``r``'s ordered list. ``params`` records the generator's choices
    (tree shape, root, parent array, ...) so a plan can be explained and reproduced.
    """

    algorithm: str
    steps: list[list[Step]]
    params: dict = field(default_factory=dict)

    @property
    def world(self) -> int:
        return len(self.steps)

    def validate(self) -> Schedule:
        """Check matching sends/receives and freedom from deadlock; return ``self``.

        Raises :class:`ScheduleError` naming the rank and step.
        """
        validate(self)
        return self

    def num_steps(self) -> int:
        return sum(len(s) for s in self.steps)

    def __str__(self) -> str:
        head = f"Schedule({self.algorithm}, world={self.world}, steps={self.num_steps()})"
        lines = [head]
        for r, steps in enumerate(self.steps[:8]):
            lines.append(f"  rank {r}: " + ", ".join(step_name(s) for s in steps[:12])
                         + (" …" if len(steps) > 12 else ""))
        if self.world > 8:
            lines.append(f"  … {self.world - 8} more ranks")
        return "\n".join(lines)


def step_name(step: Step) -> str:
    """The name both executors use for a step in timelines: ``attention``, ``send``,
    ``recv``, ``merge:partial`` …

    >>> step_name(Merge(12, "max", 3))
    'merge:max'
    """
    if isinstance(step, Compute):
        return step.label
    if isinstance(step, Send):
        return "send"
    if isinstance(step, Recv):
        return "recv"
    return f"merge:{step.op}"


# -- validation --------------------------------------------------------------------------
# ``validate(schedule)``: every send has one matching receive, and nothing can deadlock.
#
# The deadlock check executes the schedule symbolically: sends never block, a receive
# proceeds once the matching message was sent, and a rank stuck on a receive is woken when
# that message is posted. Anything still waiting at the end names its rank and step.


def _check_step(r: int, i: int, step, world: int) -> None:
    where = f"rank {r} step {i} ({type(step).__name__})"
    if isinstance(step, Compute):
        if step.label not in COMPUTE_LABELS:
            raise ScheduleError(f"{where}: unknown compute label {step.label!r}")
    elif isinstance(step, Send | Recv):
        peer = step.dst if isinstance(step, Send) else step.src
        if not 0 <= peer < world or peer == r:
            raise ScheduleError(f"{where}: peer {peer} is not another rank")
        if step.payload not in PAYLOADS:
            raise ScheduleError(f"{where}: unknown payload {step.payload!r}")
        if step.chunk is not None and not 0 <= step.chunk[0] < step.chunk[1]:
            raise ScheduleError(f"{where}: bad chunk {step.chunk}")
    elif isinstance(step, Merge):
        if step.op not in MERGE_OPS:
            raise ScheduleError(f"{where}: unknown merge op {step.op!r}")
    else:
        raise ScheduleError(f"{where}: not a schedule step")
    if getattr(step, "nbytes", 0) < 0:
        raise ScheduleError(f"{where}: negative nbytes")


def _match_messages(schedule: Schedule) -> None:
    sends: dict[tuple[int, int, int], tuple[int, Send]] = {}
    for r, steps in enumerate(schedule.steps):
        for i, s in enumerate(steps):
            _check_step(r, i, s, schedule.world)
            if isinstance(s, Send):
                key = (r, s.dst, s.tag)
                if key in sends:
                    raise ScheduleError(f"rank {r} step {i}: tag {s.tag} to {s.dst} reused")
                sends[key] = (i, s)
    for r, steps in enumerate(schedule.steps):
        for i, s in enumerate(steps):
            if not isinstance(s, Recv):
                continue
            found = sends.pop((s.src, r, s.tag), None)
            if found is None:
                raise ScheduleError(f"rank {r} step {i}: Recv from {s.src} tag {s.tag} has no Send")
            j, send = found
            if (send.nbytes, send.payload, send.chunk) != (s.nbytes, s.payload, s.chunk):
                raise ScheduleError(
                    f"rank {r} step {i}: Recv from {s.src} tag {s.tag} does not match "
                    f"rank {s.src} step {j} (size/payload/chunk)"
                )
    if sends:
        (src, dst, tag), (i, _) = next(iter(sends.items()))
        raise ScheduleError(f"rank {src} step {i}: Send to {dst} tag {tag} is never received")


def _check_merges(schedule: Schedule) -> None:
    for r, steps in enumerate(schedule.steps):
        pending: set[int] = set()
        block = False
        for i, s in enumerate(steps):
            if isinstance(s, Recv) and s.reduce:
                pending.add(s.tag)
            elif isinstance(s, Compute) and s.label == ComputeLabel.ATTENTION_BLOCK:
                block = True
            elif isinstance(s, Merge):
                if s.tag is None and s.op == MergeOp.PARTIAL and not block:
                    raise ScheduleError(f"rank {r} step {i}: Merge with no block partial")
                if s.tag is not None and s.tag not in pending:
                    raise ScheduleError(f"rank {r} step {i}: Merge of tag {s.tag} not received")
                if s.op == MergeOp.PARTIAL:  # a residue copy (tag None) leaves the block alone
                    block = block and s.tag is not None
                pending.discard(s.tag)
        if pending:
            raise ScheduleError(f"rank {r}: received tag(s) {sorted(pending)} never merged")


def _check_deadlock(schedule: Schedule) -> None:
    world = schedule.world
    pc = [0] * world
    posted: set[tuple[int, int, int]] = set()
    waiting: dict[tuple[int, int, int], int] = {}
    ready = deque(range(world))
    while ready:
        r = ready.popleft()
        steps = schedule.steps[r]
        while pc[r] < len(steps):
            s = steps[pc[r]]
            if isinstance(s, Send):
                key = (r, s.dst, s.tag)
                posted.add(key)
                if key in waiting:
                    ready.append(waiting.pop(key))
            elif isinstance(s, Recv) and (s.src, r, s.tag) not in posted:
                waiting[(s.src, r, s.tag)] = r
                break
            pc[r] += 1
    for r in range(world):
        if pc[r] < len(schedule.steps[r]):
            s = schedule.steps[r][pc[r]]
            raise ScheduleError(
                f"deadlock: rank {r} step {pc[r]} waits forever for a message from rank "
                f"{s.src} tag {s.tag}"
            )


def validate(schedule: Schedule) -> None:
    """Raise :class:`ScheduleError` naming the rank and step of the first problem found."""
    _match_messages(schedule)
    _check_merges(schedule)
    _check_deadlock(schedule)
