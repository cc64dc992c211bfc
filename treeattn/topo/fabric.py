"""Cluster assembly shared by the built-in builders and ``FILE:nodes=N``: size limits, GPU
nodes, the NVSwitch domain, host-side PCIe trees and the rail-optimized InfiniBand fabric.

**The NVSwitch model.** Each GPU's NVLinks go to the physical NVSwitch chips of its domain
(``HOST/nvswitchK``; edge ``count`` = links, ``bandwidth`` = links x per-link bandwidth), so
the physical NVLink bandwidth out of a GPU sums to its datasheet figure. NCCL stripes every
transfer over all chips, which forward in parallel, so a GPU-to-GPU transfer gets the GPU's
full NVLink bandwidth, not one chip's share. Routes therefore cross the *logical* switch
``HOST/nvswitch`` (node and edges carry ``logical=True``; its edges bond all the GPU's links,
0.3 us per hop); the physical chips carry ``routed_via="HOST/nvswitch"`` and are never
routed, and physical views (``links()``, ``describe``, ``draw``) skip logical edges. The
router takes GPU -> logical switch -> GPU directly (:mod:`treeattn.topo.routing`), so a
72-GPU domain costs no search per pair.

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

import contextlib
import contextvars
import math
from collections.abc import Callable, Iterator

from treeattn.topo import hardware as hw
from treeattn.topo.errors import TopologyError
from treeattn.topo.graphbuild import GraphBuilder

FABRIC_HOST = "fabric"
MAX_NODES = 4096
MAX_GPUS = 65536  # any cluster, built-in or replicated from a file
MAX_FABRIC_LINKS = 200_000  # leaf-spine links over all rails; beyond, refuse (memory, time)



NOTE_BUILD_GPUS = 8192  # past this, building takes seconds (65,536 GPUs: about 35 s)

# (the most GPUs the caller will use, who says so) and a hook for the note on a long build,
# set by a caller with :func:`build_limits`; builders read them before building anything.
_LIMIT: contextvars.ContextVar[tuple[int, str] | None] = contextvars.ContextVar(
    "treeattn_gpu_limit", default=None)
_NOTE: contextvars.ContextVar[Callable[[str], None] | None] = contextvars.ContextVar(
    "treeattn_build_note", default=None)


@contextlib.contextmanager
def build_limits(max_gpus: int | None = None, who: str = "",
                 note: Callable[[str], None] | None = None) -> Iterator[None]:
    """While active, a topology of more than ``max_gpus`` GPUs is refused before it is built
    (``who`` names the bound, e.g. the planner), and ``note`` hears of a long build.

    >>> from treeattn.topo import Topology, TopologyError
    >>> try:
    ...     with build_limits(16, "this caller"):
    ...         Topology.from_spec("dgx-h100:nodes=4")
    ... except TopologyError as e:
    ...     print(e)
    dgx-h100: nodes=4 x 8 GPUs is 32 GPUs, more than the 16 this caller takes
    """
    tokens = (_LIMIT.set((max_gpus, who) if max_gpus else None), _NOTE.set(note))
    try:
        yield
    finally:
        _NOTE.reset(tokens[1])
        _LIMIT.reset(tokens[0])


def check_gpus(name: str, key: str, nodes: int, per_host: int) -> None:
    """Refuse ``nodes`` x ``per_host`` GPUs past the bound in force, before anything is built;
    tell the caller's note hook when the build will take a while."""
    gpus = nodes * per_host
    if gpus > MAX_GPUS:
        raise TopologyError(f"{name}: {key}={nodes} x {per_host} GPUs is more than {MAX_GPUS}")
    limit = _LIMIT.get()
    if limit is not None and gpus > limit[0]:
        raise TopologyError(f"{name}: {key}={nodes} x {per_host} GPUs is {gpus:,} GPUs, more "
                            f"than the {limit[0]:,} {limit[1]} takes")
    hook = _NOTE.get()
    if hook is not None and gpus > NOTE_BUILD_GPUS:
        hook(f"note: building {gpus:,} GPUs; this takes about {max(1, gpus // 2000)} s")


def check_nodes(name: str, nodes: int, key: str = "nodes", per_host: int = 8) -> None:
    """Refuse a host count out of range, before anything is built."""
    if not 1 <= nodes <= MAX_NODES:
        raise TopologyError(f"{name}: {key}={nodes} must be between 1 and {MAX_NODES}")
    check_gpus(name, key, nodes, per_host)


def add_gpu(b: GraphBuilder, host: str, i: int, rank: int, model: str, nic: str | None) -> str:
    """GPU ``i`` of ``host`` with its global ``rank`` and (on multi-host systems) its NIC."""
    attrs = {"nic": nic} if nic else {}
    p2p = hw.gpu_spec(model).p2p
    return b.node(f"{host}/gpu{i}", "gpu", host, model=model, rank=rank, p2p=p2p, **attrs)


def add_nvswitch_domain(
    b: GraphBuilder, host: str, gpus: list[str], model: str, split: tuple[int, ...],
    chips_per_node: int = 1,
) -> str:
    """Physical switch nodes (``split[k]`` links from every GPU to node ``k``, each node
    ``chips_per_node`` chips) and the logical switch that routes bond all of a GPU's links;
    return the logical switch's name."""
    link = hw.gpu_spec(model)
    hop = hw.NVLINK_HOP_LATENCY / 2
    chips = len(split) * chips_per_node
    logical = b.node(f"{host}/nvswitch", "nvswitch", host, logical=True, chips=chips)
    extra = {"chips": chips_per_node} if chips_per_node > 1 else {}
    for k, links in enumerate(split):
        chip = b.node(f"{host}/nvswitch{k}", "nvswitch", host, routed_via=logical, **extra)
        for gpu in gpus:
            b.link(gpu, chip, "nvlink", links * link.link_bandwidth, hop, count=links)
    for gpu in gpus:
        b.link(gpu, logical, "nvlink", link.links * link.link_bandwidth, hop,
               count=link.links, logical=True)
    return logical


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
    bandwidth: float, sockets: int = 2, upi: float = 0.0, vendor: str = "intel",
) -> list[str]:
    """Add ``sockets`` CPUs joined by UPI (``upi`` B/s; by default SPR's figure on PCIe 5
    hosts, the desktop one below) and ``switches`` PCIe switches, split evenly across
    sockets, with ``gpus[i]`` (and ``nics[i]`` when given) behind switch ``i * switches //
    len(gpus)``. ``vendor`` ("intel", "amd", "other") is the CPUs' maker, which NCCL's
    tuning reads (network overhead per ring step). Return the CPU names."""
    cpus = [b.node(f"{host}/cpu{s}", "cpu", host, socket=s, vendor=vendor)
            for s in range(sockets)]
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
