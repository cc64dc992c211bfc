"""The collectives of one group through torch.distributed, as the executor and calibration
call them (:class:`CollectiveOps`).

A transport plugged in for ranks of one host (:func:`treeattn.runtime.transport.plug_in`)
may run some of them its own way: it hands out a subclass that takes the calls it carries
and passes the rest here (the CPU test bed's mailboxes,
:mod:`treeattn.testbed.transport.shm_collectives`). Every member decides from the sizes,
which they agree on, so all take the same path.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from treeattn.runtime.errors import RuntimeFailure
from treeattn.runtime.group import RankContext, held_weakly, wait_work

_DIST_REDUCE = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


class CollectiveOps:
    """The collectives of one group (``members``: the context's ranks, in group order) for
    this rank; they are turned into global ranks where torch needs them.

    ``handle`` is the torch.distributed group (``None``: the default group). Every method
    blocks until this rank's part is done, with the run's timeout, and names ``what`` in its
    errors.
    """

    def __init__(self, ctx: RankContext, members: tuple[int, ...], handle) -> None:
        self.ctx, self.members = ctx, members
        # a subgroup's own handle, held weakly like the context's group (RankContext.group)
        self._handle = None if handle is None else held_weakly(handle)
        self.me = members.index(ctx.rank)
        self.others = [(j, r) for j, r in enumerate(members) if r != ctx.rank]
        # torch.distributed orders a group's ranks by global rank; a schedule's group is in
        # member order, which need not be sorted: process-group rank k is member order[k]
        self.order = sorted(range(len(members)), key=lambda j: members[j])

    @property
    def handle(self):
        """The process group itself: the subgroup's own handle, else the context's group;
        RuntimeFailure once torch has destroyed it."""
        if self._handle is None:
            return self.ctx.group
        group = self._handle()
        if group is None:
            raise RuntimeFailure(f"rank {self.ctx.rank}: the process group of ranks "
                                 f"{list(self.members)} has been destroyed")
        return group

    def all_reduce(self, buf: torch.Tensor, op: str, what: str) -> None:
        """Reduce ``buf`` (sum or max) over the group, in place."""
        self._wait(dist.all_reduce(buf, _DIST_REDUCE[op], group=self.handle, async_op=True),
                   what)

    def broadcast(self, buf: torch.Tensor, root: int, what: str) -> None:
        """Every member's ``buf`` becomes that of ``root`` (a rank of the context)."""
        src = self.ctx.global_rank(root)  # torch addresses the root by its global rank
        self._wait(dist.broadcast(buf, src=src, group=self.handle, async_op=True), what)

    def all_gather(self, pieces: list[torch.Tensor], mine: torch.Tensor, what: str) -> None:
        """``pieces[j]`` becomes member j's ``mine`` (all the same size)."""
        in_group_order = [pieces[j] for j in self.order]  # the same tensors, reordered
        self._wait(dist.all_gather(in_group_order, mine, group=self.handle, async_op=True),
                   what)

    def reduce_scatter(self, own: torch.Tensor, chunks: torch.Tensor, what: str) -> None:
        """``own`` becomes the sum over members of their ``chunks``' piece ``me``;
        ``chunks`` is (p · n,), ``own`` (n,)."""
        split = chunks.view(len(self.members), -1)  # (p, n)
        self._wait(dist.reduce_scatter_tensor(own, split[self.order].reshape(-1),
                                              group=self.handle, async_op=True), what)

    def all_to_all(self, arrived: torch.Tensor, chunks: torch.Tensor, what: str) -> None:
        """Piece j of ``arrived`` becomes member j's piece ``me``; both are (p · n,)."""
        p = len(self.members)
        split, into = chunks.view(p, -1), arrived.view(p, -1)  # (p, n) each
        out = torch.empty_like(split)  # (p, n), rows in process-group order
        self._wait(dist.all_to_all_single(out, split[self.order].contiguous(),
                                          group=self.handle, async_op=True), what)
        into[self.order] = out

    def _wait(self, work, what: str) -> None:
        wait_work(work, self.ctx, None, what)
