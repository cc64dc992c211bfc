"""Graph construction helpers and validation shared by the builders, importers and JSON.

A physical full-duplex link is two directed edges; :meth:`GraphBuilder.link` adds both, each
with its own per-direction ``bandwidth`` (bytes/s), ``latency`` (s), ``kind`` and ``count``.
"""

from __future__ import annotations

import math

import networkx as nx

from treeattn.topo.errors import TopologyError

NODE_KINDS = ("gpu", "nvswitch", "pcie_switch", "cpu", "nic", "net_switch")
LINK_KINDS = ("nvlink", "xgmi", "pcie", "upi", "ib", "loopback")
# Physical sanity ranges of a directed edge, so that no cost turns into inf/0 downstream:
# 1 kB/s (a denormal bandwidth makes a transfer time overflow) to 1 PB/s (1000x NVLink5), and
# latency from 0 to 1 s. ``count`` (bonded links) is at most 4096 (a bonded spine uplink).
MIN_BANDWIDTH, MAX_BANDWIDTH = 1e3, 1e15
MAX_LATENCY = 1.0
MAX_COUNT = 4096


class GraphBuilder:
    """Build a topology graph node by node, refusing duplicate names.

    >>> b = GraphBuilder()
    >>> b.node("n0/gpu0", "gpu", "n0", model="H100", rank=0)
    'n0/gpu0'
    >>> b.node("n0/cpu0", "cpu", "n0")
    'n0/cpu0'
    >>> b.link("n0/gpu0", "n0/cpu0", "pcie", 25e9, 1e-6)
    >>> b.graph.number_of_edges()
    2
    """

    def __init__(self) -> None:
        self.graph = nx.DiGraph()

    def node(self, name: str, kind: str, host: str, **attrs: object) -> str:
        if name in self.graph:
            raise TopologyError(f"duplicate node name {name!r}")
        self.graph.add_node(name, kind=kind, host=host, **attrs)
        return name

    def link(
        self, u: str, v: str, kind: str, bandwidth: float, latency: float, count: int = 1,
        **attrs: object,
    ) -> None:
        """Add the full-duplex link ``u <-> v`` as two directed edges with equal attributes."""
        for a, b in ((u, v), (v, u)):
            if self.graph.has_edge(a, b):
                raise TopologyError(f"duplicate link {a} -> {b}")
            self.graph.add_edge(
                a, b, kind=kind, bandwidth=float(bandwidth), latency=float(latency),
                count=int(count), **attrs,
            )


def validate_graph(g: nx.DiGraph) -> list[str]:
    """Check a topology graph; return its GPUs in rank order or raise :class:`TopologyError`.

    >>> b = GraphBuilder()
    >>> _ = b.node("h/gpu0", "gpu", "h", rank=0)
    >>> validate_graph(b.graph)
    ['h/gpu0']
    """
    if not isinstance(g, nx.DiGraph) or g.is_multigraph():
        raise TopologyError("a topology graph must be a networkx.DiGraph")
    for name, data in g.nodes(data=True):
        _check_node(name, data)
    for u, v, data in g.edges(data=True):
        _check_edge(u, v, data)
    gpus = _ranked_gpus(g)
    _check_reachable(g, gpus)
    return gpus


def _check_node(name: object, data: dict) -> None:
    if not isinstance(name, str) or not name:
        raise TopologyError(f"node name {name!r} is not a non-empty string")
    kind = data.get("kind")
    if kind not in NODE_KINDS:
        raise TopologyError(f"node {name}: unknown kind {kind!r} (known: {', '.join(NODE_KINDS)})")
    if not isinstance(data.get("host"), str) or not data["host"]:
        raise TopologyError(f"node {name}: missing host")


def _check_edge(u: str, v: str, data: dict) -> None:
    if u == v:
        raise TopologyError(f"edge {u} -> {v}: self-loop")
    kind = data.get("kind")
    if kind not in LINK_KINDS:
        raise TopologyError(
            f"edge {u} -> {v}: unknown kind {kind!r} (known: {', '.join(LINK_KINDS)})"
        )
    bw = data.get("bandwidth")
    if not _in_range(bw, MIN_BANDWIDTH, MAX_BANDWIDTH):
        raise TopologyError(
            f"edge {u} -> {v}: bandwidth {_show(bw)} B/s is not a number in "
            f"[{MIN_BANDWIDTH:g}, {MAX_BANDWIDTH:g}]"
        )
    lat = data.get("latency")
    if not _in_range(lat, 0.0, MAX_LATENCY):
        raise TopologyError(
            f"edge {u} -> {v}: latency {_show(lat)} s is not a number in [0, {MAX_LATENCY:g}]"
        )
    count = data.get("count", 1)
    if not isinstance(count, int) or isinstance(count, bool) or not 1 <= count <= MAX_COUNT:
        raise TopologyError(
            f"edge {u} -> {v}: count {_show(count)} is not an integer in [1, {MAX_COUNT}]"
        )


def _in_range(x: object, lo: float, hi: float) -> bool:
    """A finite int/float in ``[lo, hi]``; huge integers compare without float overflow."""
    if not isinstance(x, (int, float)) or isinstance(x, bool):
        return False
    return (not isinstance(x, float) or math.isfinite(x)) and lo <= x <= hi


def _show(x: object) -> str:
    """``repr`` of a value, cut short (a 400-digit integer must not flood the message)."""
    text = repr(x) if not isinstance(x, int) or abs(x) < 10**30 else f"<{len(str(x))}-digit int>"
    return text if len(text) <= 40 else text[:37] + "..."


def _ranked_gpus(g: nx.DiGraph) -> list[str]:
    gpus = [n for n, d in g.nodes(data=True) if d["kind"] == "gpu"]
    if not gpus:
        raise TopologyError("topology has no GPU")
    ranks = {}
    for n in gpus:
        r = g.nodes[n].get("rank")
        if not isinstance(r, int) or isinstance(r, bool) or not 0 <= r < len(gpus):
            raise TopologyError(f"node {n}: rank {r!r} is not an integer in [0, {len(gpus)})")
        if r in ranks:
            raise TopologyError(f"node {n}: duplicate rank {r} (also {ranks[r]})")
        ranks[r] = n
    return [ranks[r] for r in range(len(gpus))]


def _check_reachable(g: nx.DiGraph, gpus: list[str]) -> None:
    first = gpus[0]
    down = nx.descendants(g, first)
    up = nx.ancestors(g, first)
    for n in gpus[1:]:
        if n not in down:
            raise TopologyError(f"GPU {n} cannot be reached from GPU {first} (disconnected)")
        if n not in up:
            raise TopologyError(f"GPU {n} cannot reach GPU {first} (disconnected)")
