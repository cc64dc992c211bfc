"""The schedule generators by name: ``build_schedule(algorithm, topology, workload, **params)``.

=============  ==========================================================================
``tree``       ``shape`` (chain, flat, binary, kary, binomial, double_binary, hierarchical,
               searched), ``root``, ``k`` (kary, hierarchical), ``inner``/``outer``
               (hierarchical), ``tree`` (an explicit :class:`~treeattn.sim.algorithms.trees.Tree`)
``butterfly``  no parameters
``allreduce3`` ``inner`` ("tree" or "ring"), and for the tree ``shape``, ``root``, ``k``
``allgather``  no parameters
``ring``       no parameters
=============  ==========================================================================

Every algorithm leaves the merged partial on every rank.
"""

from __future__ import annotations

import inspect

from treeattn.sim.algorithms.allgather import build_allgather
from treeattn.sim.algorithms.allreduce3 import build_allreduce3
from treeattn.sim.algorithms.butterfly import build_butterfly
from treeattn.sim.algorithms.ring import build_ring
from treeattn.sim.algorithms.tree import build_tree
from treeattn.sim.schedule import Schedule, SimError
from treeattn.sim.workload import DecodeWorkload

# THE algorithm registry, in the order reports list them: every algorithm list in the code
# base (prediction rows, golden file, sweeps, runtime, CLI choices) derives from it.
REGISTRY = {
    "tree": build_tree,
    "butterfly": build_butterfly,
    "allgather": build_allgather,
    "allreduce3": build_allreduce3,
    "ring": build_ring,
}
ALGORITHM_NAMES: tuple[str, ...] = tuple(REGISTRY)
TREE_PARAMS = {"shape", "root", "k", "inner", "outer", "tree", "backend"}


def build_schedule(algorithm: str, topology, workload: DecodeWorkload, **params) -> Schedule:
    """Build the schedule of one decode step of attention.

    Examples
    --------
    >>> from treeattn.topo import Topology
    >>> topo = Topology.from_spec("local:ranks=4,latency=1e-6,bandwidth=1e9")
    >>> s = build_schedule("tree", topo, DecodeWorkload("debug", 64), shape="chain")
    >>> s.world, s.params["parent"]
    (4, [-1, 0, 1, 2])
    """
    if algorithm not in REGISTRY:
        raise SimError(f"unknown algorithm {algorithm!r} (known: {', '.join(REGISTRY)})")
    if not isinstance(workload, DecodeWorkload):
        raise SimError("workload must be a DecodeWorkload")
    generator = REGISTRY[algorithm]
    accepted = set(inspect.signature(generator).parameters) - {"topology", "workload"}
    if algorithm == "tree":
        accepted = TREE_PARAMS
    unknown = set(params) - accepted
    if unknown:
        raise SimError(f"{algorithm}: unknown parameter(s) {', '.join(sorted(unknown))}")
    workload.shards(topology.num_gpus)  # raises for one GPU or seq_len < p
    return generator(topology, workload, **params)
