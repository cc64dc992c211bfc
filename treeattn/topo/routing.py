"""Routing: the directed edges a message between two GPUs crosses, by structural rules.

Rules (the same ones NCCL/RCCL follow):

* **Same host, direct peer link** (NVLink bridge, xGMI mesh): the one edge ``a -> b``.
* **Same host, peer-to-peer** (NVSwitch, PCIe P2P): the cheapest path inside the host that
  does not pass through another GPU. Edge cost is ``latency + 64 KiB / bandwidth``, so
  NVLink beats PCIe. NVSwitch chips that forward in parallel are represented by one logical
  switch node (see :mod:`treeattn.topo.fabric`); the physical chips are never
  routed. Two P2P GPUs on the same logical switch take GPU -> switch -> GPU without a search
  (the switch's bonded edges are the cheapest way out of a GPU), so a 72-GPU NVLink domain
  costs a dict look-up per pair.
* **Same host, no P2P** (GPU attr ``p2p=False``, e.g. GeForce RTX 4090): through host memory,
  i.e. GPU -> nearest ``cpu`` -> (UPI -> other ``cpu``) -> GPU.
* **Between hosts** (rail-optimized, NCCL's PXN): the destination GPU's own NIC fixes the rail
  ``r``. The source uses its host's rail-``r`` NIC: its own when it is on rail ``r``, else the
  rail-``r`` NIC's GPU is reached first over NVLink/xGMI (PXN). Without a peer link the source
  goes to that NIC over PCIe/host memory. Then NIC -> leaf (-> spine -> leaf) -> NIC -> GPU.
  A GPU without GPUDirect (``p2p=False``) stages through host memory on both ends.

Routes are built from cached segments (``up`` to the leaf, ``mid`` between leaves, ``down``
from the leaf), so all-pairs routing of thousands of GPUs costs a few dict look-ups per pair.
"""

from __future__ import annotations

from collections.abc import Callable

import networkx as nx

from treeattn.topo.errors import TopologyError
from treeattn.topo.hostsearch import host_adjacency, search

Edge = tuple[str, str]
REF_BYTES = 65536.0  # message size the path cost is tuned for


class Router:
    """Cached structural routing on a validated topology graph."""

    def __init__(self, graph: nx.DiGraph, gpus: list[str]) -> None:
        self.g = graph
        self.gpus = gpus
        self._intra: dict[Edge, tuple[Edge, ...]] = {}
        self._up: dict[tuple[str, str], tuple[tuple[Edge, ...], str]] = {}
        self._down: dict[str, tuple[str, tuple[Edge, ...]]] = {}
        self._mid: dict[Edge, tuple[Edge, ...]] = {}
        self._nearest_cpu: dict[str, str] = {}
        self._paths: dict[Edge, list[str]] = {}
        self._reps: dict[str, str] | None = None
        self._leaves: dict[tuple[str, bool], str] = {}
        self._switch_adj: dict[tuple[str, bool], list[str]] = {}
        self._up_cost: dict[tuple[str, str], tuple[float, float, str]] = {}
        self._down_cost: dict[str, tuple[float, float]] = {}
        self._rail_nics: dict[tuple[str, str], str] = {}
        self._adj: dict[str, dict[str, tuple[list, dict]]] = {}
        for n, data in graph.nodes(data=True):
            if data["kind"] == "nic":
                self._rail_nics.setdefault((data["host"], str(data.get("rail", n))), n)
        self._logical: dict[str, str | None] = {}
        self._owner: dict[str, str] = {}
        self._gpu_host = {gpu: graph.nodes[gpu]["host"] for gpu in gpus}
        self._gpu_rail: dict[str, str] = {}
        for gpu in gpus:
            nic = graph.nodes[gpu].get("nic")
            if isinstance(nic, str):
                self._owner.setdefault(nic, gpu)

    # -- public ----------------------------------------------------------------------------
    def route(self, a: str, b: str) -> tuple[Edge, ...]:
        """Edges from GPU ``a`` to GPU ``b`` (empty when ``a == b``)."""
        if a == b:
            return ()
        if self._gpu_host[a] == self._gpu_host[b]:
            hit = self._intra.get((a, b))
            return hit if hit is not None else self.intra(a, b)
        rail = self._gpu_rail.get(b)
        if rail is None:
            rail = self._gpu_rail[b] = self.rail_of(b)
        up = self._up.get((a, rail)) or self.up(a, rail)
        down = self._down.get(b) or self.down(b)
        if up[1] == down[0]:
            return up[0] + down[1]
        return up[0] + self.mid(up[1], down[0]) + down[1]

    def host(self, n: str) -> str:
        return self.g.nodes[n]["host"]

    def rail_of(self, gpu: str) -> str:
        nic = self._gpu_nic(gpu)
        return str(self.g.nodes[nic].get("rail", nic))

    # -- same host ---------------------------------------------------------------------------
    def intra(self, a: str, b: str) -> tuple[Edge, ...]:
        key = (a, b)
        if key not in self._intra:
            sw = self.logical_switch(a)
            if self.g.has_edge(a, b) and self.g.edges[a, b]["kind"] in ("nvlink", "xgmi"):
                path = (a, b)
            elif sw is not None and sw == self.logical_switch(b) and self._p2p(a) and self._p2p(b):
                path = (a, sw, b)
            else:
                path = self._host_path(a, b, via_cpu=not (self._p2p(a) and self._p2p(b)))
            self._intra[key] = _edges(path)
        return self._intra[key]

    def logical_switch(self, gpu: str) -> str | None:
        """The logical NVSwitch ``gpu`` has a two-way NVLink edge to, if any (cached)."""
        if gpu not in self._logical:
            hit = None
            for v, d in self.g.adj[gpu].items():
                if (d.get("logical") and d["kind"] == "nvlink"
                        and self.g.nodes[v]["kind"] == "nvswitch" and self.g.has_edge(v, gpu)):
                    hit = v
                    break
            self._logical[gpu] = hit
        return self._logical[gpu]

    def _p2p(self, n: str) -> bool:
        return bool(self.g.nodes[n].get("p2p", True))

    def _host_path(self, x: str, y: str, via_cpu: bool) -> list[str]:
        """Cheapest path ``x -> y`` inside their host avoiding other GPUs; via a CPU if asked."""
        if not via_cpu:
            return self._dijkstra(x, y)
        cx, cy = self.nearest_cpu(x), self.nearest_cpu(y)
        path = self._dijkstra(x, cx)
        if cy != cx:
            path += self._dijkstra(cx, cy)[1:]
        return path + self._dijkstra(cy, y)[1:]

    def nearest_cpu(self, x: str) -> str:
        """The ``cpu`` node closest to ``x`` inside its host (its NUMA socket)."""
        host = self.host(x)
        rep = self.rep(host)
        if rep != host:
            return _rename(self.nearest_cpu(_rename(x, host, rep)), rep, host)
        if x not in self._nearest_cpu:
            dist = self._fast_search(x, None, host)[0]
            cpus = [n for n in dist if self.g.nodes[n]["kind"] == "cpu"]
            if not cpus:
                raise TopologyError(f"no route from {x} to host memory: host has no cpu node")
            self._nearest_cpu[x] = min(cpus, key=lambda n: (dist[n], n))
        return self._nearest_cpu[x]

    def _dijkstra(self, x: str, y: str) -> list[str]:
        """Cheapest host-local path, computed once per host *template* and renamed."""
        if x == y:
            return [x]
        host = self.host(x)
        rep = self.rep(host)
        if rep != host:
            path = self._dijkstra(_rename(x, host, rep), _rename(y, host, rep))
            return [_rename(n, rep, host) for n in path]
        key = (x, y)
        if key not in self._paths:
            self._paths[key] = self._search(x, y, host)
        return list(self._paths[key])

    def _search(self, x: str, y: str, host: str) -> list[str]:
        """Avoid other GPUs; only when that is impossible forward through them (NCCL's NVB)."""
        path = self._fast_search(x, y, host)[1]
        if path is not None:
            return path
        try:
            return nx.dijkstra_path(self.g, x, y, weight=self._weight(x, y, True))
        except nx.NetworkXNoPath:
            raise TopologyError(f"no route from {x} to {y} inside host {host}") from None

    def _fast_search(
        self, x: str, y: str | None, host: str
    ) -> tuple[dict[str, float], list[str] | None]:
        """Host-local Dijkstra never through a GPU (see :mod:`treeattn.topo.hostsearch`)."""
        adj = self._adj.get(host)
        if adj is None:
            adj = self._adj[host] = host_adjacency(self.g, host, REF_BYTES)
        return search(self.g, adj, x, y)

    def rep(self, host: str) -> str:
        """The first host with the same internal structure as ``host`` (its template)."""
        if self._reps is None:
            self._reps = host_templates(self.g)
        return self._reps.get(host, host)

    def _weight(
        self, x: str, y: str | None, through_gpus: bool = False
    ) -> Callable[[str, str, dict], float | None]:
        """Edge cost restricted to the host of ``x``, never through GPUs or parallel chips."""
        nodes, host = self.g.nodes, self.host(x)

        def weight(u: str, v: str, d: dict) -> float | None:
            nv = nodes[v]
            if nv["host"] != host or "routed_via" in nv:
                return None
            if nv["kind"] == "gpu" and v != y and not through_gpus:
                return None
            return d["latency"] + REF_BYTES / d["bandwidth"]

        return weight

    # -- between hosts -----------------------------------------------------------------------
    def _gpu_nic(self, gpu: str) -> str:
        nic = self.g.nodes[gpu].get("nic")
        if not isinstance(nic, str) or nic not in self.g:
            raise TopologyError(f"GPU {gpu} has no NIC, so it cannot reach other hosts")
        return nic

    def rail_nic(self, host: str, rail: str) -> str | None:
        """The NIC of ``host`` on ``rail`` (``None`` when the host has none)."""
        return self._rail_nics.get((host, rail))

    def up(self, a: str, rail: str) -> tuple[tuple[Edge, ...], str]:
        """Edges from GPU ``a`` up to the leaf switch of its host's rail-``rail`` NIC."""
        key = (a, rail)
        if key not in self._up:
            own = self._gpu_nic(a)
            nic = self.rail_nic(self.host(a), rail) or own
            if nic == own:
                edges = _edges(self._host_path(a, nic, via_cpu=not self._p2p(a)))
            else:
                edges = self._pxn(a, nic)
            leaf = self._leaf_of(nic, out=True)
            self._up[key] = (edges + ((nic, leaf),), leaf)
        return self._up[key]

    def up_cost(self, a: str, rail: str) -> tuple[float, float, str]:
        """``(latency, bandwidth, leaf)`` of :meth:`up`, computed once per host template."""
        host = self.host(a)
        rep = self.rep(host)
        key = (_rename(a, host, rep), rail)
        if key not in self._up_cost:
            edges, _ = self.up(key[0], rail)
            self._up_cost[key] = (*_cost(self.g, edges[:-1]), edges[-1][0])
        lat, bw, nic = self._up_cost[key]
        nic = _rename(nic, rep, host)
        leaf = self._leaf_of(nic, out=True)
        d = self.g.edges[nic, leaf]
        return lat + d["latency"], min(bw, d["bandwidth"]), leaf

    def down_cost(self, b: str) -> tuple[float, float, str]:
        """``(latency, bandwidth, leaf)`` of :meth:`down`, computed once per host template."""
        host = self.host(b)
        rep = self.rep(host)
        key = _rename(b, host, rep)
        if key not in self._down_cost:
            _, edges = self.down(key)
            self._down_cost[key] = _cost(self.g, edges[1:])
        nic = self._gpu_nic(b)
        leaf = self._leaf_of(nic, out=False)
        d = self.g.edges[leaf, nic]
        lat, bw = self._down_cost[key]
        return lat + d["latency"], min(bw, d["bandwidth"]), leaf

    def _pxn(self, a: str, nic: str) -> tuple[Edge, ...]:
        """PXN: over NVLink/xGMI to the GPU that owns ``nic``, then its PCIe to the NIC."""
        proxy = self._owner.get(nic)
        if proxy is not None and self._p2p(a) and self._p2p(proxy):
            hop = self.intra(a, proxy)
            if all(self.g.edges[e]["kind"] in ("nvlink", "xgmi") for e in hop):
                return hop + _edges(self._host_path(proxy, nic, via_cpu=False))
        return _edges(self._host_path(a, nic, via_cpu=not self._p2p(a)))

    def down(self, b: str) -> tuple[str, tuple[Edge, ...]]:
        """Edges from the leaf of GPU ``b``'s own NIC down to ``b``."""
        if b not in self._down:
            nic = self._gpu_nic(b)
            leaf = self._leaf_of(nic, out=False)
            path = self._host_path(nic, b, via_cpu=not self._p2p(b))
            self._down[b] = (leaf, ((leaf, nic),) + _edges(path))
        return self._down[b]

    def _leaf_of(self, nic: str, out: bool) -> str:
        hit = self._leaves.get((nic, out))
        if hit is not None:
            return hit
        nbrs = self.g.successors(nic) if out else self.g.predecessors(nic)
        for n in nbrs:
            if self.g.nodes[n]["kind"] == "net_switch":
                self._leaves[nic, out] = n
                return n
        raise TopologyError(f"NIC {nic} is not connected to a network switch")

    def _switch_nbrs(self, leaf: str, out: bool) -> list[str]:
        """Network switches after (``out``) or before ``leaf``, sorted (cached)."""
        key = (leaf, out)
        if key not in self._switch_adj:
            nbrs = self.g.successors(leaf) if out else self.g.predecessors(leaf)
            self._switch_adj[key] = sorted(
                n for n in nbrs if self.g.nodes[n]["kind"] == "net_switch"
            )
        return self._switch_adj[key]

    def mid(self, leaf_s: str, leaf_d: str) -> tuple[Edge, ...]:
        """Edges between two leaves: none, one spine (deterministic ECMP choice) or a path."""
        if leaf_s == leaf_d:
            return ()
        key = (leaf_s, leaf_d)
        hit = self._mid.get(key)
        if hit is not None:
            return hit
        ups = set(self._switch_nbrs(leaf_s, out=True))
        common = [n for n in self._switch_nbrs(leaf_d, out=False) if n in ups]
        if self.g.has_edge(leaf_s, leaf_d):
            path = [leaf_s, leaf_d]
        elif common:
            path = [leaf_s, common[_stable_hash(leaf_s, leaf_d) % len(common)], leaf_d]
        else:
            path = self._fabric_path(leaf_s, leaf_d)
        self._mid[key] = _edges(path)
        return self._mid[key]

    def _fabric_path(self, x: str, y: str) -> list[str]:
        nodes = self.g.nodes

        def weight(u: str, v: str, d: dict) -> float | None:
            if nodes[v]["kind"] != "net_switch":
                return None
            return d["latency"] + REF_BYTES / d["bandwidth"]

        try:
            return nx.dijkstra_path(self.g, x, y, weight=weight)
        except nx.NetworkXNoPath:
            raise TopologyError(f"no network route from switch {x} to switch {y}") from None


def host_templates(g: nx.DiGraph) -> dict[str, str]:
    """Map every host to the first host with an identical internal structure.

    Two hosts match when their nodes, named ``HOST/local``, have the same local names and
    attributes, and their host-internal edges the same ``kind``, ``bandwidth`` and
    ``latency`` (all that routing reads). A host whose nodes do not all follow the ``HOST/``
    naming is its own template.
    """
    sigs: dict[str, list] = {}
    bad: set[str] = set()
    host_of, local = {}, {}
    for n, d in g.nodes(data=True):
        host = host_of[n] = d["host"]
        local[n] = n[len(host) + 1:]
        if not n.startswith(host + "/"):
            bad.add(host)
        sigs.setdefault(host, []).append((local[n], _freeze(d, host)))
    for u, nbrs in g.adj.items():
        host, lu = host_of[u], local[u]
        sig = sigs[host]
        for v, d in nbrs.items():
            if host_of[v] == host:
                sig.append((lu, local[v], d["kind"], d["bandwidth"], d["latency"]))
    reps: dict[str, str] = {}
    first: dict[frozenset, str] = {}
    for host, sig in sigs.items():
        reps[host] = host if host in bad else first.setdefault(frozenset(sig), host)
    return reps


def _freeze(d: dict, host: str) -> tuple:
    """Hashable, host-independent form of an attribute dict (ranks dropped)."""
    p = host + "/"
    items = []
    for k, v in sorted(d.items()):
        if k in ("rank", "host"):
            continue
        if isinstance(v, str) and v.startswith(p):
            v = v[len(p):]
        items.append((k, v if isinstance(v, (str, int, float, bool, type(None))) else repr(v)))
    return tuple(items)


def _rename(n: str, old_host: str, new_host: str) -> str:
    return new_host + n[len(old_host):]


def _edges(path: list[str] | tuple[str, ...]) -> tuple[Edge, ...]:
    return tuple(zip(path[:-1], path[1:], strict=True))


def _cost(g: nx.DiGraph, edges: tuple[Edge, ...]) -> tuple[float, float]:
    lat, bw = 0.0, float("inf")
    for e in edges:
        d = g.edges[e]
        lat += d["latency"]
        bw = min(bw, d["bandwidth"])
    return lat, bw


def _stable_hash(a: str, b: str) -> int:
    """A deterministic hash of two names (Python's ``hash`` of str is salted per process)."""
    h = 0
    for ch in a + "|" + b:
        h = (h * 131 + ord(ch)) & 0xFFFFFFFF
    return h
