"""Host-side PCIe trees and the rail-optimized InfiniBand fabric shared by the builders.

Rail-optimized fabric: rail ``r`` connects NIC ``r`` of every host (the NIC of local GPU
``r`` on DGX/MI300X), so rails never need to talk to each other: NCCL's PXN moves data over
NVLink/xGMI to the GPU on the destination's rail first (see :mod:`treeattn.topo.routing`).

* Up to :data:`~treeattn.topo.hardware.IB_SWITCH_PORTS` (64) hosts: one leaf per rail, every
  port facing a host, no spine.
* More hosts: each leaf uses half its ports down (32 hosts) and half up, and each rail is a
  two-level fat tree with ``ceil(leaves / 2)`` spines; every leaf connects to every spine of its
  rail with ``32 // spines`` bonded links (at least one). This is the layout of NVIDIA's DGX
  SuperPOD reference architecture (scalable units of 32 nodes, one leaf per rail per SU).
"""

from __future__ import annotations

import math

from treeattn.topo import hardware as hw
from treeattn.topo.graphbuild import GraphBuilder

FABRIC_HOST = "fabric"


def add_pcie_tree(
    b: GraphBuilder, host: str, gpus: list[str], nics: list[str | None], switches: int,
    bandwidth: float, sockets: int = 2,
) -> list[str]:
    """Add ``sockets`` CPUs joined by UPI and ``switches`` PCIe switches, split evenly across
    sockets, with ``gpus[i]`` (and ``nics[i]`` when given) behind switch ``i * switches //
    len(gpus)``. Return the CPU names."""
    cpus = [b.node(f"{host}/cpu{s}", "cpu", host, socket=s) for s in range(sockets)]
    for s in range(1, sockets):
        upi = hw.UPI_BANDWIDTH_SPR if bandwidth > hw.PCIE_BANDWIDTH[4] else hw.UPI_BANDWIDTH_DESKTOP
        b.link(cpus[0], cpus[s], "upi", upi, hw.UPI_LATENCY)
    lat = hw.PCIE_EDGE_LATENCY
    names = []
    for k in range(switches):
        sw = b.node(f"{host}/pcie{k}", "pcie_switch", host)
        b.link(sw, cpus[k * sockets // switches], "pcie", bandwidth, lat)
        names.append(sw)
    for i, gpu in enumerate(gpus):
        sw = names[i * switches // len(gpus)]
        b.link(gpu, sw, "pcie", bandwidth, lat)
        if nics[i] is not None:
            b.link(nics[i], sw, "pcie", bandwidth, lat)
    return cpus


def add_rail_fabric(b: GraphBuilder, nics_by_host: list[list[str]], bandwidth: float) -> None:
    """Connect NIC ``r`` of every host to rail ``r``'s leaves (and spines when needed)."""
    hosts = len(nics_by_host)
    if hosts < 2:
        return
    rails = len(nics_by_host[0])
    ports = hw.IB_SWITCH_PORTS
    per_leaf = hosts if hosts <= ports else ports // 2
    leaves = math.ceil(hosts / per_leaf)
    spines = 0 if leaves == 1 else math.ceil(leaves / 2)
    for r in range(rails):
        leaf_names = [
            b.node(f"rail{r}/leaf{k}", "net_switch", FABRIC_HOST, rail=r, tier="leaf")
            for k in range(leaves)
        ]
        for h, nics in enumerate(nics_by_host):
            b.link(nics[r], leaf_names[h // per_leaf], "ib", bandwidth, hw.IB_EDGE_LATENCY)
        _add_spines(b, r, leaf_names, spines, per_leaf, bandwidth)


def _add_spines(
    b: GraphBuilder, rail: int, leaves: list[str], spines: int, per_leaf: int, bandwidth: float
) -> None:
    if spines == 0:
        return
    count = max(1, per_leaf // spines)  # the leaf's up-ports, spread over the spines
    for s in range(spines):
        spine = b.node(f"rail{rail}/spine{s}", "net_switch", FABRIC_HOST, rail=rail, tier="spine")
        for leaf in leaves:
            b.link(leaf, spine, "ib", count * bandwidth, hw.IB_SPINE_LATENCY, count=count)
