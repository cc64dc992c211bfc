"""Point-to-point messages as the executor sends them: shared memory or the process group.

Every ``Send``/``Recv`` of the executor, and the calibration's ping-pong and exchange that
price them, go through :func:`transport_for`, so the simulator is calibrated on the path the
executor really takes:

- a message of at most :data:`treeattn.testbed.transport.shm.SLOT_BYTES` with a small tag,
  between CPU gloo ranks on one host, goes through a shared-memory mailbox
  (:mod:`treeattn.testbed.transport.shm`);
- everything else through ``torch.distributed``: plain ``isend``/``irecv`` on gloo, and
  ``batch_isend_irecv`` on NCCL, which needs its point-to-point calls grouped. Waiting on such
  a message also pushes this rank's deferred mailbox sends (:class:`_Pushing`).

Both ends choose the path from the message's size and tag alone, which they agree on (the
receiver sizes its buffer from the schedule), so a message never waits on the wrong path.
The transport of a process group is made once, collectively, at its first use.
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist

from treeattn.runtime.group import RankContext
from treeattn.testbed.transport.shm import ShmChannel, open_channel


class Transport:
    """``isend``/``irecv`` returning Work objects (``wait(timeout)``, ``is_completed()``)."""

    def __init__(self, ctx: RankContext, channel: ShmChannel | None) -> None:
        self.ctx, self.channel = ctx, channel
        self.batch_p2p = ctx.backend != "gloo"  # NCCL needs batch_isend_irecv (groups)

    @property
    def kind(self) -> str:
        """``"shm+gloo"`` when small messages use shared memory, else the backend's name."""
        return "shm+gloo" if self.channel is not None else self.ctx.backend

    def _shm(self, tensor: torch.Tensor, tag: int) -> bool:
        nbytes = tensor.numel() * tensor.element_size()
        return self.channel is not None and self.channel.carries(nbytes, tag)

    def isend(self, tensor: torch.Tensor, dst: int, tag: int):
        if self._shm(tensor, tag):
            return self.channel.isend(tensor, dst, tag)
        return self._through_group(dist.isend, tensor, dst, tag)

    def irecv(self, buf: torch.Tensor, src: int, tag: int):
        if self._shm(buf, tag):
            return self.channel.irecv(buf, src, tag)
        return self._through_group(dist.irecv, buf, src, tag)

    def _through_group(self, op, tensor: torch.Tensor, peer: int, tag: int):
        """``op`` (``dist.isend`` or ``dist.irecv``) on the process group."""
        peer, group = self.ctx.global_rank(peer), self.ctx.group
        if self.batch_p2p:
            return dist.batch_isend_irecv([dist.P2POp(op, tensor, peer, group=group,
                                                      tag=tag)])[0]
        work = op(tensor, peer, group=group, tag=tag)
        return work if self.channel is None else _Pushing(work, self.channel)

    def progress(self) -> None:
        """Push whatever deferred mailbox sends can go now (never blocks)."""
        if self.channel is not None:
            self.channel.progress()


class _Pushing:
    """A gloo Work whose wait keeps this rank's deferred mailbox sends moving: a peer may
    need one of them before it can send what this rank waits for."""

    def __init__(self, work, channel: ShmChannel) -> None:
        self.work, self.channel = work, channel

    def is_completed(self) -> bool:
        self.channel.progress()
        return self.work.is_completed()

    def wait(self, timeout: timedelta | None = None):
        if self.channel.deferred:  # poll until they are out (or the message is in)
            start = time.perf_counter()
            done = self.channel.spin(
                lambda: not self.channel.deferred or self.work.is_completed(), timeout)
            if not done:
                return False
            if timeout is not None:
                timeout = max(timedelta(0), timeout - timedelta(
                    seconds=time.perf_counter() - start))
        return self.work.wait(timeout) if timeout is not None else self.work.wait()


# keyed by the group's id; the group object is kept with it so that its id is not reused
_TRANSPORTS: dict[tuple[int, int, int], tuple[object, Transport]] = {}


def transport_for(ctx: RankContext) -> Transport:
    """This process group's transport, made on first use: call it on every rank at the same
    point the first time (it is collective then), as executor construction and calibration do."""
    group = ctx.group if ctx.group is not None else dist.group.WORLD
    key = (id(group), ctx.rank, ctx.world)
    if key not in _TRANSPORTS:
        _TRANSPORTS[key] = (group, Transport(ctx, open_channel(ctx)))
    return _TRANSPORTS[key][1]
