"""What a rank's host CPU adds to a simulated step: the test bed's host model.

On a GPU cluster the host only posts work, and the engine's step costs are the whole story
(:class:`treeattn.sim.host_model.PlainHost`). On CPU ranks (the project's test bed, and
anyone who runs ranks on one machine) the same cores that run the attention also run every
merge, message copy and collective, and calibration shows four effects that a GPU never has.
They all live here, so the engine reads as the cluster engine and asks this model only "how
long" and "when". A calibrated CPU's hardware model carries a :class:`CpuHost`
(``HardwareModel.host``), whose fields turn them on:

* **Shared cores.** When the host has ``cores`` (a calibrated CPU), all ranks of a host
  share a ``simpy.Resource`` with that many servers, so ranks beyond the core count queue for
  compute. When the launcher pinned the ranks (``CpuHost.pinned``), the host's k-th
  rank has core ``k mod cores`` to itself and queues only behind the ranks pinned to the same
  core; a rank that shares its core also waits for it to post a message.
* **Compute and copies take turns.** On a host whose cores copy every byte of a message
  (``CpuHost.copies_messages``: gloo's sockets), a rank's attention and the copies of
  its own messages take turns: when it starts, a Compute books the rank's own links (its one
  link out and one link in, which only its own messages use: the ``local`` star) for its
  duration, at the first time both are free of message chunks, and chunks booked later fit
  around it. Measured on a 2-core box, a ring step took the exchange's time plus the
  attention, not the larger of the two: both stream memory through the same cores. Merges
  (microseconds) do not take turns, and on a topology where links are not a rank's own
  nothing does. The critical path counts the wait as wire time.
* **Cold steps.** With a calibrated ``CpuHost.cold``, the first merge, send, receive and
  collective after a rank's attention kernel also pay what running cold costs
  (:mod:`treeattn.testbed.host.cold`).
* **The compiled reduction.** A rank whose steps the runtime runs as one C program (a plain
  reduction of partials with a calibrated ``CpuHost.program``,
  :mod:`treeattn.testbed.host.partial_reduction`) pays the program's message costs instead, and
  no cold extras (in a group that gets the mailboxes: one host, at most
  ``program.max_world`` ranks).

With none of them set, every method reduces to the plain costs.
"""

from __future__ import annotations

from dataclasses import dataclass

import simpy

from treeattn.schedule.ir import Collective, Compute
from treeattn.schedule.payloads import CollectiveOp, SimError
from treeattn.testbed.host.cold import KINDS, ColdSteps
from treeattn.testbed.host.partial_reduction import ProgramCosts


@dataclass(frozen=True)
class CpuHost:
    """A calibrated CPU host's costs beyond the device model (a :class:`~treeattn.sim.
    host_model.HostSpec`): what :class:`HostModel` reads per rank."""

    cores: int | None = None  # compute servers shared by the host's ranks; None: one each
    pinned: bool = False  # ranks bound round-robin to the ``cores`` (the local launcher's way)
    cold: ColdSteps | None = None  # host steps right after the kernel (testbed.host.cold)
    # The host's cores copy every byte of a message (gloo's sockets), so a rank's attention
    # and the copies of its own messages take turns
    copies_messages: bool = False
    # ranks of one host that run as the C program: its message costs (partial_reduction)
    program: ProgramCosts | None = None

    def __post_init__(self) -> None:
        if self.cores is not None and self.cores < 1:
            raise SimError("host: cores must be at least 1")

    def bind(self, env: simpy.Environment, links, costs, schedule) -> HostModel:
        return HostModel(env, links, costs, schedule, self.program)

    def cheapest_send_s(self, send_s: float) -> float:
        return min(send_s, self.program.send_s) if self.program else send_s

    def cheapest_recv_s(self, recv_s: float) -> float:
        return min(recv_s, self.program.recv_s) if self.program else recv_s


PLAIN_CPU = CpuHost()  # a rank without a host spec of its own, beside ranks that have one


class HostModel:
    """The host side of one simulated run: core pools, turns, cold state, programs."""

    def __init__(self, env: simpy.Environment, links, costs, schedule,
                 program: ProgramCosts | None) -> None:
        self.env, self.links, self.c = env, links, costs
        self.hosts = [h.host if isinstance(h.host, CpuHost) else PLAIN_CPU
                      for h in costs.hardware]
        world = schedule.world
        self.cores = self._core_pools(world)
        # ranks whose attention takes turns with their messages' copies: the links they book
        self.copy_edges = self._copy_edges(world)
        self.copy_wait = [[0.0] * len(st) for st in schedule.steps]  # for the critical path
        # per rank: the calibrated cold-step costs and the kinds still cold
        self.cold_costs = [h.cold for h in self.hosts]
        self.cold: list[set] = [set() for _ in range(world)]
        # ranks whose steps run as one C program: its message costs, and nothing runs cold
        self.program = program
        one_host = len({costs.topology.machine_of(r) for r in range(world)}) == 1
        grouped = program is not None and program.runs(world, one_host)
        self.programmed = [grouped and program.takes(steps) for steps in schedule.steps]
        # ranks whose core pool has fewer servers than ranks: their host work queues too
        sharing: dict[int, int] = {}
        for pool in self.cores:
            if pool is not None:
                sharing[id(pool)] = sharing.get(id(pool), 0) + 1
        self.crowded = [pool is not None and sharing[id(pool)] > pool.capacity
                        for pool in self.cores]

    # -- what the engine asks -------------------------------------------------------------

    def compute_duration(self, r: int, step, duration: float) -> float:
        """A Compute or Merge's time on rank ``r``: ``duration``, plus the cold extra of a
        merge-like step that runs right after the attention kernel."""
        if not self.streams(r, step) and not self.programmed[r]:
            duration += self._cold_extra(r, "merge")
        return duration

    def queues(self, r: int, step) -> bool:
        """Whether rank ``r``'s compute must go through :meth:`compute` (a shared core, or
        turns with its copies) rather than simply adding its duration."""
        return self.cores[r] is not None or self._turns(r, step)

    def compute(self, r: int, i: int, step, t: float, duration: float):
        """Run step ``i`` (a Compute or Merge) of ``duration`` from ``t``; returns its end."""
        turns = self._turns(r, step)
        if self.cores[r] is not None:
            return (yield from self._shared_compute(r, t, duration, (i if turns else None)))
        # booked at its own start, in simulated-time order with messages
        if t > self.env.now:
            yield self.env.timeout(t - self.env.now)
        return self._compute_end(r, i, duration)

    def computed(self, r: int, step) -> None:
        """After rank ``r``'s step: an attention that streamed the shard leaves it cold."""
        if self.streams(r, step):
            self.cold[r].update(KINDS)

    def send_s(self, r: int, nbytes: int) -> float:
        """The sender's host cost of an ``nbytes`` message (its protocol's: sim/nccl/p2p.py)."""
        c = self.c
        if self.programmed[r]:
            return self.program.send_s
        return c.p2p.send_s(nbytes) + self._cold_extra(r, "send")

    def recv_s(self, r: int, nbytes: int) -> float:
        """The receiver's host cost of an ``nbytes`` message."""
        c = self.c
        if self.programmed[r]:
            return self.program.recv_s
        return c.p2p.recv_s(nbytes) + self._cold_extra(r, "recv")

    def collective_s(self, r: int, step: Collective) -> float:
        """What a cold member runs on its core before it joins a collective."""
        return self._cold_extra(r, "collective", step)

    def host_work(self, r: int, t: float, seconds: float):
        """Host work of ``seconds`` from ``t`` on a rank that shares its core (only called
        for :attr:`crowded` ranks): it waits for the core (a rank pinned beside another
        cannot post a message while the other computes)."""
        if seconds <= 0:
            return t
        return (yield from self._shared_compute(r, t, seconds))

    # -- the models -----------------------------------------------------------------------

    def streams(self, r: int, step) -> bool:
        costs = self.cold_costs[r]
        return (costs is not None and isinstance(step, Compute)
                and costs.makes_cold(step.label, step.nbytes))

    def _turns(self, r: int, step) -> bool:
        return isinstance(step, Compute) and bool(self.copy_edges[r])

    def _core_pools(self, world: int) -> list:
        """Each rank's compute servers: the host's pool, or its own core when pinned."""
        hw = self.hosts
        if all(h.cores is None for h in hw):
            return [None] * world
        pools: dict = {}
        out = []
        for r in range(world):
            host = self.c.topology.machine_of(r)  # ranks of one machine share its cores
            if hw[r].pinned:  # the launcher binds the host's k-th rank to core k mod cores
                if host not in pools:
                    pools[host] = ([simpy.Resource(self.env, capacity=1)
                                    for _ in range(hw[r].cores or 1)], [0])
                cores, placed = pools[host]
                out.append(cores[placed[0] % len(cores)])
                placed[0] += 1
            else:
                if host not in pools:
                    pools[host] = simpy.Resource(self.env, capacity=hw[r].cores or 1)
                out.append(pools[host])
        return out

    def _copy_edges(self, world: int) -> list[tuple]:
        """Per rank, the links its compute books where the host copies messages: its one link
        out and its one link in, when every copying rank has exactly one of each and shares
        neither with another rank (the ``local`` star: rank to host and back). Elsewhere (a
        direct rank-to-rank link, a mesh) a link is no rank's own, so nothing is booked and
        compute overlaps the copies as on hardware that does not copy."""
        net = self.c.net
        copying = [r for r, h in enumerate(self.hosts) if h.copies_messages]
        if world < 2 or not copying:
            return [()] * world
        edges = {}
        for r in copying:
            peer = (r + 1) % world
            out, into = net.hops(r, peer)[0][0], net.hops(peer, r)[-1][0]
            for other in range(world):  # stops at the first peer reached another way
                if other != r and (net.hops(r, other)[0][0] != out
                                   or net.hops(other, r)[-1][0] != into):
                    return [()] * world
            edges[r] = (out, into)
        taken = [e for pair in edges.values() for e in pair]
        if len(set(taken)) != len(taken):
            return [()] * world
        return [edges.get(r, ()) for r in range(world)]

    def _compute_end(self, r: int, i: int, duration: float) -> float:
        """When rank ``r``'s attention of ``duration``, starting now, ends: at once, or, where
        the host copies messages, at the first time after the copies already booked on its
        links (the wait is kept for the critical path)."""
        now, edges = self.env.now, self.copy_edges[r]
        if not edges or duration <= 0:
            return now + duration
        begin = self.links.reserve_together(edges, now, duration, now)
        self.copy_wait[r][i] = begin - now
        return begin + duration

    def _cold_extra(self, r: int, kind: str, step: Collective | None = None) -> float:
        """What rank ``r``'s next step of ``kind`` pays for running cold (0 once warm)."""
        if kind not in self.cold[r]:
            return 0.0
        self.cold[r].discard(kind)
        costs = self.cold_costs[r]
        if kind == "merge":
            return costs.merge_s
        if kind == "collective":
            warm = self.c.collective_time(step.op, step.group, step.nbytes)
            op = CollectiveOp(step.op).library_op  # a plan file's op is a plain string
            return costs.collective_extra(op, len(step.group), warm)
        return costs.send_s if kind == "send" else costs.recv_s

    def _shared_compute(self, r: int, t: float, duration: float, turns: int | None = None):
        """Host work on a shared core from ``t``: wait for the core, then (the attention of
        step ``turns`` on a copying rank) for this rank's message copies, holding the core
        meanwhile: the copies run on it."""
        env = self.env
        if t > env.now:
            yield env.timeout(t - env.now)
        with self.cores[r].request() as req:
            yield req
            end = env.now + duration if turns is None else self._compute_end(r, turns, duration)
            yield env.timeout(end - env.now)
        return env.now
