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
:class:`MailboxCollectives` too, so the simulator is priced on the path the executor takes.
Messages are tagged per pair, not per group: members must run their common collectives in
the same order, which the simulator's semantics already require.
"""

from __future__ import annotations

import torch

from treeattn.runtime.collective_ops import CollectiveOps
from treeattn.runtime.group import RankContext, wait_work
from treeattn.testbed.transport.shm import COLLECTIVE_TAG, SLOT_BYTES, ShmChannel


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class MailboxCollectives(CollectiveOps):
    """The collectives of one group for this rank, through the host's mailboxes
    (``channel``) where every message fits a slot, else through the process group
    (:class:`~treeattn.runtime.collective_ops.CollectiveOps`)."""

    def __init__(self, ctx: RankContext, members: tuple[int, ...], handle,
                 channel: ShmChannel) -> None:
        super().__init__(ctx, members, handle)
        self.channel = channel

    def through_mailboxes(self, message_bytes: int) -> bool:
        """Whether a collective whose largest message is ``message_bytes`` takes shared
        memory (the same answer on every member)."""
        return message_bytes <= SLOT_BYTES

    # -- the collectives ---------------------------------------------------------------------
    def all_reduce(self, buf: torch.Tensor, op: str, what: str) -> None:
        if not self.through_mailboxes(_nbytes(buf)):
            super().all_reduce(buf, op, what)
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
        if not self.through_mailboxes(_nbytes(buf)):
            super().broadcast(buf, root, what)
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
        if not self.through_mailboxes(_nbytes(mine)):
            super().all_gather(pieces, mine, what)
            return
        sends = [self.channel.isend(mine, r, COLLECTIVE_TAG) for _, r in self.others]
        for j, r in self.others:
            self._recv(pieces[j], r, what)
        pieces[self.me].copy_(mine)
        self._finish(sends, what)

    def reduce_scatter(self, own: torch.Tensor, chunks: torch.Tensor, what: str) -> None:
        if not self.through_mailboxes(_nbytes(own)):
            super().reduce_scatter(own, chunks, what)
            return
        split = chunks.view(len(self.members), -1)  # (p, n)
        sends = [self.channel.isend(split[j], r, COLLECTIVE_TAG) for j, r in self.others]
        pieces = self._receive_from_all(split[self.me], what)
        total = pieces[0].clone()
        for piece in pieces[1:]:
            total += piece
        self._finish(sends, what)
        own.copy_(total)

    def all_to_all(self, arrived: torch.Tensor, chunks: torch.Tensor, what: str) -> None:
        p = len(self.members)
        if not self.through_mailboxes(_nbytes(chunks) // p):
            super().all_to_all(arrived, chunks, what)
            return
        split, into = chunks.view(p, -1), arrived.view(p, -1)  # (p, n) each
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
