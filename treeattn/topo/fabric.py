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
* ``leaf_hosts=K`` (the ``leaf=K`` spec option) sets the hosts per leaf instead: up to ``K``
  hosts share one leaf and no spine; more hosts get ``ceil(hosts / K)`` leaves and
  ``ceil(leaves * K / 64)`` spines, each leaf joined to each spine by ``K // spines`` links.

:func:`build_cluster` is the one way every multi-host topology is made, built-in or imported:
it asks a callback for each host (which returns that host's NICs in rail order) and then adds
the fabric, so the DGX/MI300X/GB200 builders and ``FILE:nodes=N`` share the same rules.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from treeattn.topo import hardware as hw
from treeattn.topo.errors import TopologyError
from treeattn.topo.graphbuild import GraphBuilder

FABRIC_HOST = "fabric"
MAX_FABRIC_LINKS = 200_000  # leaf-spine links over all rails; beyond, refuse (memory, time)


def build_cluster(
    nodes: int, rails: int, add_host: Callable[[GraphBuilder, str, int], list[str]],
    nic_bandwidth: float, leaf_hosts: int = 0, prefix: str = "node",
):
    """``nodes`` hosts named ``{prefix}{h}``, each made by ``add_host(b, host, h)`` (which
    returns its ``rails`` NICs in rail order), joined by a rail-optimized fabric of
    ``nic_bandwidth`` B/s links; return the graph. The fabric's size is checked first."""
    if nodes > 1:
        check_fabric(nodes, rails, leaf_hosts)
    b, nics_by_host = GraphBuilder(), []
    for h in range(nodes):
        nics = add_host(b, f"{prefix}{h}", h)
        if nodes > 1 and len(nics) != rails:
            raise TopologyError(f"host {prefix}{h} has {len(nics)} rail NICs, not {rails}")
        nics_by_host.append(nics)
    add_rail_fabric(b, nics_by_host, nic_bandwidth, leaf_hosts)
    return b.graph


def fabric_shape(hosts: int, leaf_hosts: int = 0) -> tuple[int, int, int]:
    """``(hosts per leaf, leaves, spines)`` of one rail (see the module docstring).

    >>> fabric_shape(64), fabric_shape(65), fabric_shape(8, leaf_hosts=4)
    ((64, 1, 0), (32, 3, 2), (4, 2, 1))
    """
    ports = hw.IB_SWITCH_PORTS
    if leaf_hosts:
        per_leaf = min(hosts, leaf_hosts)
    else:
        per_leaf = hosts if hosts <= ports else ports // 2
    leaves = math.ceil(hosts / per_leaf)
    spines = 0 if leaves == 1 else math.ceil(leaves * per_leaf / ports)
    return per_leaf, leaves, spines


def check_fabric(hosts: int, rails: int, leaf_hosts: int = 0) -> None:
    """Refuse a fabric too large to build (before any graph is made)."""
    _, leaves, spines = fabric_shape(hosts, leaf_hosts)
    if leaves * max(spines, 1) * rails > MAX_FABRIC_LINKS:
        raise TopologyError(
            f"fabric too large: {rails} rails x {leaves} leaves x {spines} spines "
            f"(limit {MAX_FABRIC_LINKS} leaf-spine links; raise leaf=)"
        )


def add_pcie_tree(
    b: GraphBuilder, host: str, gpus: list[str], nics: list[str | None], switches: int,
    bandwidth: float, sockets: int = 2, upi: float = 0.0,
) -> list[str]:
    """Add ``sockets`` CPUs joined by UPI (``upi`` B/s; by default SPR's figure on PCIe 5
    hosts, the desktop one below) and ``switches`` PCIe switches, split evenly across
    sockets, with ``gpus[i]`` (and ``nics[i]`` when given) behind switch ``i * switches //
    len(gpus)``. Return the CPU names."""
    cpus = [b.node(f"{host}/cpu{s}", "cpu", host, socket=s) for s in range(sockets)]
    if not upi:
        upi = hw.UPI_BANDWIDTH_SPR if bandwidth > hw.PCIE_BANDWIDTH[4] else hw.UPI_BANDWIDTH_DESKTOP
    for s in range(1, sockets):
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


def add_rail_fabric(
    b: GraphBuilder, nics_by_host: list[list[str]], bandwidth: float, leaf_hosts: int = 0
) -> None:
    """Connect NIC ``r`` of every host to rail ``r``'s leaves (and spines when needed)."""
    hosts = len(nics_by_host)
    if hosts < 2:
        return
    rails = len(nics_by_host[0])
    per_leaf, leaves, spines = fabric_shape(hosts, leaf_hosts)
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
