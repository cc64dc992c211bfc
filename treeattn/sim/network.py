"""Message costs on a topology: routes, chunking and the uncontended wire time.

A message of ``n`` bytes is cut into ``c = clamp(ceil(n / chunk_bytes), 1, max_chunks)``
chunks of ``s = n / c`` bytes that cross the route with cut-through pipelining: a chunk's
head reaches link ``j + 1`` a latency ``l_j`` after it started on link ``j``, and the chunk
holds each link for at least ``s / b_j`` and until its tail has come in from the link before.
With no other traffic the chunks stream through the slowest link back to back, so

    wire(n) = Σ_hops l_j + n / min_j b_j

exactly (the closed form); chunking matters when messages share links, where chunks of
different messages interleave. The engine simulates this with contention.
"""

from __future__ import annotations

import math

from treeattn.sim.backend import BackendModel

DEFAULT_CHUNK_BYTES = 1 << 20
DEFAULT_MAX_CHUNKS = 64

Edge = tuple[str, str]


class Network:
    """Cached per-pair routes and hop parameters for one topology and backend.

    Examples
    --------
    >>> from treeattn.topo import Topology
    >>> from treeattn.sim.backend import backend_for
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

    def wire_time(self, src: int, dst: int, nbytes: float) -> float:
        """Uncontended seconds from injection at ``src`` to arrival at ``dst``."""
        lat_sum, inv_min = self.summary(src, dst)
        return lat_sum + nbytes * inv_min

    def message_time(self, src: int, dst: int, nbytes: float) -> float:
        """α + wire: sender overhead, wire time, receiver overhead."""
        return self.backend.send_s + self.wire_time(src, dst, nbytes) + self.backend.recv_s
