"""Host-local shortest paths that never pass through a GPU, in time independent of fan-out.

Why: routing a message inside a host is a Dijkstra search that may not cross other GPUs.
With networkx and a weight callback, a switch or CPU with 1024 GPUs (or 1024 single-GPU
bridges) below it made every search scan all of them, and importing a 1024-GPU file took
minutes. Here each node's successors are pre-split into non-GPU ones, dead ends and GPUs,
so a targeted search only looks at what can lead to its target. The search pushes in
networkx's order, so it returns the same paths as ``nx.dijkstra_path`` with
:meth:`treeattn.topo.routing.Router._weight`.
"""

from __future__ import annotations

import heapq
from itertools import count

import networkx as nx


def host_adjacency(g: nx.DiGraph, host: str, ref_bytes: float) -> dict[str, tuple]:
    """Per node of ``host``: ``(others, live, dead, gpus)``. ``others`` are its routable
    non-GPU successors ``[(v, cost)]`` in graph order; ``live`` the same without dead
    ends, with their graph-order index; ``dead`` maps a target to the dead ends (non-GPU
    successors whose only way on is back) that lead to it or are it; ``gpus`` maps GPU
    successors to their cost. A targeted search then scans neither the 1024 GPUs nor the
    1024 single-GPU bridges of a switch or CPU."""
    nodes, raw = g.nodes, {}
    for u, nbrs in g.adj.items():
        if nodes[u]["host"] != host:
            continue
        others, gpus = [], {}
        for v, d in nbrs.items():
            nv = nodes[v]
            if nv["host"] != host or "routed_via" in nv:
                continue
            cost = d["latency"] + ref_bytes / d["bandwidth"]
            if nv["kind"] == "gpu":
                gpus[v] = cost
            else:
                others.append((v, cost))
        raw[u] = (others, gpus)
    adj = {}
    for u, (others, gpus) in raw.items():
        live, dead = [], {}
        for i, (v, cost) in enumerate(others):
            if all(w == u for w, _ in raw[v][0]):
                for key in (v, *raw[v][1]):
                    dead.setdefault(key, []).append((i, v, cost))
            else:
                live.append((i, v, cost))
        adj[u] = (others, live, dead, gpus)
    return adj


def search(
    g: nx.DiGraph, adj: dict[str, tuple], x: str, y: str | None
) -> tuple[dict[str, float], list[str] | None]:
    """Dijkstra from ``x`` over ``adj`` (one host) never through a GPU: the distances, and
    the path to ``y`` (``None`` if there is none). Same costs and push order as networkx's
    ``dijkstra_path`` with the router's weight, so the same tie-breaking, minus the pushes
    that cannot reach ``y`` and the Python call per scanned edge."""
    dist: dict[str, float] = {}
    seen = {x: 0.0}
    paths = {x: [x]}
    c = count(1)
    fringe: list = [(0.0, 0, x)]
    while fringe:
        d, _, v = heapq.heappop(fringe)
        if v in dist:
            continue
        dist[v] = d
        if v == y:
            return dist, paths[v]
        if v != x and g.nodes[v]["kind"] == "gpu":
            continue
        others, live, dead, gpus = adj[v]
        if y is None:
            relax = others
        else:
            ends = dead.get(y)
            relax = [(u, cost) for _, u, cost in (sorted(live + ends) if ends else live)]
            if y in gpus:
                relax.append((y, gpus[y]))
        for u, cost in relax:
            vu = d + cost
            if u not in dist and (u not in seen or vu < seen[u]):
                seen[u] = vu
                heapq.heappush(fringe, (vu, next(c), u))
                paths[u] = paths[v] + [u]
    return dist, None
