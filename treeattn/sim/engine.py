"""The simpy engine: execute a :class:`~treeattn.schedule.ir.Schedule` on a topology, and what
it returns (:class:`SimResult`, the critical path, the peak-memory model).

* Each rank is a simpy process that runs its steps in order (semantics in schedule.py),
  keeping its own clock: steps that cannot block (Compute, Merge, Send) advance it without
  an event, and the process only yields when a Recv's message has not been posted yet.
* ``Compute``/``Merge`` take ``HardwareModel.compute_time``. ``Send`` occupies the sender
  for its software cost; the message is injected by a simpy event at that moment. ``Recv``
  waits for the arrival, then pays the receiver's. Both, and the route's latency and
  bandwidth, come from :mod:`treeattn.sim.nccl.p2p`: on NCCL/RCCL the protocol the library picks
  for the size, priced as ``treeattn comm`` and the closed forms price it; on gloo the
  calibrated ``send_s``/``recv_s`` and the links. A collective starts when its last
  member arrives and takes the library's modelled time (:mod:`treeattn.sim.nccl`).
* What a rank's host adds on top comes from one interface,
  :class:`treeattn.sim.host_model.HostModel`: nothing on a GPU cluster (the plain host); a
  host model carried by the hardware (the CPU test bed's shared cores, cold steps, compiled
  reduction) where one is given.
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

from treeattn.schedule.ir import (
    Collective,
    Compute,
    Merge,
    Recv,
    Schedule,
    Send,
    sent_bytes,
    step_name,
)
from treeattn.schedule.payloads import GroupIds, ScheduleError
from treeattn.schedule.workload import DecodeWorkload
from treeattn.sim.host_model import bind_host
from treeattn.sim.memory import peak_memory
from treeattn.sim.network import CostModel, LinkCalendar
from treeattn.sim.result import SimResult, critical_path


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
        # what the ranks' hosts add (nothing, unless the hardware carries a host model)
        self.host = bind_host(self.env, self.links, costs, schedule)
        # Collectives in flight: (group, k-th call of that group) -> arrivals and the event
        # that the last member to arrive fires with the finish time.
        self.calls: dict[tuple, dict] = {}
        self.call_count: dict[tuple[int, int], int] = {}
        self.group_id = GroupIds()  # cheap keys for large groups (see payloads.GroupIds)

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
        env, c, host = self.env, self.c, self.host
        crowded = host.crowded[r]
        t = 0.0
        for i, step in enumerate(self.s.steps[r]):
            start = t
            if isinstance(step, Compute | Merge):
                flops = step.flops if isinstance(step, Compute) else 0
                duration = host.compute_duration(r, step, c.compute(r, step.nbytes, flops))
                if host.queues(r, step):
                    t = yield from host.compute(r, i, step, t, duration)
                else:
                    t += duration
                host.computed(r, step)
            elif isinstance(step, Send):
                cost = host.send_s(r, step.nbytes)
                t = (yield from host.host_work(r, t, cost)) if crowded else t + cost
                self.post(r, i, step, t)
            elif isinstance(step, Collective):
                cost = host.collective_s(r, step)
                t = (yield from host.host_work(r, t, cost)) if crowded else t + cost
                t = yield from self._collective(r, i, step, t)
            elif isinstance(step, Recv):
                key = (step.src, r, step.tag)
                info = self.mail.get(key)
                if info is None:
                    info = yield self.waiting.setdefault(key, env.event())
                if info[3] > t:
                    self.cause[r][i] = info
                    t = info[3]
                cost = host.recv_s(r, step.nbytes)
                t = (yield from host.host_work(r, t, cost)) if crowded else t + cost
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
                                    run.host.copy_wait),
    )
