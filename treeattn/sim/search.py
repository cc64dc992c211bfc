"""The ``searched`` tree: a greedy Fastest-Node-First construction from the topology matrices.

Cost of one partial message from ``u`` to ``v``: ``C[u, v] = send_s + latency[u, v] +
partial_bytes / bandwidth[u, v] + recv_s`` (topology all-pairs matrices plus the backend's
overheads), plus the merge the receiver does.

We build the *broadcast* tree greedily and run the reduce on its mirror image: a reduction
up a tree, played backwards in time, is a broadcast down the same tree with the same costs
(the links are full duplex and symmetric), so a tree that broadcasts fast also reduces fast.

Fastest Node First (after Banikazemi, Moorthy & Panda, ICPP 1998): every rank that already
has the result is *informed* and becomes free to send at ``ready[u]``. Repeatedly pick the
(informed ``u``, uninformed ``v``) pair whose delivery ``ready[u] + C[u, v]`` is earliest,
make ``u`` the parent of ``v``, charge ``u`` one more send overhead (posting is serial) and
set ``ready[v]`` to the delivery time. On a flat fabric this grows a binomial-like tree; on a
hierarchical one it first covers a host over its fast links, then reaches across the slow
links from many informed ranks in parallel. Best-candidate times are kept in a vector and
refreshed lazily when the chosen sender's ``ready`` has moved, so a step costs O(p) and the
whole construction O(p²) with numpy; the planner only searches up to a few hundred ranks.
"""

from __future__ import annotations

import numpy as np

from treeattn.sim.backend import BackendModel
from treeattn.sim.costs import resolve_backend
from treeattn.sim.trees import Tree
from treeattn.sim.workload import FP32


def cost_matrix(topology, message_bytes: float, backend: BackendModel) -> np.ndarray:
    """``C[u, v]``: seconds to deliver one message from ``u`` to ``v`` (∞ on the diagonal)."""
    lat = np.asarray(topology.latency_matrix(), dtype=float)
    bw = np.asarray(topology.bandwidth_matrix(), dtype=float)
    with np.errstate(divide="ignore"):
        cost = backend.send_s + lat + message_bytes / bw + backend.recv_s
    np.fill_diagonal(cost, np.inf)
    return cost


def fnf_tree(cost: np.ndarray, root: int, send_s: float) -> Tree:
    """Greedy Fastest-Node-First broadcast tree over the cost matrix (see module docstring)."""
    p = cost.shape[0]
    parent = np.full(p, -1)
    ready = np.full(p, np.inf)
    ready[root] = 0.0
    informed = np.zeros(p, dtype=bool)
    informed[root] = True
    best = cost[root].copy()
    best[root] = np.inf
    source = np.full(p, root)
    for _ in range(p - 1):
        while True:
            v = int(np.argmin(np.where(informed, np.inf, best)))
            u = int(source[v])
            if best[v] <= ready[u] + cost[u, v] + 1e-15:
                break
            times = np.where(informed, ready + cost[:, v], np.inf)
            source[v] = int(np.argmin(times))
            best[v] = times[source[v]]
        parent[v] = u
        informed[v] = True
        ready[v] = best[v]
        ready[u] += send_s
        improved = ready[v] + cost[v] < best
        best = np.where(improved, ready[v] + cost[v], best)
        source = np.where(improved, v, source)
    return Tree(root, tuple(int(x) for x in parent), "searched")


def searched_tree(topology, root: int = 0, backend=None, message_bytes: float | None = None,
                  model=None) -> Tree:
    """The FNF tree rooted at ``root`` for messages of ``message_bytes`` (a partial).

    >>> from treeattn.topo import Topology
    >>> t = searched_tree(Topology.from_spec("dgx-h100:nodes=2"), root=0)
    >>> t.world, t.root, t.shape
    (16, 0, 'searched')
    """
    backend = resolve_backend(topology, backend)
    if message_bytes is None:
        heads, dim = (model.n_heads, model.head_dim) if model is not None else (32, 128)
        message_bytes = FP32 * heads * (dim + 1)
    cost = cost_matrix(topology, message_bytes, backend)
    return fnf_tree(cost, root, backend.send_s)
