"""AMD systems: ``mi300x`` (``nodes=N``).

8 MI300X per host in an xGMI full mesh (one 64 GB/s link per peer and direction, AMD CDNA3
whitepaper), one PCIe 5.0 switch per GPU shared with its 400 Gb/s NIC, 2 sockets, and the
rail-optimized fabric of :mod:`.fabric` (rail ``i`` is GPU ``i``'s NIC) for more than one host.
"""

from __future__ import annotations

from treeattn.topo import hardware as hw
from treeattn.topo.builders_common import add_gpu, check_nodes
from treeattn.topo.fabric import add_pcie_tree, build_cluster
from treeattn.topo.graphbuild import GraphBuilder


def mi300x(nodes: int = 1):
    """MI300X hosts: xGMI full mesh, one link per peer at 64 GB/s per direction."""
    check_nodes("mi300x", nodes)
    return build_cluster(nodes, 8, _mi300x_host, hw.IB_NDR_BANDWIDTH)


def _mi300x_host(b: GraphBuilder, host: str, h: int) -> list[str]:
    link = hw.gpu_spec("MI300X")
    nics = [b.node(f"{host}/nic{i}", "nic", host, rail=i) for i in range(8)]
    gpus = [add_gpu(b, host, i, h * 8 + i, "MI300X", nics[i]) for i in range(8)]
    for i in range(8):
        for j in range(i + 1, 8):
            b.link(gpus[i], gpus[j], "xgmi", link.link_bandwidth, hw.XGMI_HOP_LATENCY)
    add_pcie_tree(b, host, gpus, nics, 8, hw.PCIE_BANDWIDTH[5])
    return nics
