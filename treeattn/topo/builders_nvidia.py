"""NVIDIA NVSwitch systems: ``dgx-a100``, ``dgx-h100``, ``hgx-h200``, ``dgx-b200``
(``nodes=N``) and ``gb200-nvl72`` (``racks=N``), laid out from :data:`.systems.SYSTEMS`.

* 8-GPU boxes: the NVSwitch domain of :mod:`.builders_common`, one NIC per GPU (rail ``i``
  is GPU ``i``'s NIC), 4 PCIe switches (2 GPUs + 2 NICs each) under 2 sockets.
* GB200 NVL72: one *host* per rack, i.e. per 72-GPU NVLink domain (``rackN``): 9 NVLink
  switch trays (2 chips each, one node per tray), and per superchip (1 Grace, 2 GPUs) one
  PCIe switch per GPU shared with its ConnectX-7. The Grace-GPU NVLink-C2C is not modelled:
  no route crosses it (GPUs reach peers over NVLink and their NIC over PCIe). Racks are
  joined by the rail fabric of :mod:`.fabric` with one rail per GPU slot (72). The SuperPOD
  cables a rack's 72 NICs into fewer rails, but routing is the same: every cross-rack route
  is NVLink to the GPU on the destination's rail (PXN), then NIC -> leaf (-> spine -> leaf)
  -> NIC, and the per-GPU NIC is the bottleneck either way.
"""

from __future__ import annotations

from functools import partial

from treeattn.topo import hardware as hw
from treeattn.topo.builders_common import add_gpu, add_nvswitch_domain, check_nodes
from treeattn.topo.fabric import add_pcie_tree, build_cluster
from treeattn.topo.graphbuild import GraphBuilder
from treeattn.topo.systems import SYSTEMS, NvSwitchSystem


def nvswitch_box(name: str, nodes: int = 1):
    """``nodes`` 8-GPU NVSwitch hosts of system ``name`` (a row of ``SYSTEMS``)."""
    s = SYSTEMS[name]
    check_nodes(name, nodes, per_host=s.gpus)
    return build_cluster(nodes, s.gpus, partial(_box_host, s), s.nic_gbps * 1e9 / 8)


def _box_host(s: NvSwitchSystem, b: GraphBuilder, host: str, h: int) -> list[str]:
    nics = [b.node(f"{host}/nic{i}", "nic", host, rail=i) for i in range(s.gpus)]
    gpus = [add_gpu(b, host, i, h * s.gpus + i, s.gpu, nics[i]) for i in range(s.gpus)]
    add_nvswitch_domain(b, host, gpus, s.gpu, s.split)
    add_pcie_tree(b, host, gpus, nics, s.pcie_switches, hw.PCIE_BANDWIDTH[s.pcie_gen],
                  sockets=s.sockets, upi=s.upi)
    return nics


def dgx_a100(nodes: int = 1):
    """DGX A100 hosts: 6 NVSwitch chips, ConnectX-6 200 Gb/s HDR rails."""
    return nvswitch_box("dgx-a100", nodes)


def dgx_h100(nodes: int = 1):
    """DGX H100 hosts: 4 NVSwitch chips (5/4/4/5 links), ConnectX-7 400 Gb/s NDR rails."""
    return nvswitch_box("dgx-h100", nodes)


def hgx_h200(nodes: int = 1):
    """HGX H200 hosts: the DGX H100 layout with H200 GPUs."""
    return nvswitch_box("hgx-h200", nodes)


def dgx_b200(nodes: int = 1):
    """DGX B200 hosts: 2 NVLink5 switch chips (9/9 links), ConnectX-7 400 Gb/s rails."""
    return nvswitch_box("dgx-b200", nodes)


def gb200_nvl72(racks: int = 1):
    """GB200 NVL72 racks: 72 GPUs per NVLink domain, racks joined over InfiniBand."""
    s = SYSTEMS["gb200-nvl72"]
    check_nodes("gb200-nvl72", racks, key="racks", per_host=s.gpus)
    return build_cluster(racks, s.gpus, partial(_rack, s), s.nic_gbps * 1e9 / 8, prefix="rack")


def _rack(s: NvSwitchSystem, b: GraphBuilder, host: str, h: int) -> list[str]:
    nics = [b.node(f"{host}/nic{i}", "nic", host, rail=i) for i in range(s.gpus)]
    gpus = [add_gpu(b, host, i, h * s.gpus + i, s.gpu, nics[i]) for i in range(s.gpus)]
    add_nvswitch_domain(b, host, gpus, s.gpu, s.split, s.chips_per_node)
    bw, lat = hw.PCIE_BANDWIDTH[s.pcie_gen], hw.PCIE_EDGE_LATENCY
    for c in range(s.gpus // 2):  # superchip c: Grace c with GPUs 2c and 2c + 1
        grace = b.node(f"{host}/cpu{c}", "cpu", host, socket=c)
        for i in (2 * c, 2 * c + 1):
            sw = b.node(f"{host}/pcie{i}", "pcie_switch", host)
            b.link(sw, grace, "pcie", bw, lat)
            b.link(gpus[i], sw, "pcie", bw, lat)
            b.link(nics[i], sw, "pcie", bw, lat)
    return nics
