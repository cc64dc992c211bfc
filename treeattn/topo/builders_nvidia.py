"""NVIDIA NVSwitch systems: ``dgx-a100``, ``dgx-h100``, ``hgx-h200``, ``dgx-b200``
(``nodes=N``) and ``gb200-nvl72`` (``racks=N``), laid out from :data:`SYSTEMS`.

* 8-GPU boxes: the NVSwitch domain of :mod:`.fabric`, one NIC per GPU (rail ``i``
  is GPU ``i``'s NIC), 4 PCIe switches (2 GPUs + 2 NICs each) under 2 sockets.
* GB200 NVL72: one *host* per rack, i.e. per 72-GPU NVLink domain (``rackN``): 9 NVLink
  switch trays (2 chips each, one node per tray), and per superchip (1 Grace, 2 GPUs) one
  PCIe switch per GPU shared with its ConnectX-7. The Grace-GPU NVLink-C2C is not modelled:
  no route crosses it (GPUs reach peers over NVLink and their NIC over PCIe). Racks are
  joined by the rail fabric of :mod:`.fabric` with one rail per GPU slot (72). The SuperPOD
  cables a rack's 72 NICs into fewer rails, but routing is the same: every cross-rack route
  is NVLink to the GPU on the destination's rail (PXN), then NIC -> leaf (-> spine -> leaf)
  -> NIC, and the per-GPU NIC is the bottleneck either way.

One row per built-in NVSwitch system; GPU link and compute figures come from the GPU's row
of :data:`treeattn.topo.hardware.GPU_SPECS`, the rest from the system's own datasheet:

===========  =====  ======  ===================  ===============  ==========  ==================
spec         GPU    GPUs    NVSwitch chips       NICs (per GPU)   PCIe        source
===========  =====  ======  ===================  ===============  ==========  ==================
dgx-a100     A100   8       6 (2 links each)     ConnectX-6 200G  4x gen4     DGX A100 user guide
dgx-h100     H100   8       4 (5/4/4/5 links)    ConnectX-7 400G  4x gen5     DGX H100 user guide
hgx-h200     H200   8       4 (5/4/4/5 links)    ConnectX-7 400G  4x gen5     HGX H200 datasheet
dgx-b200     B200   8       2 (9 links each)     ConnectX-7 400G  4x gen5     DGX B200 user guide
gb200-nvl72  GB200  72      9 trays x 2 (2 each) ConnectX-7 400G  per GPU     DGX GB200 user guide
===========  =====  ======  ===================  ===============  ==========  ==================

* DGX A100 (user guide, "Hardware overview"): 8x A100 SXM4 80 GB, six second-generation
  NVSwitch chips (each GPU's 12 NVLink3 links: 2 per chip, 600 GB/s bidirectional), 8x
  single-port ConnectX-6 200 Gb/s HDR for the compute fabric, 4 PCIe 4.0 switches, 2 AMD
  EPYC 7742 sockets (joined by Infinity Fabric: :data:`~.hardware.UPI_BANDWIDTH_AMD`).
* DGX H100 (user guide): 8x H100 SXM5, 4 NVSwitch chips, 8x ConnectX-7 400 Gb/s NDR,
  4 PCIe 5.0 switches, 2 Xeon Platinum 8480C.
* CPU vendor (``cpu_vendor``, read by NCCL's tuning for the network overhead of a ring
  step): AMD for the DGX A100 (EPYC 7742), Intel for the DGX H100 / H200 (Xeon 8480C) and
  DGX B200 (Xeon 8570), "other" (ARM Grace) for GB200.
* HGX H200 (NVIDIA H200 datasheet; DGX H200 user guide for the rest): the DGX H100 board with
  H200 GPUs (141 GB, 4.8 TB/s): NVLink4 900 GB/s bidirectional via 4 NVSwitch chips, 8x
  ConnectX-7 400 Gb/s.
* DGX B200 (user guide / DGX BasePOD RA): 8x B200 (1,440 GB in all), two NVLink5 switch chips
  (each GPU's 18 links split 9/9, 1.8 TB/s bidirectional), 4 OSFP ports serving 8x
  single-port ConnectX-7 VPI 400 Gb/s, 2 Xeon Platinum 8570 (PCIe 5.0).
* GB200 NVL72 (DGX GB200 user guide, "Hardware"): per rack 18 compute trays (2 Grace CPUs,
  4 Blackwell GPUs, 4x ConnectX-7 single-port 400G OSFP each) and 9 NVLink switch trays
  (18 NVSwitch chips); every GPU has one NVLink5 link to each chip, 18 x 50 GB/s = 900 GB/s
  per direction. The graph holds one physical node per switch *tray* (``chips=2``, a bond of
  2 links from every GPU): half the edges of one node per chip, the same links and totals.
  ConnectX-8 800 Gb/s comes with GB300 NVL72 (NVIDIA GB300 NVL72 enterprise RA), not
  modelled here (a GB300 host imported from its NCCL XML takes ``nic_gbps=800``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from treeattn.topo import hardware as hw
from treeattn.topo.fabric import (
    add_gpu,
    add_nvswitch_domain,
    add_pcie_tree,
    build_cluster,
    check_nodes,
)
from treeattn.topo.graphbuild import GraphBuilder


@dataclass(frozen=True)
class NvSwitchSystem:
    """One NVSwitch host (or rack) as the builders lay it out."""

    gpu: str  # row of hardware.GPU_SPECS
    gpus: int  # GPUs per host (one NVLink domain)
    split: tuple[int, ...]  # NVLink links from each GPU to each physical NVSwitch node
    nic_gbps: float  # compute-fabric NIC speed, Gb/s (one NIC per GPU)
    pcie_gen: int
    pcie_switches: int  # per host (GB200: one per GPU, see builders_nvidia)
    sockets: int = 2
    upi: float = 0.0  # inter-socket B/s (0: fabric.add_pcie_tree's default)
    chips_per_node: int = 1  # NVSwitch chips one physical node stands for (GB200: a tray)
    cpu_vendor: str = "intel"  # the host CPUs' maker: "intel", "amd", "other" (Grace: ARM)


SYSTEMS: dict[str, NvSwitchSystem] = {
    "dgx-a100": NvSwitchSystem("A100", 8, (2,) * 6, 200, 4, 4, upi=hw.UPI_BANDWIDTH_AMD,
                               cpu_vendor="amd"),
    "dgx-h100": NvSwitchSystem("H100", 8, (5, 4, 4, 5), 400, 5, 4),
    "hgx-h200": NvSwitchSystem("H200", 8, (5, 4, 4, 5), 400, 5, 4),
    "dgx-b200": NvSwitchSystem("B200", 8, (9, 9), 400, 5, 4),
    "gb200-nvl72": NvSwitchSystem("GB200", 72, (2,) * 9, 400, 5, 72, chips_per_node=2,
                                  cpu_vendor="other"),
}


def _check() -> None:
    """Every system's NVLink split adds up to its GPU's link count (import-time sanity)."""
    for name, s in SYSTEMS.items():
        if sum(s.split) != hw.GPU_SPECS[s.gpu].links:
            raise AssertionError(f"{name}: NVLink split {s.split} != {s.gpu} links")


_check()

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
                  sockets=s.sockets, upi=s.upi, vendor=s.cpu_vendor)
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
        grace = b.node(f"{host}/cpu{c}", "cpu", host, socket=c, vendor=s.cpu_vendor)
        for i in (2 * c, 2 * c + 1):
            sw = b.node(f"{host}/pcie{i}", "pcie_switch", host)
            b.link(sw, grace, "pcie", bw, lat)
            b.link(gpus[i], sw, "pcie", bw, lat)
            b.link(nics[i], sw, "pcie", bw, lat)
    return nics
