"""The simpy engine: execute a :class:`~treeattn.sim.schedule.Schedule` on a topology.

* Each rank is a simpy process that runs its steps in order (semantics in schedule.py),
  keeping its own clock: steps that cannot block (Compute, Merge, Send) advance it without
  an event, and the process only yields when a Recv's message has not been posted yet.
* ``Compute``/``Merge`` take ``HardwareModel.compute_time``. When the hardware has
  ``cores`` (a calibrated CPU), all ranks of a host share a ``simpy.Resource`` with that
  many servers, so ranks beyond the core count queue for compute.
* ``Send`` occupies the sender for the backend's ``send_s``; the message is injected by a
  simpy event at that moment. ``Recv`` waits for the arrival, then pays ``recv_s``.
* A message is cut into chunks (:mod:`treeattn.sim.network`) that cross the route with
  cut-through pipelining: a chunk holds each link for ``chunk / bandwidth`` (and until its
  tail has arrived), and its head reaches the next link ``latency`` after it started on
  this one. Links are resources booked first-fit at injection
  (:mod:`treeattn.sim.links`): a chunk gets the earliest idle slot at or after the moment it
  can reach the link. Without contention this is exactly the closed-form pipeline; with
  contention it differs from a strict arrival-order FIFO only when a later-posted message
  cannot fit in a gap before an earlier-posted one (it then queues behind it). Booking at
  injection needs one event per message instead of one per chunk and hop, which is what
  makes tens of thousands of ranks tractable.
"""

from __future__ import annotations

import simpy

from treeattn.sim.costs import CostModel
from treeattn.sim.errors import ScheduleError
from treeattn.sim.links import LinkCalendar
from treeattn.sim.memory import peak_memory
from treeattn.sim.results import SimResult, critical_path
from treeattn.sim.schedule import Compute, Merge, Recv, Schedule, Send, step_name
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

    def _core_pools(self, world: int) -> list:
        hw = self.c.hardware
        if all(h.cores is None for h in hw):
            return [None] * world
        pools: dict = {}
        for r in range(world):
            host = self.c.topology.host_of(r)
            if host not in pools:
                pools[host] = simpy.Resource(self.env, capacity=hw[r].cores or 1)
        return [pools[self.c.topology.host_of(r)] for r in range(world)]

    def post(self, src: int, step_index: int, step: Send, at: float) -> None:
        """Inject ``step``'s message at simulated time ``at`` (now or later)."""
        if at <= self.env.now:
            self.inject(src, step_index, step)
            return
        ev = self.env.timeout(at - self.env.now)
        ev.callbacks.append(lambda _e: self.inject(src, step_index, step))

    def inject(self, src: int, step_index: int, step: Send) -> None:
        now, net = self.env.now, self.c.net
        hops = net.hops(src, step.dst)
        count, size = net.chunking(step.nbytes)
        self.sent[src] += step.nbytes
        arrival = now
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
                if self.cores[r] is None:
                    t += duration
                else:
                    t = yield from self._shared_compute(r, t, duration)
            elif isinstance(step, Send):
                t += c.send_s
                self.post(r, i, step, t)
            elif isinstance(step, Recv):
                key = (step.src, r, step.tag)
                info = self.mail.get(key)
                if info is None:
                    info = yield self.waiting.setdefault(key, env.event())
                if info[3] > t:
                    self.cause[r][i] = info
                    t = info[3]
                t += c.recv_s
            self.start[r][i], self.end[r][i] = start, t
        self.finished += 1

    def _shared_compute(self, r: int, t: float, duration: float):
        env = self.env
        if t > env.now:
            yield env.timeout(t - env.now)
        with self.cores[r].request() as req:
            yield req
            yield env.timeout(duration)
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
        critical_path=critical_path(schedule.steps, run.start, run.end, run.cause),
    )
