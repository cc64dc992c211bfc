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
    seg = _Segments(g, router, gpus, lat.dtype)
    p = len(gpus)
    k = _uniform_hosts(g, gpus)
    if k:
        _fill_by_host_class(seg, lat, bw, p // k, k)
        return
    block = max(1, (1 << 20) // p)
    cols = np.arange(p)
    for s in range(0, p, block):
        rows = np.arange(s, min(p, s + block))
        lat[s:s + len(rows)], bw[s:s + len(rows)] = seg.block(rows, cols)


class _Segments:
    """Per-GPU up/down segment costs and the leaf-to-leaf table, as numpy arrays."""

    def __init__(self, g, router, gpus, dtype) -> None:
        p = len(gpus)
        rails = sorted({router.rail_of(b) for b in gpus})
        self.rail_ix = np.array([rails.index(router.rail_of(b)) for b in gpus])
        leaves: dict[str, int] = {}
        self.up_lat, self.up_bw = np.zeros((p, len(rails))), np.zeros((p, len(rails)))
        self.up_leaf = np.zeros((p, len(rails)), dtype=np.int64)
        for i, a in enumerate(gpus):
            for r, rail in enumerate(rails):
                self.up_lat[i, r], self.up_bw[i, r], leaf = router.up_cost(a, rail)
                self.up_leaf[i, r] = leaves.setdefault(leaf, len(leaves))
        self.dn_lat, self.dn_bw = np.zeros(p), np.zeros(p)
        self.dn_leaf = np.zeros(p, dtype=np.int64)
        for j, b in enumerate(gpus):
            self.dn_lat[j], self.dn_bw[j], leaf = router.down_cost(b)
            self.dn_leaf[j] = leaves.setdefault(leaf, len(leaves))
        mid_lat, mid_bw = _mid_tables(
            g, router, leaves, self.up_leaf, self.dn_leaf, self.rail_ix, len(rails)
        )
        self.n = len(leaves)
        self.mid_lat, self.mid_bw = mid_lat.astype(dtype).ravel(), mid_bw.astype(dtype).ravel()
        for name in ("up_lat", "up_bw", "dn_lat", "dn_bw"):
            setattr(self, name, getattr(self, name).astype(dtype))

    def block(self, rows: np.ndarray, cols: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Cross-host ``(latency, bandwidth)`` for GPU indices ``rows`` x ``cols``."""
        r_ix = self.rail_ix[cols]
        flat = self.up_leaf[rows][:, r_ix] * self.n + self.dn_leaf[cols]  # (rows, cols)
        lat = self.up_lat[rows][:, r_ix] + self.mid_lat.take(flat)
        lat += self.dn_lat[cols]
        bw = np.minimum(self.up_bw[rows][:, r_ix], self.mid_bw.take(flat))
        np.minimum(bw, self.dn_bw[cols], out=bw)
        return lat, bw

    def host_key(self, lo: int, hi: int) -> bytes:
        """Bytes identifying the up-segments of GPUs ``lo:hi`` (one host)."""
        parts = (self.up_lat, self.up_bw, self.up_leaf)
        return b"|".join(np.ascontiguousarray(x[lo:hi]).tobytes() for x in parts)


def _uniform_hosts(g, gpus) -> int:
    """GPUs per host when ranks are host-contiguous with equal counts, else 0."""
    hosts = [g.nodes[x]["host"] for x in gpus]
    k = hosts.count(hosts[0])
    if len(hosts) % k:
        return 0
    for h in range(0, len(hosts), k):
        if len(set(hosts[h:h + k])) != 1 or (h and hosts[h] == hosts[h - 1]):
            return 0
    return k


def _fill_by_host_class(seg: _Segments, lat, bw, n_hosts: int, k: int) -> None:
    """Hosts whose GPUs have identical up-segments share their rows of the matrices: compute
    one (k, p) strip per class of hosts and copy it to every host of the class."""
    classes: dict[bytes, list[int]] = {}
    for h in range(n_hosts):
        classes.setdefault(seg.host_key(h * k, (h + 1) * k), []).append(h)
    p = n_hosts * k
    lat3, bw3 = lat.reshape(n_hosts, k, p), bw.reshape(n_hosts, k, p)
    cols = np.arange(p)
    for hosts in classes.values():
        s_lat, s_bw = seg.block(np.arange(hosts[0] * k, (hosts[0] + 1) * k), cols)
        i = _host_index(hosts)
        lat3[i] = s_lat
        bw3[i] = s_bw


def _host_index(hosts: list[int]) -> slice | list[int]:
    if hosts[-1] - hosts[0] == len(hosts) - 1:
        return slice(hosts[0], hosts[-1] + 1)
    return hosts


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
