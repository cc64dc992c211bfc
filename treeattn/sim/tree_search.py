"""The ``searched`` tree shape: a Fastest-Node-First tree over the simulator's message prices.

The tree construction itself (:func:`treeattn.schedule.algorithms.trees.fnf_tree`) is plain
numpy in the IR; what it needs from here is the price of one message between every pair of
ranks, as the engine prices it. Importing this module registers the search with the IR.
"""

from __future__ import annotations

import numpy as np

from treeattn.schedule.algorithms.trees import TREE_SEARCHES, Tree, fnf_tree
from treeattn.schedule.workload import FP32
from treeattn.sim.devices import BackendModel
from treeattn.sim.network import resolve_backend, resolve_hardware


def cost_matrix(topology, message_bytes: float, backend: BackendModel) -> np.ndarray:
    """``C[u, v]``: seconds to deliver one message from ``u`` to ``v`` (∞ on the diagonal)."""
    return message_prices(topology, message_bytes, backend)[0]


def message_prices(topology, message_bytes: float,
                   backend: BackendModel) -> tuple[np.ndarray, float]:
    """``(C, send + recv)``: :func:`cost_matrix` and the two ends' software cost, priced as
    the engine prices a message (:mod:`treeattn.sim.nccl.p2p`: on NCCL/RCCL the protocol's
    per-class hop latency and the pair's bandwidth capped at the library's figure)."""
    from treeattn.sim.nccl.p2p import P2PModel
    from treeattn.sim.network import Network

    model = P2PModel(topology, backend, Network(topology, backend),
                     resolve_hardware(topology, None))
    send, recv = model.send_s(message_bytes), model.recv_s(message_bytes)
    lat, inv = model.summary_matrices(message_bytes)
    cost = send + lat + message_bytes * inv + recv
    np.fill_diagonal(cost, np.inf)
    return cost, send + recv


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
    cost, ends = message_prices(topology, message_bytes, backend)
    merge_s = resolve_hardware(topology, None)[root].compute_time(3 * message_bytes)
    per_child = ends + merge_s
    return fnf_tree(cost, root, per_child)


TREE_SEARCHES["searched"] = searched_tree
