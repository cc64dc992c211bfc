"""Point-to-point messages as the executor sends them: the process group, or a transport
plugged in for ranks of one host.

Every ``Send``/``Recv`` of the executor, and the calibration's ping-pong and exchange that
price them, go through :func:`transport_for`, so the simulator is calibrated on the path the
executor really takes:

- by default everything goes through ``torch.distributed``: plain ``isend``/``irecv`` on
  gloo, and ``batch_isend_irecv`` on NCCL, which needs its point-to-point calls grouped;
- a :class:`LocalPlugin` (:func:`plug_in`; the CPU test bed's shared-memory mailboxes,
  :mod:`treeattn.testbed.transport.plugin`) may open a :class:`Channel` between the ranks of
  one host, which carries the messages it says it carries (small ones, small tags); waiting
  on a process-group message then also pushes this rank's deferred channel sends
  (:class:`_Pushing`). The same plug-in may run a group's small collectives
  (:func:`collective_ops`) and a rank's whole reduction as one call (:func:`compile_program`).

Both ends choose the path from the message's size and tag alone, which they agree on (the
receiver sizes its buffer from the schedule), so a message never waits on the wrong path.
The transport of a process group is made once, collectively, at its first use.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist

from treeattn.runtime.collective_ops import CollectiveOps
from treeattn.runtime.group import RankContext, held_weakly


class Channel(Protocol):
    """Messages between ranks of one host, beside the process group (a plug-in's)."""

    deferred: object  # sends waiting for room; falsy when none

    def carries(self, nbytes: int, tag: int) -> bool:
        """Whether a message of ``nbytes`` with ``tag`` takes this channel (both ends agree)."""

    def isend(self, tensor: torch.Tensor, dst: int, tag: int): ...

    def irecv(self, buf: torch.Tensor, src: int, tag: int): ...

    def progress(self) -> None:
        """Push whatever deferred sends can go now (never blocks)."""

    def spin(self, done, timeout: timedelta | None) -> bool:
        """Wait until ``done()``, pushing deferred sends; False on timeout."""


class LocalPlugin(Protocol):
    """A transport for ranks of one host, plugged in beside the process group (:func:`plug_in`).

    Picklable: the local launcher hands it to every rank it spawns."""

    def check_launch(self, world: int, threads: int | None, bind: str) -> None:
        """Refuse launch options it cannot honour (in the launcher, before any rank starts)."""

    def launcher_cpus(self) -> list[int]:
        """The CPUs the launcher may give its ranks."""

    def start_rank(self, local_rank: int, world: int, threads: int | None, bind: str,
                   cpus: list[int]) -> None:
        """In a spawned rank, before it joins the group (core pinning, for one)."""

    def open_channel(self, ctx: RankContext) -> Channel | None:
        """The channel among this group's ranks, or None everywhere (collective)."""

    def collective_ops(self, ctx: RankContext, members: tuple[int, ...], handle,
                       channel: Channel) -> CollectiveOps:
        """A group's collectives for this rank where the group has ``channel``."""

    def compile_program(self, steps, names: list[str], rank: int, channel: Channel, dims):
        """A rank's whole reduction as one call over ``channel``, or None."""

    def calibrate(self, ctx: RankContext, dims, max_bytes: int) -> dict:
        """Every rank: measure this host's ranks (``run --check`` without a profile); rank
        0 returns the profile."""


_plugin: LocalPlugin | None = None


def plug_in(plugin: LocalPlugin | None) -> None:
    """Use ``plugin`` for the ranks of one host from now on in this process (None: the
    process group alone). The local launcher passes it on to the ranks it spawns."""
    global _plugin
    _plugin = plugin


def plugged_in() -> LocalPlugin | None:
    """The transport plugged in for ranks of one host, if any."""
    return _plugin


def collective_ops(ctx: RankContext, members: tuple[int, ...], handle,
                   channel: Channel | None) -> CollectiveOps:
    """This rank's collectives of a group: the plug-in's where there is a channel, else the
    process group's."""
    plugin = plugged_in()
    if channel is None or plugin is None:
        return CollectiveOps(ctx, members, handle)
    return plugin.collective_ops(ctx, members, handle, channel)


def compile_program(steps, names: list[str], rank: int, channel: Channel | None, dims):
    """The plug-in's compiled reduction of ``steps`` over ``channel``, or None."""
    plugin = plugged_in()
    if channel is None or plugin is None:
        return None
    return plugin.compile_program(steps, names, rank, channel, dims)


class Transport:
    """``isend``/``irecv`` returning Work objects (``wait(timeout)``, ``is_completed()``)."""

    def __init__(self, ctx: RankContext, channel: Channel | None) -> None:
        self.ctx, self.channel = ctx, channel
        self.batch_p2p = ctx.backend != "gloo"  # NCCL needs batch_isend_irecv (groups)

    @property
    def kind(self) -> str:
        """``"shm+gloo"`` when small messages take a plugged-in channel, else the backend's
        name."""
        return "shm+gloo" if self.channel is not None else self.ctx.backend

    def _on_channel(self, tensor: torch.Tensor, tag: int) -> bool:
        nbytes = tensor.numel() * tensor.element_size()
        return self.channel is not None and self.channel.carries(nbytes, tag)

    def isend(self, tensor: torch.Tensor, dst: int, tag: int):
        if self._on_channel(tensor, tag):
            return self.channel.isend(tensor, dst, tag)
        return self._through_group(dist.isend, tensor, dst, tag)

    def irecv(self, buf: torch.Tensor, src: int, tag: int):
        if self._on_channel(buf, tag):
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

    def __init__(self, work, channel: Channel) -> None:
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


# keyed by the group's id, with a weak reference to the group: a dead reference means the
# id belongs to a newer group. Nothing here holds a group strongly (a Transport's context
# holds its subgroup weakly, :class:`RankContext`): a group torch has destroyed but a module
# still holds is destroyed only at interpreter exit, where gloo's threads can abort the
# process. An entry is dropped when its group dies.
_TRANSPORTS: dict[tuple[int, int, int], tuple[Callable, Transport]] = {}


def transport_for(ctx: RankContext) -> Transport:
    """This process group's transport, made on first use: call it on every rank at the same
    point the first time (it is collective then), as executor construction and calibration do."""
    group = ctx.group if ctx.group is not None else dist.group.WORLD
    key = (id(group), ctx.rank, ctx.world)
    found = _TRANSPORTS.get(key)
    if found is None or found[0]() is not group:
        plugin = plugged_in()
        channel = plugin.open_channel(ctx) if plugin is not None else None
        found = _TRANSPORTS[key] = (held_weakly(group), Transport(ctx, channel))
        try:
            weakref.finalize(group, _drop_dead, key)
        except TypeError:  # not weakly referenceable: a non-member's marker, never freed
            pass
    return found[1]


def _drop_dead(key: tuple[int, int, int]) -> None:
    """Forget the transport of a group that has died (unless a newer group took its id)."""
    found = _TRANSPORTS.get(key)
    if found is not None and found[0]() is None:
        del _TRANSPORTS[key]
