"""Message costs on a topology, the links as reservable resources, and the cost context.

A message of ``n`` bytes is cut into ``c = clamp(ceil(n / chunk_bytes), 1, max_chunks)``
chunks of ``s = n / c`` bytes that cross the route with cut-through pipelining: a chunk's
head reaches link ``j + 1`` a latency ``l_j`` after it started on link ``j``, and the chunk
holds each link for at least ``s / b_j`` and until its tail has come in from the link before.
With no other traffic the chunks stream through the slowest link back to back, so

    wire(n) = Σ_hops l_j + n / min_j b_j

exactly (the closed form); chunking matters when messages share links, where chunks of
different messages interleave. The engine simulates this with contention.

Links are reservable resources (:class:`LinkCalendar`): first-fit calendars of busy
intervals. A chunk whose head can reach a link at ``ready`` is granted the earliest idle
interval starting no earlier than ``ready`` that is long enough for it (see
:meth:`LinkCalendar.reserve`). Reservations are made in simulated-time order: a message's
chunks when it is injected (posted), and, on hosts that copy messages, an attention's turn
on its rank's links when it starts (:meth:`LinkCalendar.reserve_together`).

:class:`CostModel`, the cost context shared by the engine, the closed forms and the
planner, binds a topology, a workload, per-rank hardware models and a backend: it
answers "how long does this compute take on rank r" and "how long does a message from a to b
take when nothing else is on the wire", with caches that make repeated questions cheap.
"""

from __future__ import annotations

import math
from bisect import bisect_right

import numpy as np

from treeattn.schedule.payloads import CollectiveOp, SimError
from treeattn.schedule.workload import DecodeWorkload
from treeattn.sim.devices import (
    BackendModel,
    HardwareModel,
    backend_for,
    default_backend,
    hardware_for,
)
from treeattn.sim.host_model import host_spec
from treeattn.sim.nccl.p2p import P2PModel
from treeattn.sim.onesided import TRANSPORTS as ONE_SIDED_TRANSPORTS
from treeattn.sim.onesided import one_sided

DEFAULT_CHUNK_BYTES = 1 << 20
DEFAULT_MAX_CHUNKS = 64
# How collectives and messages run: NCCL's (or RCCL's) regular path, or a one-sided transport
# inside one NVLink domain (treeattn.sim.onesided), falling back to the regular path, as the
# libraries do, for an op or group it does not cover.
TRANSPORTS = ONE_SIDED_TRANSPORTS

Edge = tuple[str, str]


class Network:
    """Cached per-pair routes and hop parameters for one topology and backend.

    Examples
    --------
    >>> from treeattn.topo import Topology
    >>> from treeattn.sim.devices import backend_for
    >>> net = Network(Topology.from_spec("local:ranks=2,latency=0,bandwidth=1e9"),
    ...               backend_for("gloo"))
    >>> net.chunking(3 << 20)
    (3, 1048576.0)
    """

    def __init__(
        self,
        topology,
        backend: BackendModel,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        max_chunks: int = DEFAULT_MAX_CHUNKS,
    ) -> None:
        self.topology = topology
        self.backend = backend
        self.chunk_bytes = int(chunk_bytes)
        self.max_chunks = int(max_chunks)
        self.names = list(topology.gpus)
        self._hops: dict[tuple[int, int], tuple[tuple[Edge, float, float], ...]] = {}
        self._summary: dict[tuple[int, int], tuple[float, float]] = {}
        self._edges: dict = {}

    @property
    def world(self) -> int:
        return len(self.names)

    def hops(self, src: int, dst: int) -> tuple[tuple[Edge, float, float], ...]:
        """``(edge, bandwidth, latency)`` for each link from rank ``src`` to rank ``dst``."""
        key = (src, dst)
        found = self._hops.get(key)
        if found is None:
            edges = self.topology.route(src, dst)
            found = tuple(self._edge(e) for e in edges)
            self._hops[key] = found
        return found

    def _edge(self, edge) -> tuple[Edge, float, float]:
        found = self._edges.get(edge)
        if found is None:
            data = self.topology.graph.edges[edge]
            found = self._edges[edge] = (tuple(edge), float(data["bandwidth"]),
                                         float(data["latency"]))
        return found

    def summary(self, src: int, dst: int) -> tuple[float, float]:
        """``(Σ l_j, 1 / min b_j)`` of the route: all the wire formula needs."""
        key = (src, dst)
        found = self._summary.get(key)
        if found is None:
            hops = self.hops(src, dst)
            if not hops:
                found = (0.0, 0.0)
            else:
                found = (sum(lat for _, _, lat in hops), 1.0 / min(b for _, b, _ in hops))
            self._summary[key] = found
        return found

    def chunking(self, nbytes: float) -> tuple[int, float]:
        """``(count, size)`` of the chunks a message of ``nbytes`` is cut into."""
        count = max(1, min(self.max_chunks, math.ceil(nbytes / self.chunk_bytes)))
        return count, nbytes / count


# -- links -------------------------------------------------------------------------------
PRUNE_AT = 64


class LinkCalendar:
    """Busy intervals of every directed link; links are created on first use."""

    def __init__(self) -> None:
        self._starts: dict = {}
        self._ends: dict = {}

    def fit(self, edge, ready: float, hold: float) -> float:
        """The earliest ``begin ≥ ready`` at which ``edge`` is idle for ``hold`` seconds;
        books nothing."""
        starts = self._starts.get(edge)
        if not starts:
            return ready
        ends = self._ends[edge]
        begin, idx = ready, bisect_right(ends, ready)
        while idx < len(starts) and begin + hold > starts[idx]:
            begin = max(begin, ends[idx])
            idx += 1
        return begin

    def reserve_together(self, edges, ready: float, hold: float, now: float) -> float:
        """Book every edge of ``edges`` for the same ``hold`` seconds at the earliest time
        ``≥ ready`` when all of them are idle; return that time."""
        begin = ready
        while True:  # each pass moves begin to a later busy interval's end, so it stops
            latest = max((self.fit(edge, begin, hold) for edge in edges), default=begin)
            if not latest > begin:  # (also stops on a NaN time instead of looping)
                break
            begin = latest
        for edge in edges:
            self.reserve(edge, begin, hold, begin, now)
        return begin

    def reserve(self, edge, ready: float, hold: float, tail: float, now: float) -> tuple:
        """Book ``edge`` at the earliest fit ≥ ``ready``; return ``(begin, end)``.

        The chunk holds the link for ``hold`` seconds and at least until ``tail`` (when its
        last byte has come in from the previous link). ``now`` is the current simulated
        time: intervals ending before it can never matter again and are dropped.
        """
        starts = self._starts.get(edge)
        begin = ready
        end = max(begin + hold, tail)
        if starts is None:
            self._starts[edge] = [begin]
            self._ends[edge] = [end]
            return begin, end
        ends = self._ends[edge]
        if len(ends) > PRUNE_AT:
            old = bisect_right(ends, now)
            del starts[:old], ends[:old]
        idx = bisect_right(ends, ready)
        while idx < len(starts) and end > starts[idx]:
            begin = max(begin, ends[idx])
            end = max(begin + hold, tail)
            idx += 1
        starts.insert(idx, begin)
        ends.insert(idx, end)
        return begin, end


# -- the cost context -------------------------------------------------------------------

def resolve_hardware(topology, hardware) -> list[HardwareModel]:
    """One HardwareModel per rank: given, or looked up from ``topology.gpu_model(r)``."""
    world = topology.num_gpus
    if hardware is None:
        cache: dict[str, HardwareModel] = {}
        out = []
        for r in range(world):
            name = topology.gpu_model(r)
            if name not in cache:
                cache[name] = hardware_for(name)
            out.append(cache[name])
        return out
    if isinstance(hardware, HardwareModel):
        return [hardware] * world
    if isinstance(hardware, str):
        return [hardware_for(hardware)] * world
    hardware = list(hardware)
    if len(hardware) != world or not all(isinstance(h, HardwareModel) for h in hardware):
        raise SimError(f"hardware must be a HardwareModel or a list of {world} of them")
    return hardware


def resolve_backend(topology, backend) -> BackendModel:
    if backend is None:
        return default_backend(topology.gpu_model(0))
    if isinstance(backend, BackendModel):
        return backend
    return backend_for(backend)


class CostModel:
    """Compute and message costs for one (topology, workload, hardware, backend)."""

    def __init__(self, topology, workload: DecodeWorkload, hardware=None, backend=None,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 max_chunks: int = DEFAULT_MAX_CHUNKS, transport: str = "nccl") -> None:
        if not isinstance(workload, DecodeWorkload):
            raise SimError("workload must be a DecodeWorkload")
        self.one_sided_transport = one_sided(transport)  # None: NCCL's regular path
        self.transport = transport
        self.topology = topology
        self.workload = workload
        self.world = topology.num_gpus
        self.shards = workload.shards(self.world)
        self.hardware = resolve_hardware(topology, hardware)
        self.backend = resolve_backend(topology, backend)
        self.net = Network(topology, self.backend, chunk_bytes, max_chunks)
        self.send_s = self.backend.send_s
        self.recv_s = self.backend.recv_s
        # What the ranks' hosts add (treeattn.sim.host_model); the closed-form lower bounds
        # take the least a message may cost there.
        self.host = host_spec(self.hardware)
        self.least_send_s = (self.host.cheapest_send_s(self.send_s) if self.host
                             else self.send_s)
        self.least_recv_s = (self.host.cheapest_recv_s(self.recv_s) if self.host
                             else self.recv_s)
        # THE per-message price of the engine and the closed forms (treeattn.sim.nccl.p2p)
        self.p2p = P2PModel(topology, self.backend, self.net, self.hardware, transport)
        self.bw = np.array([h.memory_bandwidth_Bps for h in self.hardware])
        self.shaped = any(h.bandwidth_shape for h in self.hardware)
        self.flops = np.array([h.peak_flops for h in self.hardware])
        self.launch = np.array([h.launch_s for h in self.hardware])
        self._pair_cache: dict = {}
        self._collective_cache: dict = {}
        self._group_shapes: dict = {}

    def compute(self, rank: int, nbytes: float, flops: float = 0.0) -> float:
        return self.hardware[rank].compute_time(nbytes, flops)

    def compute_vec(self, nbytes, flops=0.0) -> np.ndarray:
        """Per-rank compute times for arrays (or scalars) of bytes and FLOPs."""
        nbytes = np.asarray(nbytes, dtype=float)
        flops = np.asarray(flops, dtype=float)
        bw = self.bw
        if self.shaped:  # a bandwidth per step size (calibrated caches): one per rank's bytes
            per_rank = np.broadcast_to(nbytes, (self.world,))
            bw = np.array([h.bandwidth_at(float(b)) for h, b in zip(self.hardware, per_rank,
                                                                     strict=True)])
        return np.maximum(nbytes / bw, flops / self.flops) + self.launch

    def attention_vec(self) -> np.ndarray:
        """Time of each rank's local partial over its own shard."""
        w = self.workload
        shards = np.asarray(self.shards, dtype=float)
        nbytes = np.array([w.attention_bytes(n) for n in self.shards], dtype=float)
        return self.compute_vec(nbytes, 4.0 * w.batch * w.model.n_heads * shards
                                * w.model.head_dim)

    def send_cost(self, nbytes: float) -> float:
        """The sender's cost of a message of ``nbytes`` (the cheaper of the Python steps' and
        the C program's, where a calibration has both: closed forms stay lower bounds)."""
        return self.p2p.send_s(nbytes) if self.p2p.library else self.least_send_s

    def recv_cost(self, nbytes: float) -> float:
        return self.p2p.recv_s(nbytes) if self.p2p.library else self.least_recv_s

    def wire(self, src: int, dst: int, nbytes: float) -> float:
        """Uncontended seconds from injection at ``src`` to arrival at ``dst``."""
        lat_sum, inv_min = self.p2p.summary(src, dst, nbytes)
        return lat_sum + nbytes * inv_min

    def pair_summary(self, src: np.ndarray, dst: np.ndarray, nbytes: float = 0.0) -> np.ndarray:
        """``(p, 2)`` array of :meth:`P2PModel.summary` rows for messages of ``nbytes``
        (the size picks the protocols), cached per pair list and pair of protocols."""
        key = (src.tobytes(), dst.tobytes(), self.p2p.regime(nbytes))
        found = self._pair_cache.get(key)
        if found is None:
            found = np.array([self.p2p.summary(int(a), int(b), nbytes)
                              for a, b in zip(src, dst)])
            self._pair_cache[key] = found
        return found

    def wire_vec(self, src: np.ndarray, dst: np.ndarray, nbytes) -> np.ndarray:
        """Vectorised :meth:`wire` over pairs ``(src[i], dst[i])``."""
        src, dst = np.asarray(src), np.asarray(dst)
        sizes = np.broadcast_to(np.asarray(nbytes, dtype=float), src.shape)
        if not self.p2p.library:
            summ = self.pair_summary(src, dst)
            return summ[:, 0] + sizes * summ[:, 1]
        if sizes.size and sizes.min() == sizes.max():  # one size: one pair of protocols
            summ = self.pair_summary(src, dst, float(sizes.flat[0]))
            return summ[:, 0] + sizes * summ[:, 1]
        out = np.empty(src.shape)
        values, inverse = np.unique(sizes, return_inverse=True)
        codes = [self.p2p.regime(float(v)) for v in values]  # (inside, across), each -1..2
        regimes = np.array([4 * a + b for a, b in codes])[inverse]
        regimes = regimes.reshape(src.shape)
        for p in set(regimes.tolist()):
            pick = regimes == p
            summ = self.pair_summary(src, dst, float(sizes[pick][0]))
            out[pick] = summ[pick, 0] + sizes[pick] * summ[pick, 1]
        return out

    def send_vec(self, nbytes, recv: bool = False) -> np.ndarray:
        """:meth:`send_cost` (``recv``: :meth:`recv_cost`) per element of ``nbytes``."""
        sizes = np.asarray(nbytes, dtype=float)
        if not self.p2p.library:
            return np.full(sizes.shape, self.least_recv_s if recv else self.least_send_s)
        if sizes.size and sizes.min() == sizes.max():
            return np.full(sizes.shape, self.send_cost(float(sizes.flat[0])))
        values, inverse = np.unique(sizes, return_inverse=True)
        return np.array([self.send_cost(float(v)) for v in values])[inverse].reshape(sizes.shape)

    # -- collectives -----------------------------------------------------------------------

    def collective_time(self, op: CollectiveOp | str, group: tuple[int, ...],
                        nbytes: float) -> float:
        """Seconds one collective takes once every member has arrived (cached).

        GPUs: NCCL's or RCCL's own tuning model (:mod:`treeattn.sim.nccl.collectives`). CPU ranks
        on gloo: the calibrated fit for that op and group size when the profile has one,
        else :func:`gloo_collective_time`, our model of how gloo runs it.
        """
        op = CollectiveOp(op)
        key = (op, group, int(nbytes))
        found = self._collective_cache.get(key)
        if found is None:
            found = self._collective_time(op, group, int(nbytes))
            self._collective_cache[key] = found
        return found

    def _collective_time(self, op: CollectiveOp, group: tuple[int, ...], nbytes: int) -> float:
        if len(group) < 2:
            return 0.0
        if self.backend.name == "gloo" or all(h.name == "cpu" for h in self.hardware):
            fit = self.backend.measured_collective(op.library_op, len(group))
            if fit is not None:
                return fit[0] + nbytes * fit[1]
            latency, per_byte = self.net.summary(group[0], group[1])
            return gloo_collective_time(op, len(group), nbytes, self.send_s + self.recv_s
                                        + latency, per_byte)
        from treeattn.sim.nccl.collectives import collective_cost

        shape = self._shape(group)
        if self.backend.calibration is not None:  # measured on this cluster: trust it
            return self.backend.calibration.time_s(op.library_op, max(1, nbytes), shape)
        if self.one_sided(op, group):
            return self.one_sided_transport.cost(op.library_op, max(1, nbytes), shape,
                                                 _reduction(op)).time_s
        # the merges' collectives carry fp32 (PAYLOAD_LAYOUTS): NCCL's NVLS sums them but
        # has no fp32 max, so a max all-reduce takes the ring or the tree
        return collective_cost(op.library_op, max(1, nbytes), shape, dtype="float32",
                               reduction=_reduction(op)).time_s

    def one_sided(self, op: CollectiveOp | str, group: tuple[int, ...]) -> bool:
        """Whether ``op`` on ``group`` runs on this cost model's one-sided transport (it has
        a kernel for this op, reduction and group); otherwise NCCL's regular path prices it."""
        if self.one_sided_transport is None or len(group) < 2:
            return False
        op = CollectiveOp(op)
        return self.one_sided_transport.unavailable(op.library_op, self._shape(group),
                                                    _reduction(op)) is None

    def _shape(self, group: tuple[int, ...]):
        """How the tuning model sees the communicator of ``group`` (cached)."""
        from treeattn.sim.nccl.env import with_env
        from treeattn.sim.nccl.group_shape import GroupShape

        shape = self._group_shapes.get(group)
        if shape is None:
            shape = self._group_shapes[group] = with_env(GroupShape.of(self.topology, group),
                                                         self.backend.nccl_env)
        return shape


def _reduction(op: CollectiveOp) -> str:
    return "max" if op is CollectiveOp.ALL_REDUCE_MAX else "sum"


def gloo_collective_time(op: CollectiveOp, p: int, nbytes: float, alpha: float,
                         per_byte: float) -> float:
    """How gloo runs each op on CPU ranks, as message rounds of ``alpha + bytes·per_byte``.

    * all-reduce: gloo's ring (reduce-scatter then all-gather), ``2(p−1)`` rounds of
      ``n/p`` bytes;
    * all-gather and all-to-all: ``p−1`` rounds of ``n/p`` bytes (ring, pairwise);
    * broadcast: a binomial tree, ``⌈log2 p⌉`` rounds of the whole buffer;
    * reduce-scatter: torch's gloo backend provides it, but how it runs it is not documented,
      so it is priced as an all-reduce (an upper bound) until calibration measures it.
    """
    if op in (CollectiveOp.ALL_REDUCE_SUM, CollectiveOp.ALL_REDUCE_MAX,
              CollectiveOp.REDUCE_SCATTER):
        return 2 * (p - 1) * (alpha + nbytes / p * per_byte)
    if op == CollectiveOp.BROADCAST:
        return math.ceil(math.log2(p)) * (alpha + nbytes * per_byte)
    return (p - 1) * (alpha + nbytes / p * per_byte)
