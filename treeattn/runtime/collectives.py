"""Run the schedule's ``Collective`` steps with torch.distributed (gloo on CPU, NCCL on GPU).

Semantics are those of :mod:`treeattn.schedule.ir`. This module owns three things:

* **Subgroups, created once.** ``dist.new_group`` is itself a collective over the whole
  world, so every rank creates every group of the schedule, in the same order (the order
  the groups first appear, rank by rank), whether or not it is a member, once per process
  group: later executors reuse them (``hier``'s node and rail groups). A group of all
  ranks is the default group. On a process subgroup the subgroups must already exist
  (:func:`make_subgroups_everywhere`, which every rank of the world calls together). Each
  group's collectives run through :func:`~treeattn.runtime.transport.collective_ops`: the
  process group, or a plugged-in local transport's (the CPU test bed's mailboxes for small
  payloads on one host).
* **Head chunks of any payload.** A collective's chunk ``(i, p)`` is a range of query heads
  of every array in the payload (``o`` and ``lse`` of a partial, the single array of
  ``max`` or ``num``), so :func:`take_heads` and :func:`put_heads` pack and unpack them.
* **Equal-size messages.** ``all_gather`` and ``all_to_all_single`` want equal pieces; when
  the heads do not divide by the group size the pieces are zero-padded to the largest and
  trimmed on arrival. gloo in torch 2.13 has every op used here (``reduce_scatter_tensor``
  included), so the process-group path emulates nothing.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

from treeattn.kernels import merge
from treeattn.runtime.collective_ops import CollectiveOps
from treeattn.runtime.errors import RuntimeFailure
from treeattn.runtime.group import RankContext, held_weakly
from treeattn.runtime.transport import Channel, collective_ops
from treeattn.runtime.wire import AttnDims
from treeattn.schedule.ir import Collective, Schedule
from treeattn.schedule.payloads import PAYLOAD_LAYOUTS, CollectiveOp, MergeOp, Payload, shard_bounds

_REDUCE_OPS = {CollectiveOp.ALL_REDUCE_SUM: "sum", CollectiveOp.ALL_REDUCE_MAX: "max"}


# Subgroups made so far, by their members' global ranks: made once per process group and
# reused by every executor. The default group they belong to is remembered too, so that a
# new process group (after destroy and init) never reuses another's. Both are held weakly:
# torch holds a group until ``dist.destroy_process_group``, and a reference kept past it
# destroys the group only at interpreter exit, where gloo's threads can abort the process
# ("terminate called without an active exception") after a run that succeeded.
class _HeldWeakly:
    """Members' global ranks -> what ``dist.new_group`` returned (a group, or the marker
    torch gives a non-member), each held by :func:`held_weakly`; a dead one reads as absent."""

    def __init__(self) -> None:
        self._held: dict[tuple[int, ...], object] = {}

    def __contains__(self, ranks: tuple[int, ...]) -> bool:
        held = self._held.get(ranks)
        return held is not None and (not isinstance(held, weakref.ref) or held() is not None)

    def __getitem__(self, ranks: tuple[int, ...]):
        return self._held[ranks]()

    def __setitem__(self, ranks: tuple[int, ...], group) -> None:
        self._held[ranks] = held_weakly(group)

    def clear(self) -> None:
        self._held.clear()


_SUBGROUPS = _HeldWeakly()
_SUBGROUPS_OF: list = [None]  # held_weakly(the default group), or None


def _made() -> _HeldWeakly:
    world = dist.group.WORLD
    owner = _SUBGROUPS_OF[0]
    if owner is None or owner() is not world:
        _SUBGROUPS.clear()
        _SUBGROUPS_OF[0] = held_weakly(world)
    return _SUBGROUPS


def schedule_subgroups(ctx: RankContext, schedule: Schedule) -> list[tuple[int, ...]]:
    """The global ranks of every group a schedule's collectives run on, but its whole
    group, in the order they first appear (rank by rank)."""
    everyone = tuple(range(schedule.world))
    seen = dict.fromkeys(step.group for steps in schedule.steps for step in steps
                         if isinstance(step, Collective) and step.group != everyone)
    return [tuple(ctx.global_rank(m) for m in group) for group in seen]


def make_subgroups_everywhere(ctx: RankContext, groups: list[tuple[int, ...]]) -> None:
    """Make the subgroups ``groups`` (global ranks) and those every other rank asks for.

    Collective over the whole world: ``dist.new_group`` is, so when a schedule runs on a
    process subgroup (one context-parallel group of several), every rank of every group
    calls this at the same point (``ShardedAttention`` does, at construction), the ranks
    exchange what they need and all make the union, in one order.
    """
    asked: list = [None] * dist.get_world_size()
    try:
        dist.all_gather_object(asked, sorted(set(groups)))
    except Exception as exc:
        raise RuntimeFailure(f"rank {ctx.rank}: cannot agree on the subgroups to make "
                             f"({str(exc).splitlines()[0][:200]})") from exc
    made = _made()
    for group in sorted({tuple(g) for mine in asked for g in mine}):
        if group not in made:
            made[group] = dist.new_group(list(group), timeout=ctx.timeout)


class Groups:
    """The groups a schedule's collectives run on, made once per process group (see
    :func:`make_subgroups_everywhere`); indexing with a group's ranks gives this rank's
    :class:`CollectiveOps` for it (members only)."""

    def __init__(self, ctx: RankContext, schedule: Schedule,
                 channel: Channel | None = None) -> None:
        self.ctx = ctx
        self.ops: dict[tuple[int, ...], CollectiveOps | None] = {}
        everyone = tuple(range(schedule.world))
        for steps in schedule.steps:
            for step in steps:
                if isinstance(step, Collective) and step.group not in self.ops:
                    handle = None if step.group == everyone else self._subgroup(schedule, step)
                    self.ops[step.group] = (collective_ops(ctx, step.group, handle, channel)
                                            if ctx.rank in step.group else None)

    def _subgroup(self, schedule: Schedule, step: Collective):
        ranks = tuple(self.ctx.global_rank(m) for m in step.group)
        made = _made()
        if ranks not in made:
            if self.ctx.group is not None:
                # new_group is collective over the whole world, which the other
                # context-parallel groups are not running in step with here
                raise RuntimeFailure(
                    f"{schedule.algorithm}: its collective over ranks {list(step.group)} "
                    "needs a subgroup of the process subgroup it runs on, made beforehand "
                    "by every rank of the world (ShardedAttention does so at construction); "
                    "run it on the default group, or pick another algorithm")
            made[ranks] = dist.new_group(list(ranks), timeout=self.ctx.timeout)
        return made[ranks]

    def __getitem__(self, group: tuple[int, ...]) -> CollectiveOps:
        return self.ops[group]


def head_arrays(flat: torch.Tensor, payload: str, dims: AttnDims) -> list[torch.Tensor]:
    """Views of a payload's flat buffer as its arrays, each (B, Hq, ...)."""
    b, hq, d = dims.batch, dims.n_heads, dims.head_dim
    out, at = [], 0
    for shape in PAYLOAD_LAYOUTS[Payload(payload)].arrays:
        tail = (d,) if shape[-1] == "D" else ()
        size = b * hq * (d if tail else 1)
        out.append(flat[at:at + size].view(b, hq, *tail))
        at += size
    return out


def take_heads(flat: torch.Tensor, payload: str, dims: AttnDims, index: int,
               count: int) -> torch.Tensor:
    """Heads chunk ``(index, count)`` of every array of the payload, packed flat."""
    h0, h1 = shard_bounds(dims.n_heads, count)[index]
    return torch.cat([a[:, h0:h1].reshape(-1) for a in head_arrays(flat, payload, dims)])


def put_heads(flat: torch.Tensor, payload: str, dims: AttnDims, index: int, count: int,
              part: torch.Tensor) -> torch.Tensor:
    """A copy of ``flat`` whose heads chunk ``(index, count)`` is replaced by ``part``."""
    out = flat.clone()
    h0, h1 = shard_bounds(dims.n_heads, count)[index]
    at = 0
    for array in head_arrays(out, payload, dims):
        piece = array[:, h0:h1]
        array[:, h0:h1] = part[at:at + piece.numel()].view_as(piece)
        at += piece.numel()
    return out


def _padded(piece: torch.Tensor, numel: int) -> torch.Tensor:
    out = torch.zeros(numel, dtype=piece.dtype, device=piece.device)
    out[:piece.numel()] = piece
    return out


def run_collective(ctx: RankContext, groups: Groups, step: Collective, flat: torch.Tensor,
                   dims: AttnDims):
    """Run ``step`` on this rank's payload buffer ``flat``.

    Returns ``("replace", new_flat)`` or ``("keep", kept)`` where ``kept`` is what a later
    ``Merge(tag)`` folds in: ``("all", i, [the other members' buffers])`` or ``("heads", i, p,
    [chunks])``, ``i`` this rank's place in the group.
    """
    group, ops, p = step.group, groups[step.group], len(step.group)
    me = group.index(ctx.rank)
    what = f"{step.op} of {step.payload!r} over ranks {list(group)}"
    if step.op in _REDUCE_OPS:
        out = flat.clone()
        ops.all_reduce(out, _REDUCE_OPS[step.op], what)
        return "replace", out
    if step.op == CollectiveOp.BROADCAST:
        out = flat.clone()
        ops.broadcast(out, step.root, what)
        return "replace", out
    sizes = [take_heads(flat, step.payload, dims, j, p).numel() for j in range(p)]
    if step.op == CollectiveOp.ALL_GATHER:
        if not step.sharded:
            pieces = [torch.empty_like(flat) for _ in range(p)]
            ops.all_gather(pieces, flat, what)
            return "keep", ("all", me, [pieces[j] for j in range(p) if j != me])
        mine = _padded(take_heads(flat, step.payload, dims, me, p), max(sizes))
        pieces = [torch.empty_like(mine) for _ in range(p)]
        ops.all_gather(pieces, mine, what)
        out = flat
        for j in range(p):
            out = put_heads(out, step.payload, dims, j, p, pieces[j][:sizes[j]])
        return "replace", out
    chunks = torch.cat([_padded(take_heads(flat, step.payload, dims, j, p), max(sizes))
                        for j in range(p)])  # (p * largest,)
    if step.op == CollectiveOp.REDUCE_SCATTER:
        own = torch.empty(max(sizes), dtype=flat.dtype, device=flat.device)
        ops.reduce_scatter(own, chunks, what)
        return "replace", put_heads(flat, step.payload, dims, me, p, own[:sizes[me]])
    if step.op == CollectiveOp.ALL_TO_ALL:
        arrived = torch.empty_like(chunks)
        ops.all_to_all(arrived, chunks, what)
        pieces = arrived.view(p, max(sizes))[:, :sizes[me]]
        return "keep", ("heads", me, p, [pieces[j] for j in range(p) if j != me])
    raise RuntimeFailure(f"unknown collective {step.op!r}")


def fold_kept(flat: torch.Tensor, payload: str, op: str, kept, dims: AttnDims) -> torch.Tensor:
    """``Merge(op, tag)`` of what a collective kept: fold every piece into ``flat`` (a copy).

    A gather's pieces are folded in group order, ``flat`` in this rank's place, from the first
    member on: every member runs the same operations in the same order, so the replicas are
    bit-identical (whatever the wire format), as the numpy reference's are."""
    if kept[0] == "all":
        _, index, others = kept
        ordered = [*others[:index], flat, *others[index:]]
        out = ordered[0]
        for piece in ordered[1:]:
            out = _combine(out, piece, payload, op, dims, dims.n_heads)
        return out
    _, index, count, pieces = kept
    h0, h1 = shard_bounds(dims.n_heads, count)[index]
    mine = take_heads(flat, payload, dims, index, count)
    for piece in pieces:
        mine = _combine(mine, piece, payload, op, dims, h1 - h0)
    return put_heads(flat, payload, dims, index, count, mine)


def _combine(a: torch.Tensor, b: torch.Tensor, payload: str, op: str, dims: AttnDims,
             heads: int) -> torch.Tensor:
    """Fold ``b`` into ``a``; both hold ``heads`` query heads of the payload, packed flat."""
    if op == MergeOp.PARTIAL:
        narrow = AttnDims(dims.batch, heads, dims.n_kv_heads, dims.head_dim)
        left = head_arrays(a, Payload.PARTIAL, narrow)
        right = head_arrays(b, Payload.PARTIAL, narrow)
        o, lse = merge((left[0], left[1]), (right[0], right[1]))
        return torch.cat([o.reshape(-1), lse.reshape(-1)])
    if op == MergeOp.MAX:
        return torch.maximum(a, b)
    if op == MergeOp.LSE:
        return torch.logaddexp(a, b)
    if op == MergeOp.SUM:
        return a + b
    raise RuntimeFailure(f"merge op {op!r} cannot fold collective results")
