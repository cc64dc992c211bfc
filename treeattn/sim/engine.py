"""The simpy engine: execute a :class:`~treeattn.sim.schedule.Schedule` on a topology, and what
it returns (:class:`SimResult`, the critical path, the peak-memory model).

* Each rank is a simpy process that runs its steps in order (semantics in schedule.py),
  keeping its own clock: steps that cannot block (Compute, Merge, Send) advance it without
  an event, and the process only yields when a Recv's message has not been posted yet.
* ``Compute``/``Merge`` take ``HardwareModel.compute_time``. When the hardware has
  ``cores`` (a calibrated CPU), all ranks of a host share a ``simpy.Resource`` with that
  many servers, so ranks beyond the core count queue for compute. When the launcher pinned
  the ranks (``HardwareModel.pinned``), the host's k-th rank has core ``k mod cores`` to
  itself and queues only behind the ranks pinned to the same core.
* ``Send`` occupies the sender for its software cost; the message is injected by a
  simpy event at that moment. ``Recv`` waits for the arrival, then pays the receiver's.
  Both, and the route's latency and bandwidth, come from :mod:`treeattn.sim.p2p`: on
  NCCL/RCCL the protocol the library picks for the size, priced as ``treeattn comm`` and
  the closed forms price it; on gloo the calibrated ``send_s``/``recv_s`` and the links.
* On a host whose cores copy every byte of a message (``HardwareModel.copies_messages``:
  gloo's sockets), a rank's attention and the copies of its own messages take turns: when it
  starts, a Compute books the rank's own links (its one link out and one link in, which only
  its own messages use: the ``local`` star) for its duration, at the first time both are
  free of message chunks, and chunks booked later fit around it. Measured on a 2-core box, a
  ring step took the exchange's time plus the attention, not the larger of the two: both
  stream memory through the same cores. Merges (microseconds) do not take turns, and on a
  topology where links are not a rank's own nothing does. The critical path counts the wait
  as wire time.
* With a calibrated ``HardwareModel.cold``, the first merge, send, receive and collective
  after a rank's attention kernel also pay what running cold costs (:mod:`treeattn.sim.cold`).
* A rank whose steps the runtime runs as one C program (a plain reduction of partials with a
  calibrated ``BackendModel.program``, :mod:`treeattn.sim.partial_reduction`) pays the
  program's message costs instead, and no cold extras (in a group that gets the mailboxes:
  one host, at most ``program.max_world`` ranks).
* A message is cut into chunks (:mod:`treeattn.sim.network`) that cross the route with
  cut-through pipelining: a chunk holds each link for ``chunk / bandwidth`` (and until its
  tail has arrived), and its head reaches the next link ``latency`` after it started on
  this one. Links are resources booked first-fit at injection (a
  :class:`~treeattn.sim.network.LinkCalendar`): a chunk gets the earliest idle slot at or
  after the moment it can reach the link. Without contention this is exactly the
  closed-form pipeline; with contention it differs from a strict arrival-order FIFO only
  when a later-posted message cannot fit in a gap before an earlier-posted one (it then
  queues behind it). Booking at injection needs one event per message instead of one per
  chunk and hop, which is what makes tens of thousands of ranks tractable.

Peak memory per rank is modelled in :mod:`treeattn.sim.memory`; what a run returns, and its
critical path, in :mod:`treeattn.sim.result`.
"""

from __future__ import annotations

import simpy

from treeattn.sim.cold import KINDS
from treeattn.sim.memory import peak_memory
from treeattn.sim.network import CostModel, LinkCalendar
from treeattn.sim.payloads import (
    CollectiveOp,
    GroupIds,
    ScheduleError,
)
from treeattn.sim.result import SimResult, critical_path
from treeattn.sim.schedule import (
    Collective,
    Compute,
    Merge,
    Recv,
    Schedule,
    Send,
    sent_bytes,
    step_name,
)
from treeattn.sim.workload import DecodeWorkload


class _Run:
    def __init__(self, schedule: Schedule, costs: CostModel) -> None:
        self.s, self.c = schedule, costs
        self.env = simpy.Environment()
        self.links = LinkCalendar()
        self.mail: dict[tuple[int, int, int], tuple] = {}
        self.waiting: dict[tuple[int, int, int], simpy.Event] = {}
        self.link_bytes: dict = {}
        self.sent = [0] * schedule.world
        self.start = [[0.0] * len(st) for st in schedule.steps]
        self.end = [[0.0] * len(st) for st in schedule.steps]
        self.cause: list[list] = [[None] * len(st) for st in schedule.steps]
        self.finished = 0
        self.cores = self._core_pools(schedule.world)
        # ranks whose attention takes turns with their messages' copies: the links they book
        self.copy_edges = self._copy_edges()
        self.copy_wait = [[0.0] * len(st) for st in schedule.steps]  # for the critical path
        # per rank: the calibrated cold-step costs and the kinds still cold (treeattn.sim.cold)
        self.cold_costs = [h.cold for h in self.c.hardware]
        self.cold: list[set] = [set() for _ in range(schedule.world)]
        # ranks whose steps run as one C program: its message costs, and nothing runs cold
        program, world = costs.program, schedule.world
        one_host = len({costs.topology.host_of(r) for r in range(world)}) == 1
        grouped = program is not None and program.runs(world, one_host)
        self.programmed = [grouped and program.takes(steps) for steps in schedule.steps]
        # ranks whose core pool has fewer servers than ranks: their host work queues too
        sharing: dict[int, int] = {}
        for pool in self.cores:
            if pool is not None:
                sharing[id(pool)] = sharing.get(id(pool), 0) + 1
        self.crowded = [pool is not None and sharing[id(pool)] > pool.capacity
                        for pool in self.cores]
        # Collectives in flight: (group, k-th call of that group) -> arrivals and the event
        # that the last member to arrive fires with the finish time.
        self.calls: dict[tuple, dict] = {}
        self.call_count: dict[tuple[int, int], int] = {}
        self.group_id = GroupIds()  # cheap keys for large groups (see payloads.GroupIds)

    def _core_pools(self, world: int) -> list:
        """Each rank's compute servers: the host's pool, or its own core when pinned."""
        hw = self.c.hardware
        if all(h.cores is None for h in hw):
            return [None] * world
        pools: dict = {}
        out = []
        for r in range(world):
            host = self.c.topology.host_of(r)
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

    def _copy_edges(self) -> list[tuple]:
        """Per rank, the links its compute books where the host copies messages: its one link
        out and its one link in, when every copying rank has exactly one of each and shares
        neither with another rank (the ``local`` star: rank to host and back). Elsewhere (a
        direct rank-to-rank link, a mesh) a link is no rank's own, so nothing is booked and
        compute overlaps the copies as on hardware that does not copy."""
        world, net = self.s.world, self.c.net
        copying = [r for r, h in enumerate(self.c.hardware) if h.copies_messages]
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

    def post(self, src: int, step_index: int, step: Send, at: float) -> None:
        """Inject ``step``'s message at simulated time ``at`` (now or later)."""
        if at <= self.env.now:
            self.inject(src, step_index, step)
            return
        ev = self.env.timeout(at - self.env.now)
        ev.callbacks.append(lambda _e: self.inject(src, step_index, step))

    def inject(self, src: int, step_index: int, step: Send) -> None:
        now, net = self.env.now, self.c.net
        hops = self.c.p2p.hops(src, step.dst, step.nbytes)  # as the library sends it
        count, size = net.chunking(step.nbytes)
        self.sent[src] += step.nbytes
        arrival = now
        # Chunked cut-through pipelining. A message is not stored and forwarded whole at each
        # hop: it is cut into `count` chunks, and a chunk's head enters link j + 1 one latency
        # after it started on link j, while its tail may still be on link j. So a long
        # message pays the slowest link's transfer time once (plus every hop's latency), not
        # once per hop; and chunks of different messages can interleave on a shared link.
        # Every chunk is booked on every link now, at injection (first fit in the calendars),
        # which costs one event per message instead of one per chunk and hop.
        for k in range(count):
            head, tail = now, now  # head may enter the next link at `head`; tail is in by `tail`
            for edge, bw, lat in hops:
                if k == 0:
                    self.link_bytes[edge] = self.link_bytes.get(edge, 0) + step.nbytes
                begin, end = self.links.reserve(edge, head, size / bw, tail, now)
                head, tail = begin + lat, end + lat
            arrival = max(arrival, tail)
        key = (src, step.dst, step.tag)
        info = (src, step_index, now, arrival)
        self.mail[key] = info
        waiter = self.waiting.pop(key, None)
        if waiter is not None:
            waiter.succeed(info)

    def rank(self, r: int):
        env, c = self.env, self.c
        t = 0.0
        for i, step in enumerate(self.s.steps[r]):
            start = t
            if isinstance(step, Compute | Merge):
                flops = step.flops if isinstance(step, Compute) else 0
                duration = c.compute(r, step.nbytes, flops)
                costs = self.cold_costs[r]
                streams = (costs is not None and isinstance(step, Compute)
                           and costs.makes_cold(step.label, step.nbytes))
                if not streams and not self.programmed[r]:
                    duration += self._cold_extra(r, "merge")
                turns = isinstance(step, Compute) and bool(self.copy_edges[r])
                if self.cores[r] is not None:
                    t = yield from self._shared_compute(r, t, duration, (i if turns else None))
                elif turns:  # booked at its own start, in simulated-time order with messages
                    if t > env.now:
                        yield env.timeout(t - env.now)
                    t = self._compute_end(r, i, duration)
                else:
                    t += duration
                if streams:
                    self.cold[r].update(KINDS)
            elif isinstance(step, Send):
                host = (c.program.send_s if self.programmed[r]
                        else c.p2p.send_s(step.nbytes) + self._cold_extra(r, "send"))
                t = (yield from self._crowded_host(r, t, host)) if self.crowded[r] else t + host
                self.post(r, i, step, t)
            elif isinstance(step, Collective):
                # a cold member first runs its cold code, on its core, then joins
                host = self._cold_extra(r, "collective", step)
                t = (yield from self._crowded_host(r, t, host)) if self.crowded[r] else t + host
                t = yield from self._collective(r, i, step, t)
            elif isinstance(step, Recv):
                key = (step.src, r, step.tag)
                info = self.mail.get(key)
                if info is None:
                    info = yield self.waiting.setdefault(key, env.event())
                if info[3] > t:
                    self.cause[r][i] = info
                    t = info[3]
                host = (c.program.recv_s if self.programmed[r]
                        else c.p2p.recv_s(step.nbytes) + self._cold_extra(r, "recv"))
                t = (yield from self._crowded_host(r, t, host)) if self.crowded[r] else t + host
            self.start[r][i], self.end[r][i] = start, t
        self.finished += 1

    def _collective(self, r: int, i: int, step: Collective, t: float):
        """Wait for every member, then take the collective's modelled time; the last member
        to arrive sets the start. Its links are booked for the transfer so that concurrent
        messages see it."""
        g = self.group_id(step.group)
        k = self.call_count.get((r, g), 0)
        self.call_count[(r, g)] = k + 1
        call = self.calls.setdefault((g, k), {"arrivals": {}, "event": self.env.event()})
        call["arrivals"][r] = (t, i)
        if len(call["arrivals"]) == len(step.group):
            late_rank, (start, late_step) = max(call["arrivals"].items(),
                                                key=lambda kv: kv[1][0])
            end = start + self.c.collective_time(step.op, step.group, step.nbytes)
            self._book_collective(step, start, end)
            call["event"].succeed((late_rank, late_step, start, end))
        late_rank, late_step, start, end = yield call["event"]
        if late_rank != r:
            self.cause[r][i] = (late_rank, late_step, start, end)
        self.sent[r] += sent_bytes(step)
        return end

    def _book_collective(self, step: Collective, start: float, end: float) -> None:
        """Hold each ring link of the group (member i -> member i+1) while the data moves."""
        group, net = step.group, self.c.net
        moved = sent_bytes(step)  # what each member sends, over each ring link
        for a, b in zip(group, group[1:] + group[:1]):
            for edge, bw, _lat in net.hops(a, b):
                self.link_bytes[edge] = self.link_bytes.get(edge, 0) + int(moved)
                self.links.reserve(edge, start, min(moved / bw, end - start), start,
                                   self.env.now)

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

    def _crowded_host(self, r: int, t: float, seconds: float):
        """Host work of ``seconds`` from ``t`` on a rank that shares its core: it waits for
        the core (a rank pinned beside another cannot post a message while the other
        computes). Uncrowded ranks just add the seconds, without a generator per step."""
        if seconds <= 0:
            return t
        return (yield from self._shared_compute(r, t, seconds))

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

    def run(self) -> None:
        for r in range(self.s.world):
            self.env.process(self.rank(r))
        self.env.run()

    def timeline(self) -> list:
        return [(r, i, step_name(step), self.start[r][i], self.end[r][i])
                for r, steps in enumerate(self.s.steps) for i, step in enumerate(steps)]


def simulate(schedule: Schedule, topology, workload: DecodeWorkload, hardware=None,
             backend=None, *, costs: CostModel | None = None,
             timeline: bool = True) -> SimResult:
    """Execute ``schedule`` on ``topology`` and predict its latency and footprint.

    ``costs`` reuses a :class:`CostModel` (and its route caches) across calls; ``timeline``
    can be turned off to save memory on very large runs.

    Examples
    --------
    >>> from treeattn.topo import Topology
    >>> from treeattn.sim import build_schedule
    >>> topo = Topology.from_spec("local:ranks=4,latency=1e-6,bandwidth=1e9")
    >>> w = DecodeWorkload("debug", 64)
    >>> r = simulate(build_schedule("butterfly", topo, w), topo, w)
    >>> r.comm_bytes == 4 * 2 * w.partial_bytes
    True
    """
    costs = costs or CostModel(topology, workload, hardware, backend)
    if costs.world != schedule.world:
        raise ScheduleError(f"schedule for {schedule.world} ranks on a {costs.world}-GPU topology")
    run = _Run(schedule, costs)
    run.run()
    if run.finished < schedule.world:
        schedule.validate()  # names the deadlocked rank and step
        raise ScheduleError(f"{schedule.world - run.finished} ranks never finished")
    makespan = max((e[-1] for e in run.end if e), default=0.0)
    return SimResult(
        algorithm=schedule.algorithm, params=dict(schedule.params), makespan_s=makespan,
        comm_bytes=sum(run.sent), bytes_per_rank=list(run.sent),
        memory=lambda: peak_memory(schedule, workload),
        steps_timeline=run.timeline if timeline else [], bytes_per_link=run.link_bytes,
        critical_path=critical_path(schedule.steps, run.start, run.end, run.cause,
                                    run.copy_wait),
    )
