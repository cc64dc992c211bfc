"""The collectives of a schedule and of calibration: through shared memory when every message
fits a mailbox, otherwise through torch.distributed.

Why: on CPU ranks of one host, gloo runs a collective of a few KiB as socket writes, which
wake gloo's I/O thread in every member. Measured at 4 ranks on 2 cores, with the members
arriving at different moments, an all-gather of 4 KiB partials took 4.5 ms after the
last member arrived, against the 3 ms calibrated with every member arriving together.
Meanwhile the point-to-point schedules' messages took the mailboxes
(:mod:`treeattn.testbed.transport.shm`), at about 10 µs each. Comparing tree against one-shot or DCP
with gloo's collectives on one side and mailboxes on the other would compare transports, not
algorithms. The baselines get the same transport.

What runs: each collective is one round of direct messages. Every member sends each other
member the piece that member needs, through that pair's collective mailbox
(:data:`treeattn.testbed.transport.shm.COLLECTIVE_TAG`), and combines what arrives itself:

* all-gather: my piece to everyone; p − 1 messages of n/p bytes each way;
* all-to-all: piece j to member j;
* reduce-scatter: chunk j to member j, who sums the p chunks of its index in member order;
* all-reduce (sum, max): my whole buffer to everyone; each member reduces all p buffers in
  member order, so every member ends with the same bits;
* broadcast: the root sends its buffer to everyone.

This is the one-shot algorithm that GPU custom all-reduce uses for small messages on fully
connected devices: one message latency, p − 1 times the bytes of a ring. It suits decode's
KiB payloads, not large ones, so a collective takes this path only when each of its messages
fits a slot (:data:`treeattn.testbed.transport.shm.SLOT_BYTES`). Every member decides from the
sizes, which they agree on, so all take the same path. Calibration measures the collectives through
:class:`CollectiveOps` too, so the simulator is priced on the path the executor takes.
Messages are tagged per pair, not per group: members must run their common collectives in
the same order, which the simulator's semantics already require.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from treeattn.runtime.group import RankContext, wait_work
from treeattn.testbed.transport.shm import COLLECTIVE_TAG, SLOT_BYTES, ShmChannel

_DIST_REDUCE = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class CollectiveOps:
    """The collectives of one group (``members``: global ranks, in group order) for this rank.

    ``handle`` is the torch.distributed group (``None``: the default group); ``channel`` the
    host's mailboxes, or ``None`` where there are none (then every call takes the group).
    Every method blocks until this rank's part is done, with the run's timeout, and names
    ``what`` in its errors.
    """

    def __init__(self, ctx: RankContext, members: tuple[int, ...], handle,
                 channel: ShmChannel | None) -> None:
        self.ctx, self.members, self.channel = ctx, members, channel
        # the process group itself: a subgroup's own handle, else the context's group
        self.handle = handle if handle is not None else ctx.group
        self.global_ranks = handle is None  # members are the context's ranks, not global
        self.me = members.index(ctx.rank)
        self.others = [(j, r) for j, r in enumerate(members) if r != ctx.rank]
        # torch.distributed orders a group's ranks by global rank; a schedule's group is in
        # member order, which need not be sorted: process-group rank k is member order[k]
        self.order = sorted(range(len(members)), key=lambda j: members[j])

    def through_mailboxes(self, message_bytes: int) -> bool:
        """Whether a collective whose largest message is ``message_bytes`` takes shared
        memory (the same answer on every member)."""
        return self.channel is not None and message_bytes <= SLOT_BYTES

    # -- the collectives ---------------------------------------------------------------------
    def all_reduce(self, buf: torch.Tensor, op: str, what: str) -> None:
        """Reduce ``buf`` (sum or max) over the group, in place."""
        if not self.through_mailboxes(_nbytes(buf)):
            self._wait(dist.all_reduce(buf, _DIST_REDUCE[op], group=self.handle, async_op=True),
                       what)
            return
        mine = buf.reshape(-1).clone()  # (n,) snapshot: the sends read it while buf changes
        sends = [self.channel.isend(mine, r, COLLECTIVE_TAG) for _, r in self.others]
        pieces = self._receive_from_all(mine, what)
        total = pieces[0].clone()
        for piece in pieces[1:]:  # member order on every member: the same bits everywhere
            if op == "sum":
                total += piece
            else:
                torch.maximum(total, piece, out=total)
        self._finish(sends, what)
        buf.copy_(total.view_as(buf))

    def broadcast(self, buf: torch.Tensor, root: int, what: str) -> None:
        """Every member's ``buf`` becomes global rank ``root``'s."""
        if not self.through_mailboxes(_nbytes(buf)):
            src = self.ctx.global_rank(root) if self.global_ranks else root
            self._wait(dist.broadcast(buf, src=src, group=self.handle, async_op=True), what)
            return
        if self.ctx.rank == root:
            flat = buf.reshape(-1)
            self._finish([self.channel.isend(flat, r, COLLECTIVE_TAG) for _, r in self.others],
                         what)
            return
        arrived = torch.empty(buf.numel(), dtype=buf.dtype)  # (n,) contiguous
        self._recv(arrived, root, what)
        buf.copy_(arrived.view_as(buf))

    def all_gather(self, pieces: list[torch.Tensor], mine: torch.Tensor, what: str) -> None:
        """``pieces[j]`` becomes member j's ``mine`` (all the same size)."""
        if not self.through_mailboxes(_nbytes(mine)):
            in_group_order = [pieces[j] for j in self.order]  # the same tensors, reordered
            self._wait(dist.all_gather(in_group_order, mine, group=self.handle,
                                       async_op=True), what)
            return
        sends = [self.channel.isend(mine, r, COLLECTIVE_TAG) for _, r in self.others]
        for j, r in self.others:
            self._recv(pieces[j], r, what)
        pieces[self.me].copy_(mine)
        self._finish(sends, what)

    def reduce_scatter(self, own: torch.Tensor, chunks: torch.Tensor, what: str) -> None:
        """``own`` becomes the sum over members of their ``chunks``' piece ``me``;
        ``chunks`` is (p · n,), ``own`` (n,)."""
        split = chunks.view(len(self.members), -1)  # (p, n)
        if not self.through_mailboxes(_nbytes(own)):
            self._wait(dist.reduce_scatter_tensor(own, split[self.order].reshape(-1),
                                                  group=self.handle, async_op=True), what)
            return
        sends = [self.channel.isend(split[j], r, COLLECTIVE_TAG) for j, r in self.others]
        pieces = self._receive_from_all(split[self.me], what)
        total = pieces[0].clone()
        for piece in pieces[1:]:
            total += piece
        self._finish(sends, what)
        own.copy_(total)

    def all_to_all(self, arrived: torch.Tensor, chunks: torch.Tensor, what: str) -> None:
        """Piece j of ``arrived`` becomes member j's piece ``me``; both are (p · n,)."""
        p = len(self.members)
        split, into = chunks.view(p, -1), arrived.view(p, -1)  # (p, n) each
        if not self.through_mailboxes(_nbytes(chunks) // p):
            out = torch.empty_like(split)  # (p, n), rows in process-group order
            self._wait(dist.all_to_all_single(out, split[self.order].contiguous(),
                                              group=self.handle, async_op=True), what)
            into[self.order] = out
            return
        sends = [self.channel.isend(split[j], r, COLLECTIVE_TAG) for j, r in self.others]
        for j, r in self.others:
            self._recv(into[j], r, what)
        into[self.me].copy_(split[self.me])
        self._finish(sends, what)

    # -- waiting -----------------------------------------------------------------------------
    def _receive_from_all(self, mine: torch.Tensor, what: str) -> list[torch.Tensor]:
        """Every member's piece in member order, ``mine`` at my own index."""
        pieces = [mine] * len(self.members)
        for j, r in self.others:
            pieces[j] = torch.empty_like(mine)
            self._recv(pieces[j], r, what)
        return pieces

    def _recv(self, into: torch.Tensor, src: int, what: str) -> None:
        wait_work(self.channel.irecv(into, src, COLLECTIVE_TAG), self.ctx, src, what)

    def _finish(self, sends: list, what: str) -> None:
        """Wait until every send has left for its mailbox (a full one empties once its
        receiver reads the previous message), so the caller may reuse what was sent."""
        for work, (_, r) in zip(sends, self.others):
            wait_work(work, self.ctx, r, what)

    def _wait(self, work, what: str) -> None:
        wait_work(work, self.ctx, None, what)
