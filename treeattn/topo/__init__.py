"""The cluster as a networkx graph: builders, importers, routing and JSON round trip.

>>> from treeattn.topo import Topology
>>> t = Topology.from_spec("mi300x")
>>> t.num_gpus, t.path_bandwidth(0, 1)
(8, 64000000000.0)
"""

from treeattn.topo.errors import TopologyError
from treeattn.topo.graphbuild import LINK_KINDS, NODE_KINDS, GraphBuilder
from treeattn.topo.model import Topology

__all__ = ["LINK_KINDS", "NODE_KINDS", "GraphBuilder", "Topology", "TopologyError"]
