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
  not a power of two; see :mod:`treeattn.schedule.algorithms.butterfly`). Unset until a Merge
  sets it.
* ``"numden"``  ``num`` and ``den`` packed like a partial (``allreduce2``: one all-reduce).
* ``"qblock"``  (``ring-passq``) the query block a rank holds, (Bq, Hq, D) in the cache
  dtype, ``Bq = ceil(B / p)``. At the start rank ``k`` holds its *own* block (origin ``k``):
  slot ``i`` is query ``b = i·p + k`` (round-robin), and a slot with ``b ≥ B`` is a dummy
  zero query (padding: it is computed and sent like a real one). Queries are replicated
  in treeattn, so this needs no communication.
* ``"outbox"``  (``ring-passq``) one partial per origin rank, ``o`` (p, Bq, Hq, D) then
  ``lse`` (p, Bq, Hq), fp32; starts as the identity (0, −inf). Its chunk ``(i, p)`` is the
  origin slot ``i`` of both arrays.

Steps, run in list order per rank:

* :class:`Compute` is local work on the device. Its ``label`` says which:

  - ``"attention"``: partial attention over the rank's own KV shard; sets ``"partial"``.
  - ``"attention_block"``: partial attention over the current ``"kv"`` block into a temporary
    *block partial*; a following ``Merge(op="partial", tag=None)`` folds it into ``"partial"``.
  - ``"rescale"`` (allreduce3): from ``"partial"`` and the all-reduced ``"max"``, set
    ``den = exp(lse - max)`` and ``num = o * den``.
  - ``"finalize"`` (allreduce3): ``o = num / den``, ``lse = max + log(den)``; sets ``"partial"``.
  - ``"init_max"`` (allreduce3): ``max = lse`` of ``"partial"``.
  - ``"rescale_packed"`` / ``"finalize_packed"`` (allreduce2): the same two steps with
    ``num`` and ``den`` packed in ``"numden"``.
  - ``"finalize_global"`` (dcp): ``o = num``, ``lse = max``, where ``max`` already holds the
    global log-sum-exp and ``num`` the reduced, rescaled outputs; sets ``"partial"``.
  - ``"attention_qblock"`` (ring-passq): attend the held ``"qblock"`` (slot ``i`` against
    the own KV shard of sequence ``b = i·p + s``, a dummy slot against sequence ``b mod B``)
    and write the result into outbox slot ``s``, the block's origin. The origin follows from
    the step count: the ``j``-th ``attention_qblock`` of rank ``k`` (``j`` from 0) attends
    the block of origin ``s = (k − j) mod p`` (the ring passes blocks to ``k + 1``).
  - ``"place_rows"`` (ring-passq): ``"partial"`` ← the (B, Hq, D) partial whose row
    ``b = i·p + s`` is outbox slot ``s`` row ``i``, for every real query ``b < B``; dummy
    rows are dropped.

* :class:`Send` posts a non-blocking send of the rank's current ``payload`` buffer (or one
  ``chunk`` of it, see below) to ``dst``. The executor snapshots what it sends, so later steps
  may change the buffer freely. All sends complete before the rank's schedule ends. When the
  schedule's ``partial_dtype`` is ``"bf16"``, a Send or Collective that moves a partial's
  ``o`` (a payload laid out ``wire``) first rounds the part it moves to bf16 in the sender's
  own buffer, so the sender goes on with exactly what its peers receive.
* :class:`Recv` blocks until the message from ``src`` with ``tag`` has arrived. An executor may
  *post* the receive earlier (the runtime posts a rank's next receive as soon as its previous
  one completed, so at most one receive is in flight ahead); that is what lets ring overlap
  its transfer with compute. With ``reduce=False`` the message *replaces* the ``payload``
  buffer (a broadcast, a gather, a KV rotation). With ``reduce=True`` it is kept aside until
  the :class:`Merge` step with the same ``tag`` folds it in.
* :class:`Merge` folds the message received under ``tag`` into the rank's buffer with ``op``:
  ``"partial"`` (the log-sum-exp merge, into ``"partial"``), ``"max"``, ``"sum"`` or ``"lse"``
  (``log(exp(a) + exp(b))``; into the buffer named by the matching Recv's or Collective's
  payload), or ``"residue"``: ``residue ← partial ⊕
  message`` (the message received under ``tag`` is kept with ``reduce=True``; ``tag=None``
  means ``residue ← partial``, a copy). For ``op="partial"``, ``tag=None`` folds the block
  partial of the preceding ``attention_block`` Compute into ``"partial"`` (ring).

* :class:`Collective` runs one collective over an explicit ``group`` of ranks (in group
  order; member ``i`` is ``group[i]``, ``p = len(group)``). Every member must reach the same
  collectives of a group in the same order; each member blocks until all have arrived.
  A group may be any subset of the ranks (a *subgroup*): collectives of disjoint groups run
  at the same time (``hier``'s node groups, one per host, then its rails, GPU ``i`` of
  every host), and a rank may belong to several groups, whose collectives it runs one after
  another in its step order. Every executor honours this: the simulator prices each
  group's collective as the library runs a communicator of exactly those ranks (its hosts
  and GPUs per host, :class:`treeattn.sim.nccl.group_shape.GroupShape`), the numpy
  reference holds a rendezvous of the members only, and the runtime runs it on a process
  group of those ranks made once per process group (:mod:`treeattn.runtime.collectives`).

  - ``all_reduce_sum`` / ``all_reduce_max``: ``payload ← Σ`` (or elementwise max) of every
    member's ``payload``; the result is on every member.
  - ``broadcast``: ``payload ← `` the payload of member ``root`` (a rank number).
  - ``all_gather``: every member keeps, under ``tag``, the ``payload`` of each *other*
    member; a later ``Merge(op, tag)`` folds them in, in group order. With ``sharded=True``
    member ``i`` contributes only chunk ``(i, p)`` of its payload and every member's payload
    is *replaced* by the concatenation (no tag): head shards become a replicated buffer.
  - ``reduce_scatter`` (sum): member ``i``'s chunk ``(i, p)`` of ``payload`` ← the sum of
    every member's chunk ``i``; the rest of the buffer is left stale (head-sharded output).
  - ``all_to_all``: member ``i`` sends chunk ``(j, p)`` of its payload to member ``j`` and
    keeps, under ``tag``, the chunk ``i`` of each other member; ``Merge(op, tag)`` folds them
    into its own chunk ``i``. The output is head-sharded (for the ``"outbox"``, whose chunks
    are origin slots, member ``i``'s slot ``i`` then merges every rank's partial of its
    own queries: the output is batch-sharded).

  What a collective kept is folded into the collective's payload (``"partial"`` for a
  gather or all-to-all of partials, ``"outbox"`` for pass-Q's); chunks follow the payload's
  ``chunk_axis`` (query heads, or origin slots for the outbox; ``sharded=True`` too).

  ``nbytes`` is the size the way nccl-tests counts it: the whole buffer for all-reduce,
  broadcast, reduce-scatter and all-to-all, the whole gathered buffer for all-gather.
  Collective tags come from :meth:`Tags.collective` and never collide with message tags.

A ``chunk=(index, count)`` on Send/Recv restricts it to the ``index``-th of ``count``
equal slices of the flattened payload (ring all-reduce). ``None`` means the whole buffer.
Slices follow ``numpy.array_split``: when the length does not divide, the first
``length % count`` slices hold one element more (a slice may be empty). For the
``"partial"`` payload the slice is taken along the query-head axis Hq, ``o`` and ``lse``
together, so each slice merges on its own (the double binary tree sends each half of the
heads up a different tree); a Merge of a chunked message acts on that slice only.

Tags are unique per (src, dst) pair within one schedule, and a rank's pending tags never
collide (collective tags live in their own range).

Where the merged output lands is the schedule's ``output_layout``: ``"replicated"`` (every
rank holds the whole ``"partial"``) or ``"head_sharded"`` (rank ``group[i]`` holds chunk
``(i, p)`` of the heads, after a reduce-scatter or an all-to-all).

``nbytes`` everywhere is what the step moves or touches, in bytes: what the simulator costs.
"""
from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field

from treeattn.schedule.payloads import (
    COLLECTIVE_OPS,
    COMPUTE_LABELS,
    MERGE_OPS,
    PAYLOADS,
    CollectiveOp,
    ComputeLabel,
    MergeOp,
    Payload,
    ScheduleError,
    busbw_factor,
)


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


@dataclass(frozen=True)
class Collective:
    """One collective over ``group`` (see the module docstring for each op's semantics)."""

    op: CollectiveOp | str
    group: tuple[int, ...]
    nbytes: int
    payload: Payload | str = Payload.PARTIAL
    tag: int | None = None
    sharded: bool = False
    root: int | None = None

    @property
    def keeps_messages(self) -> bool:
        """Whether it leaves messages under ``tag`` for a Merge (all-gather, all-to-all)."""
        return self.op == CollectiveOp.ALL_TO_ALL or (
            self.op == CollectiveOp.ALL_GATHER and not self.sharded)


Step = Compute | Send | Recv | Merge | Collective
OUTPUT_LAYOUTS = ("replicated", "head_sharded")


COLLECTIVE_TAG_BASE = 1 << 30  # collective tags start here, above any message tag


class Tags:
    """Hands out tags unique per (src, dst) pair: 0, 1, 2, … in the order they are asked,
    and collective tags (:meth:`collective`) from their own range."""

    def __init__(self) -> None:
        self._next: dict[tuple[int, int], int] = defaultdict(int)
        self._collective = COLLECTIVE_TAG_BASE

    def collective(self) -> int:
        tag = self._collective
        self._collective += 1
        return tag

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
    output_layout: str = "replicated"
    # How its partials travel (treeattn.schedule.payloads.PARTIAL_DTYPES): a sender rounds
    # what it sends of a partial to this format and keeps the rounded copy
    partial_dtype: str = "fp32"

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
    if isinstance(step, Collective):
        return str(step.op)
    return f"merge:{step.op}"


def sent_bytes(step) -> int:
    """Bytes a rank puts on the wire for one step: a Send's size, a collective's share."""
    if isinstance(step, Send):
        return step.nbytes
    if isinstance(step, Collective):
        p = len(step.group)
        return int(step.nbytes * busbw_factor(CollectiveOp(step.op).library_op, p)) if p > 1 else 0
    return 0


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
    elif isinstance(step, Collective):
        _check_collective(where, r, step, world)
    else:
        raise ScheduleError(f"{where}: not a schedule step")
    if getattr(step, "nbytes", 0) < 0:
        raise ScheduleError(f"{where}: negative nbytes")


def _check_collective(where: str, r: int, step: Collective, world: int) -> None:
    if step.op not in COLLECTIVE_OPS:
        raise ScheduleError(f"{where}: unknown collective {step.op!r}")
    if step.payload not in PAYLOADS:
        raise ScheduleError(f"{where}: unknown payload {step.payload!r}")
    group = step.group
    if len(set(group)) != len(group) or not all(0 <= m < world for m in group):
        raise ScheduleError(f"{where}: group {group} must be distinct ranks below {world}")
    if r not in group:
        raise ScheduleError(f"{where}: rank {r} runs a collective of group {group} it is not in")
    if step.op == CollectiveOp.BROADCAST and step.root not in group:
        raise ScheduleError(f"{where}: broadcast root {step.root} is not in the group")
    if step.keeps_messages != (step.tag is not None):
        raise ScheduleError(f"{where}: {step.op} needs a tag exactly when it keeps messages")
    if step.tag is not None and step.tag < COLLECTIVE_TAG_BASE:
        raise ScheduleError(f"{where}: collective tag {step.tag} is in the message-tag range")


def _check_groups(schedule: Schedule) -> None:
    """Every member of a group reaches the same collectives of that group in the same order."""
    calls: dict[tuple[int, ...], dict[int, list[tuple[int, Collective]]]] = defaultdict(dict)
    for r, steps in enumerate(schedule.steps):
        for i, s in enumerate(steps):
            if isinstance(s, Collective):
                calls[s.group].setdefault(r, []).append((i, s))
    for group, by_rank in calls.items():
        first = group[0]
        reference = [_signature(c) for _, c in by_rank.get(first, [])]
        for member in group:
            mine = by_rank.get(member, [])
            for k, (i, call) in enumerate(mine):
                if k >= len(reference) or _signature(call) != reference[k]:
                    raise ScheduleError(
                        f"rank {member} step {i}: collective {k} of group {group} is "
                        f"{call.op} but rank {first} runs "
                        f"{reference[k][0] if k < len(reference) else 'nothing'} there")
            if len(mine) < len(reference):
                raise ScheduleError(
                    f"rank {member} never reaches collective {len(mine)} of group {group} "
                    f"({reference[len(mine)][0]}) that rank {first} runs")


def _signature(call: Collective) -> tuple:
    return (str(call.op), str(call.payload), call.nbytes, call.sharded, call.root)


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
            if isinstance(s, Recv) and s.reduce or isinstance(s, Collective) and s.keeps_messages:
                if s.tag in pending:
                    raise ScheduleError(f"rank {r} step {i}: tag {s.tag} is already pending")
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
    """Run the schedule symbolically: sends never block, a receive waits for its send, and a
    collective waits until every member of its group has arrived at it."""
    world = schedule.world
    pc = [0] * world
    posted: set[tuple[int, int, int]] = set()
    waiting: dict[tuple[int, int, int], int] = {}
    arrived: dict[tuple[tuple[int, ...], int], set[int]] = defaultdict(set)
    done = defaultdict(int)  # (rank, group) -> collectives of that group completed
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
            elif isinstance(s, Collective):
                call = (s.group, done[(r, s.group)])
                arrived[call].add(r)
                if len(arrived[call]) < len(s.group):
                    break  # the last member to arrive releases everyone
                for member in s.group:
                    done[(member, s.group)] += 1
                    pc[member] += 1
                    if member != r:
                        ready.append(member)
                continue
            pc[r] += 1
    for r in range(world):
        if pc[r] < len(schedule.steps[r]):
            s = schedule.steps[r][pc[r]]
            if isinstance(s, Collective):
                raise ScheduleError(f"deadlock: rank {r} step {pc[r]} waits forever in "
                                    f"{s.op} of group {s.group}")
            raise ScheduleError(
                f"deadlock: rank {r} step {pc[r]} waits forever for a message from rank "
                f"{s.src} tag {s.tag}"
            )


def validate(schedule: Schedule) -> None:
    """Raise :class:`ScheduleError` naming the rank and step of the first problem found."""
    if schedule.output_layout not in OUTPUT_LAYOUTS:
        raise ScheduleError(f"unknown output layout {schedule.output_layout!r} "
                            f"(known: {', '.join(OUTPUT_LAYOUTS)})")
    _match_messages(schedule)
    _check_groups(schedule)
    _check_merges(schedule)
    _check_deadlock(schedule)
