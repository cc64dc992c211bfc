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
  not a power of two; see :mod:`treeattn.sim.alg_butterfly`). Unset until a Merge sets it.

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

from dataclasses import dataclass, field

PAYLOADS = ("partial", "kv", "max", "num", "den", "residue")
COMPUTE_LABELS = ("attention", "attention_block", "rescale", "finalize", "init_max")
MERGE_OPS = ("partial", "max", "sum", "residue")


@dataclass(frozen=True)
class Compute:
    """Local work on the device, costed by the hardware model (bytes or FLOPs bound)."""

    label: str
    nbytes: int = 0
    flops: int = 0


@dataclass(frozen=True)
class Send:
    """Post a non-blocking send of ``payload`` (or one chunk of it) to rank ``dst``."""

    dst: int
    nbytes: int
    tag: int
    payload: str = "partial"
    chunk: tuple[int, int] | None = None


@dataclass(frozen=True)
class Recv:
    """Wait for the message from ``src`` with ``tag``; replace or keep it for a Merge."""

    src: int
    nbytes: int
    tag: int
    payload: str = "partial"
    chunk: tuple[int, int] | None = None
    reduce: bool = True


@dataclass(frozen=True)
class Merge:
    """Fold the message received under ``tag`` (or the ring block partial) into a buffer."""

    nbytes: int
    op: str = "partial"
    tag: int | None = None


Step = Compute | Send | Recv | Merge


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

        Raises :class:`treeattn.sim.errors.ScheduleError` naming the rank and step.
        """
        from treeattn.sim.validate import validate

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
