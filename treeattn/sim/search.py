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
make ``u`` the parent of ``v``, charge ``u`` the time one more child costs it and set
``ready[v]`` to the delivery time. A child costs its parent a send overhead on the way down
and, on the way up, a receive overhead plus one merge, both serial at the parent; charging
only the send would make a flat star look free on fabrics with cheap sends. On a flat fabric
this grows a binomial-like tree; on a hierarchical one it first covers a host over its fast
links, then reaches across the slow links from many informed ranks in parallel.
Best-candidate times are kept in a vector and refreshed lazily when the chosen sender's
``ready`` has moved (``ready`` only grows, so a stale entry is too low, never too high), so
a step costs O(p) and the
whole construction O(p²) with numpy; the planner only searches up to a few hundred ranks.
"""

from __future__ import annotations

import numpy as np

from treeattn.sim.backend import BackendModel
from treeattn.sim.costs import resolve_backend, resolve_hardware
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


def fnf_tree(cost: np.ndarray, root: int, per_child_s: float) -> Tree:
    """Greedy Fastest-Node-First broadcast tree over the cost matrix (see module docstring).

    ``per_child_s`` is how long each extra child keeps its parent busy.

    >>> cost = np.full((4, 4), 1.0); np.fill_diagonal(cost, np.inf)
    >>> fnf_tree(cost, 0, per_child_s=1.0).parent   # uniform fabric: binomial-like
    (-1, 0, 0, 1)
    >>> fnf_tree(cost, 0, per_child_s=0.0).parent   # children free for the parent: a star
    (-1, 0, 0, 0)
    """
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
            if best[v] >= ready[u] + cost[u, v] - 1e-15:  # up to date: stale ones are low
                break
            times = np.where(informed, ready + cost[:, v], np.inf)
            source[v] = int(np.argmin(times))
            best[v] = times[source[v]]
        parent[v] = u
        informed[v] = True
        ready[v] = best[v]
        ready[u] += per_child_s
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
    merge_s = resolve_hardware(topology, None)[root].compute_time(3 * message_bytes)
    per_child = backend.send_s + backend.recv_s + merge_s
    return fnf_tree(cost, root, per_child)
