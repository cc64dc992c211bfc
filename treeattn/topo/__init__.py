"""The cluster as a networkx graph: builders, importers, routing and JSON round trip.

Public API (all on :class:`Topology`):

* construction: ``Topology.from_spec("dgx-h100:nodes=2")`` (also ``dgx-a100``, ``hgx-h200``,
  ``dgx-b200`` and ``mi300x`` with ``nodes=N``, ``gb200-nvl72:racks=N``,
  ``pcie-4090:gpus=2|4|8,nodes=N``, ``local:ranks=N,latency=S,bandwidth=BPS``),
  ``Topology.load(spec_or_path, fmt="auto", gpu=None)`` (spec, ``.json``, ``nvidia-smi topo
  -m``, ``rocm-smi --showtopo``, NCCL/RCCL XML; ``PATH:nodes=N,nic_gbps=G,rails=R,leaf=K``
  replicates a file's host over a rail fabric), ``Topology.from_json(text)`` /
  ``t.to_json()``, ``Topology(graph, name)``; ``t1 == t2`` compares nodes, edges and attributes;
* lookups: ``t.graph`` (``networkx.DiGraph``), ``t.name``, ``t.gpus`` (rank order),
  ``t.num_gpus``, ``t.hosts``, ``t.host_of(g)``, ``t.gpus_on(host)``, ``t.gpu_model(g)``,
  ``t.rank(g)``, ``t.edge(u, v)``, ``t.links()``, ``t.link_bandwidth_out(g)``;
* routing (``g`` is a rank or a GPU node name): ``t.route(a, b)`` (directed edges, cached),
  ``t.path_latency(a, b)`` (s), ``t.path_bandwidth(a, b)`` (bottleneck, B/s),
  ``t.latency_matrix()`` / ``t.bandwidth_matrix()`` ((p, p), cached),
  ``t.pair_matrices(dtype=np.float32)`` (fresh, half the memory), ``t.intra_host_matrix(h)``,
  ``t.host_pair_matrix(h1, h2)``;
* presentation: ``t.describe()``, ``t.draw(path)``.

>>> from treeattn.topo import Topology
>>> t = Topology.from_spec("mi300x")
>>> t.num_gpus, t.path_bandwidth(0, 1)
(8, 64000000000.0)
"""

from treeattn.topo.errors import TopologyError
from treeattn.topo.graphbuild import LINK_KINDS, NODE_KINDS, GraphBuilder
from treeattn.topo.model import Topology

__all__ = ["LINK_KINDS", "NODE_KINDS", "GraphBuilder", "Topology", "TopologyError"]
