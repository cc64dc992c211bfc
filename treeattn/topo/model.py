"""The :class:`Topology`: a validated networkx graph of a GPU cluster, with routing.

Nodes have ``kind`` (one of :data:`NODE_KINDS`) and ``host``; GPUs also have ``model``,
``rank``, ``p2p`` and, on multi-host systems, ``nic`` (their own NIC). Each directed edge is one
direction of a physical link: ``bandwidth`` (bytes/s), ``latency`` (s), ``kind`` (one of
:data:`LINK_KINDS`) and ``count`` (bonded links). Edges with ``logical=True`` are routing
aggregates of parallel physical links (see :mod:`treeattn.topo.builders`) and are left out of
physical link counts.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import networkx as nx
import numpy as np

from treeattn.topo.errors import TopologyError
from treeattn.topo.graphbuild import validate_graph
from treeattn.topo.importers import jsonio
from treeattn.topo.matrices import all_pairs, intra_blocks, segment_cost
from treeattn.topo.routing import Edge, Router

GpuRef = int | str


class Topology:
    """A GPU cluster: graph, GPU ranks, hosts and cached routes.

    Parameters
    ----------
    graph : networkx.DiGraph
        The cluster graph; it is validated (see :func:`treeattn.topo.graphbuild.validate_graph`).
    name : str
        Where it came from: a spec string or a file name.

    Examples
    --------
    >>> t = Topology.from_spec("dgx-h100:nodes=2")
    >>> t.num_gpus, t.hosts
    (16, ['node0', 'node1'])
    >>> t.path_bandwidth(0, 1)
    450000000000.0
    """

    def __init__(self, graph: nx.DiGraph, name: str = "") -> None:
        self.graph = graph
        self.name = name
        self.gpus: list[str] = validate_graph(graph)
        self._rank = {g: i for i, g in enumerate(self.gpus)}
        self.hosts: list[str] = list(dict.fromkeys(graph.nodes[g]["host"] for g in self.gpus))
        self._router = Router(graph, self.gpus)
        self._matrices: tuple[np.ndarray, np.ndarray] | None = None
        self._check_routes()

    def _check_routes(self) -> None:
        """Every GPU can route to and from GPU 0 (raises :class:`TopologyError` otherwise)."""
        first = self.gpus[0]
        for gpu in self.gpus[1:]:
            self._router.route(first, gpu)
            self._router.route(gpu, first)

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def from_spec(cls, spec: str) -> Topology:
        """Build a named topology, e.g. ``"pcie-4090:gpus=4"`` (see :mod:`.builders`).

        >>> Topology.from_spec("pcie-4090:gpus=4").gpu_model(0)
        'RTX4090'
        """
        from treeattn.topo.builders import build_graph

        graph, canon = build_graph(spec)
        return cls(graph, name=spec.strip() or canon)

    @classmethod
    def from_name(cls, spec: str) -> Topology:
        """Alias of :meth:`from_spec`."""
        return cls.from_spec(spec)

    @classmethod
    def from_json(cls, text: str, name: str = "") -> Topology:
        """Load the JSON written by :meth:`to_json`.

        >>> t = Topology.from_spec("local:ranks=3")
        >>> Topology.from_json(t.to_json()) == t
        True
        """
        graph, stored = jsonio.graph_from_json(text)
        return cls(graph, name=name or stored)

    @classmethod
    def load(cls, source: str | Path, fmt: str = "auto", gpu: str | None = None) -> Topology:
        """A spec string, a ``.json`` topology, or a tool output file (format auto-detected)."""
        from treeattn.topo.importers.detect import load

        return load(cls, source, fmt=fmt, gpu=gpu)

    def to_json(self) -> str:
        """networkx node-link JSON of the graph, with the name as a graph attribute."""
        return jsonio.graph_to_json(self.graph, self.name)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Topology):
            return NotImplemented
        a, b = self.graph, other.graph
        return dict(a.nodes(data=True)) == dict(b.nodes(data=True)) and {
            (u, v): d for u, v, d in a.edges(data=True)
        } == {(u, v): d for u, v, d in b.edges(data=True)}

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Topology({self.name!r}, gpus={self.num_gpus}, hosts={len(self.hosts)})"

    # -- lookups -----------------------------------------------------------------------------
    @property
    def num_gpus(self) -> int:
        return len(self.gpus)

    def gpu(self, ref: GpuRef) -> str:
        """The GPU node name for a rank or a name; :class:`TopologyError` if there is none."""
        if ref.__class__ is int and 0 <= ref < len(self.gpus):  # fast path
            return self.gpus[ref]
        if isinstance(ref, (int, np.integer)) and not isinstance(ref, bool):
            if not 0 <= ref < len(self.gpus):
                raise TopologyError(f"rank {ref} out of range [0, {len(self.gpus)})")
            return self.gpus[int(ref)]
        if isinstance(ref, str) and ref in self._rank:
            return ref
        raise TopologyError(f"no GPU {ref!r} in topology {self.name!r}")

    def rank(self, ref: GpuRef) -> int:
        return self._rank[self.gpu(ref)]

    def host_of(self, ref: GpuRef) -> str:
        return self.graph.nodes[self.gpu(ref)]["host"]

    def machine_of(self, ref: GpuRef) -> str:
        """The machine whose CPU cores and memory the rank runs on: its host, unless the
        node says otherwise (CPU ranks of one machine laid out as several hosts)."""
        data = self.graph.nodes[self.gpu(ref)]
        return data.get("machine", data["host"])

    def gpus_on(self, host: str) -> list[str]:
        """GPUs of ``host`` in rank order."""
        return [g for g in self.gpus if self.graph.nodes[g]["host"] == host]

    def gpu_model(self, ref: GpuRef) -> str:
        """The GPU model, e.g. ``"H100"``; ``"unknown"`` when the source did not say."""
        return str(self.graph.nodes[self.gpu(ref)].get("model", "unknown"))

    def edge(self, u: str, v: str) -> dict:
        """Attributes of the directed edge ``u -> v``."""
        if not self.graph.has_edge(u, v):
            raise TopologyError(f"no edge {u} -> {v}")
        return self.graph.edges[u, v]

    def links(self) -> dict[str, int]:
        """Physical links by kind: a full-duplex link counts once, a bond of ``count`` links
        counts ``count`` times, and logical routing aggregates not at all.

        >>> Topology.from_spec("mi300x").links()["xgmi"]
        28
        >>> Topology.from_spec("dgx-h100").links()["nvlink"]  # 8 GPUs x 18 NVLink4
        144
        """
        seen: Counter = Counter()
        for u, v, d in self.graph.edges(data=True):
            if not d.get("logical") and (u < v or not self.graph.has_edge(v, u)):
                seen[d["kind"]] += d.get("count", 1)
        return dict(sorted(seen.items()))

    def link_bandwidth_out(self, ref: GpuRef, kinds: tuple[str, ...] = ("nvlink", "xgmi")) -> float:
        """Sum of the physical bandwidth leaving a GPU on links of ``kinds`` (bytes/s).

        >>> Topology.from_spec("dgx-h100").link_bandwidth_out(0)
        450000000000.0
        """
        return float(sum(
            d["bandwidth"] for _, _, d in self.graph.out_edges(self.gpu(ref), data=True)
            if d["kind"] in kinds and not d.get("logical")
        ))

    # -- routing -----------------------------------------------------------------------------
    def route(self, src: GpuRef, dst: GpuRef) -> list[Edge]:
        """The directed edges a message from ``src`` to ``dst`` crosses (cached).

        >>> Topology.from_spec("pcie-4090:gpus=2").route(0, 1)[:2]
        [('node0/gpu0', 'node0/pcie0'), ('node0/pcie0', 'node0/cpu0')]
        """
        gpus = self.gpus
        if src.__class__ is int and dst.__class__ is int and 0 <= src < len(gpus) > dst >= 0:
            return list(self._router.route(gpus[src], gpus[dst]))  # the hot path
        return list(self._router.route(self.gpu(src), self.gpu(dst)))

    def path_latency(self, src: GpuRef, dst: GpuRef) -> float:
        """Sum of the latencies along the route (s); 0 from a GPU to itself."""
        return segment_cost(self.graph, self._router.route(self.gpu(src), self.gpu(dst)))[0]

    def path_bandwidth(self, src: GpuRef, dst: GpuRef) -> float:
        """Bottleneck bandwidth of the route (bytes/s); 0 from a GPU to itself."""
        a, b = self.gpu(src), self.gpu(dst)
        return 0.0 if a == b else segment_cost(self.graph, self._router.route(a, b))[1]

    def latency_matrix(self) -> np.ndarray:
        """(p, p) route latencies in seconds, rank order, 0 on the diagonal."""
        return self._all_pairs()[0].copy()

    def bandwidth_matrix(self) -> np.ndarray:
        """(p, p) route bottleneck bandwidths in bytes/s, rank order, 0 on the diagonal."""
        return self._all_pairs()[1].copy()

    def pair_matrices(self, dtype: type = np.float64) -> tuple[np.ndarray, np.ndarray]:
        """``(latency, bandwidth)`` computed fresh in ``dtype`` (float32 halves the memory)."""
        return all_pairs(self.graph, self._router, self.gpus, dtype=dtype)

    def _all_pairs(self) -> tuple[np.ndarray, np.ndarray]:
        if self._matrices is None:
            self._matrices = all_pairs(self.graph, self._router, self.gpus)
        return self._matrices

    def intra_host_matrix(self, host: str) -> tuple[np.ndarray, np.ndarray]:
        """``(latency, bandwidth)`` among the GPUs of one host, (k, k), rank order."""
        members = self.gpus_on(host)
        if not members:
            raise TopologyError(f"no GPUs on host {host!r}")
        return intra_blocks(self.graph, self._router, members)

    def host_pair_matrix(self, src_host: str, dst_host: str) -> tuple[np.ndarray, np.ndarray]:
        """``(latency, bandwidth)`` from each GPU of ``src_host`` to each of ``dst_host``."""
        rows, cols = self.gpus_on(src_host), self.gpus_on(dst_host)
        if not rows or not cols:
            raise TopologyError(f"no GPUs on host {src_host!r} or {dst_host!r}")
        lat, bw = np.zeros((len(rows), len(cols))), np.zeros((len(rows), len(cols)))
        for i, a in enumerate(rows):
            for j, b in enumerate(cols):
                if a != b:
                    lat[i, j], bw[i, j] = segment_cost(self.graph, self._router.route(a, b))
        return lat, bw

    # -- presentation ------------------------------------------------------------------------
    def describe(self) -> str:
        """A few lines of summary: GPUs, hosts, links and typical routes."""
        from treeattn.topo.summary import describe

        return describe(self)

    def draw(self, path: str | Path) -> Path:
        """Write a PNG picture: GPUs coloured by host, links by kind."""
        from treeattn.topo.draw import draw

        return draw(self, Path(path))
