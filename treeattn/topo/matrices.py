"""All-pairs route latency and bottleneck bandwidth, vectorised over the segment structure.

A cross-host route is ``up(a, rail(b)) + mid(leaf_s, leaf_d) + down(b)`` (see
:mod:`treeattn.topo.routing`), so its latency is a sum and its bandwidth a minimum of three
per-segment figures. Those are gathered into small arrays (``p x rails``, ``leaves x leaves``,
``p``) and combined with numpy in row blocks, which keeps temporaries small even for 16384
GPUs. Same-host blocks are computed once per host template and copied.
"""

from __future__ import annotations

import networkx as nx
import numpy as np

from treeattn.topo.routing import Edge, Router, _cost


def segment_cost(g: nx.DiGraph, edges: tuple[Edge, ...]) -> tuple[float, float]:
    """``(sum of latencies, min of bandwidths)``; ``(0, inf)`` for no edges."""
    return _cost(g, edges)


def intra_blocks(
    g: nx.DiGraph, router: Router, members: list[str]
) -> tuple[np.ndarray, np.ndarray]:
    """Latency and bandwidth among the GPUs ``members`` of one host, shape (k, k)."""
    k = len(members)
    lat, bw = np.zeros((k, k)), np.zeros((k, k))
    for i, a in enumerate(members):
        for j, b in enumerate(members):
            if i != j:
                lat[i, j], bw[i, j] = segment_cost(g, router.route(a, b))
    return lat, bw


def all_pairs(
    g: nx.DiGraph, router: Router, gpus: list[str], dtype: type = np.float64
) -> tuple[np.ndarray, np.ndarray]:
    """``(latency, bandwidth)`` matrices (p, p) over ``gpus`` in rank order, 0 on the diagonal."""
    p = len(gpus)
    by_host: dict[str, list[int]] = {}
    for i, gpu in enumerate(gpus):
        by_host.setdefault(g.nodes[gpu]["host"], []).append(i)
    lat = np.zeros((p, p), dtype=dtype)
    bw = np.zeros((p, p), dtype=dtype)
    if len(by_host) > 1:
        _fill_cross(g, router, gpus, lat, bw)
    _fill_intra(g, router, gpus, by_host, lat, bw)
    np.fill_diagonal(lat, 0.0)
    np.fill_diagonal(bw, 0.0)
    return lat, bw


def _fill_intra(g, router, gpus, by_host, lat, bw) -> None:
    cache: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
    for host, idx in by_host.items():
        rep = router.rep(host)
        local = tuple(gpus[i][len(host):] for i in idx)  # GPU names without the host prefix
        key = (rep, local)
        if key not in cache:
            members = [rep + name for name in local] if rep != host else [gpus[i] for i in idx]
            cache[key] = intra_blocks(g, router, members)
        ix = np.ix_(idx, idx)
        lat[ix], bw[ix] = cache[key]


def _fill_cross(g, router, gpus, lat, bw) -> None:
    p = len(gpus)
    rails = sorted({router.rail_of(b) for b in gpus})
    rail_ix = np.array([rails.index(router.rail_of(b)) for b in gpus])
    leaves: dict[str, int] = {}
    up_lat, up_bw = np.zeros((p, len(rails))), np.zeros((p, len(rails)))
    up_leaf = np.zeros((p, len(rails)), dtype=np.int64)
    for i, a in enumerate(gpus):
        for r, rail in enumerate(rails):
            up_lat[i, r], up_bw[i, r], leaf = router.up_cost(a, rail)
            up_leaf[i, r] = leaves.setdefault(leaf, len(leaves))
    dn_lat, dn_bw = np.zeros(p), np.zeros(p)
    dn_leaf = np.zeros(p, dtype=np.int64)
    for j, b in enumerate(gpus):
        dn_lat[j], dn_bw[j], leaf = router.down_cost(b)
        dn_leaf[j] = leaves.setdefault(leaf, len(leaves))
    mid_lat, mid_bw = _mid_tables(g, router, leaves, up_leaf, dn_leaf, rail_ix, len(rails))
    n, dt = len(leaves), lat.dtype
    mid_lat, mid_bw = mid_lat.astype(dt).ravel(), mid_bw.astype(dt).ravel()
    up_lat, up_bw, dn_lat, dn_bw = (x.astype(dt) for x in (up_lat, up_bw, dn_lat, dn_bw))
    block = max(1, (1 << 20) // p)
    for s in range(0, p, block):
        rows = slice(s, min(p, s + block))
        flat = up_leaf[rows].take(rail_ix, axis=1) * n + dn_leaf  # (rows, p)
        np.add(up_lat[rows].take(rail_ix, axis=1), mid_lat.take(flat), out=lat[rows])
        lat[rows] += dn_lat
        np.minimum(up_bw[rows].take(rail_ix, axis=1), mid_bw.take(flat), out=bw[rows])
        np.minimum(bw[rows], dn_bw, out=bw[rows])


def _mid_tables(g, router, leaves, up_leaf, dn_leaf, rail_ix, n_rails):
    names = sorted(leaves, key=leaves.get)
    n = len(names)
    mid_lat, mid_bw = np.full((n, n), np.nan), np.full((n, n), np.nan)
    for r in range(n_rails):
        srcs = np.unique(up_leaf[:, r])
        dsts = np.unique(dn_leaf[rail_ix == r])
        for s in srcs:
            for d in dsts:
                if np.isnan(mid_lat[s, d]):
                    edges = router.mid(names[s], names[d])
                    mid_lat[s, d], mid_bw[s, d] = segment_cost(g, edges)
    return mid_lat, mid_bw
