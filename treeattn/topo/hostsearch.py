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


def host_adjacency(g: nx.DiGraph, host: str, ref_bytes: float) -> tuple[dict, dict]:
    """``(adj, into)`` for the nodes of ``host``.

    ``adj[u] = (others, live, dead, gpus)``: ``others`` are u's routable non-GPU successors
    ``[(v, cost)]`` in graph order; ``live`` the same without dead ends, with their graph-order
    index; ``dead`` maps each dead end (a non-GPU successor whose only way on is back to u)
    to ``(index, cost)``; ``gpus`` maps GPU successors to their cost. ``into[y]`` lists the
    non-GPU nodes that have GPU ``y`` as a successor. A search for ``y`` then looks at a dead
    end only if it is ``y`` or leads to it, and at no GPU but ``y``: a switch or CPU with
    1024 GPUs or 1024 single-GPU bridges below it costs O(1) per search, not O(1024).
    """
    nodes, raw, into = g.nodes, {}, {}
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
                if nodes[u]["kind"] != "gpu":
                    into.setdefault(v, []).append(u)
            else:
                others.append((v, cost))
        raw[u] = (others, gpus)
    adj = {}
    for u, (others, gpus) in raw.items():
        live, dead = [], {}
        for i, (v, cost) in enumerate(others):
            if all(w == u for w, _ in raw[v][0]):
                dead[v] = (i, cost)
            else:
                live.append((i, v, cost))
        adj[u] = (others, live, dead, gpus)
    return adj, into


def search(
    g: nx.DiGraph, tables: tuple[dict, dict], x: str, y: str | None
) -> tuple[dict[str, float], list[str] | None]:
    """Dijkstra from ``x`` over ``tables`` (one host) never through a GPU: the distances, and
    the path to ``y`` (``None`` if there is none). Same costs and push order as networkx's
    ``dijkstra_path`` with the router's weight, so the same tie-breaking, minus the pushes
    that cannot reach ``y`` and the Python call per scanned edge."""
    adj, into = tables
    toward = [y] if y is None or y not in into else into[y] + [y]
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
            ends = [(dead[w][0], w, dead[w][1]) for w in toward if w in dead]
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
