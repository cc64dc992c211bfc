"""What a rank's host adds to a simulated step: the interface the engine asks, and the plain
host of a GPU cluster, which adds nothing.

On a GPU cluster the host only posts work, and the engine's step costs are the whole story:
:class:`PlainHost` answers every question with the plain costs. Hosts that do more (CPU ranks
sharing cores, running cold after the attention kernel, reducing in a compiled program: the
CPU test bed's :mod:`treeattn.testbed.host.model`) come as a :class:`HostSpec` on the hardware
model (``HardwareModel.host``), which binds one :class:`HostModel` per simulated run.
"""

from __future__ import annotations

from typing import Protocol

from treeattn.schedule.ir import Collective


class HostModel(Protocol):
    """The questions the engine asks about a rank's host in one run.

    ``crowded[r]``: rank ``r`` shares its core, so its host work goes through
    :meth:`host_work`; ``copy_wait[r][i]``: how long step ``i``'s compute waited for its
    rank's message copies (the critical path counts it as wire time).
    """

    crowded: list[bool]
    copy_wait: list[list[float]]

    def compute_duration(self, r: int, step, duration: float) -> float:
        """A Compute or Merge's time on rank ``r``, given its plain ``duration``."""

    def queues(self, r: int, step) -> bool:
        """Whether rank ``r``'s compute must go through :meth:`compute`."""

    def compute(self, r: int, i: int, step, t: float, duration: float):
        """Run step ``i`` of ``duration`` from ``t`` (a simpy generator); returns its end."""

    def computed(self, r: int, step) -> None:
        """Called after each Compute or Merge of rank ``r``."""

    def send_s(self, r: int, nbytes: int) -> float:
        """The sender's host cost of an ``nbytes`` message."""

    def recv_s(self, r: int, nbytes: int) -> float:
        """The receiver's host cost of an ``nbytes`` message."""

    def collective_s(self, r: int, step: Collective) -> float:
        """What rank ``r`` runs on its host before it joins a collective."""

    def host_work(self, r: int, t: float, seconds: float):
        """Host work of ``seconds`` from ``t`` on a crowded rank (a simpy generator)."""


class HostSpec(Protocol):
    """A host's calibrated costs, as a hardware model carries them (``HardwareModel.host``)."""

    def bind(self, env, links, costs, schedule) -> HostModel:
        """This host's model for one run of ``schedule`` (simpy ``env``, link calendar
        ``links``, the run's :class:`~treeattn.sim.network.CostModel`)."""

    def cheapest_send_s(self, send_s: float) -> float:
        """The least a sender may pay per message, given the plain ``send_s`` (the closed
        forms' lower bounds)."""

    def cheapest_recv_s(self, recv_s: float) -> float:
        """The least a receiver may pay per message, given the plain ``recv_s``."""


class PlainHost:
    """A host that adds nothing: every step costs what the engine's cost model says."""

    def __init__(self, costs, schedule) -> None:
        self.p2p = costs.p2p
        self.crowded = [False] * schedule.world
        self.copy_wait = [[0.0] * len(st) for st in schedule.steps]

    def compute_duration(self, r: int, step, duration: float) -> float:
        return duration

    def queues(self, r: int, step) -> bool:
        return False

    def compute(self, r: int, i: int, step, t: float, duration: float):
        return t + duration
        yield  # a generator, like every host's compute

    def computed(self, r: int, step) -> None:
        return None

    def send_s(self, r: int, nbytes: int) -> float:
        return self.p2p.send_s(nbytes)

    def recv_s(self, r: int, nbytes: int) -> float:
        return self.p2p.recv_s(nbytes)

    def collective_s(self, r: int, step: Collective) -> float:
        return 0.0

    def host_work(self, r: int, t: float, seconds: float):
        return t + seconds
        yield  # a generator, like every host's host_work


def host_spec(hardware) -> HostSpec | None:
    """The host spec of a run's per-rank hardware models: the first one any rank carries
    (it reads each rank's own from ``costs.hardware``), or None where no rank has one."""
    return next((h.host for h in hardware if h.host is not None), None)


def bind_host(env, links, costs, schedule) -> HostModel:
    """The host model of one run: the hardware's spec bound to it, else :class:`PlainHost`."""
    spec = costs.host
    return PlainHost(costs, schedule) if spec is None else spec.bind(env, links, costs, schedule)
