"""Named cluster builders, selected by a spec string such as ``"dgx-h100:nodes=4"``.

Spec grammar: ``NAME[:KEY=VALUE[,KEY=VALUE...]]``. Names and their parameters:

* ``dgx-h100`` (``nodes``): 8 H100 SXM per host, 4 NVSwitch chips, 4 PCIe 5.0 switches
  (2 GPUs + 2 NICs each), 2 CPU sockets on UPI, one 400 Gb/s NDR NIC per GPU, and a
  rail-optimized InfiniBand fabric for more than one host.
* ``dgx-a100``, ``hgx-h200``, ``dgx-b200`` (``nodes``): the same layout with A100 (6 NVSwitch
  chips, 200 Gb/s HDR NICs, PCIe 4.0), H200, B200 (2 NVLink5 switch chips) GPUs.
* ``gb200-nvl72`` (``racks``): 72 GB200 GPUs per rack in one NVLink5 domain (900 GB/s per
  GPU and direction), one 400 Gb/s ConnectX-7 per GPU, racks on the rail fabric.
* ``mi300x`` (``nodes``): 8 MI300X per host in an xGMI full mesh (one 64 GB/s link per peer
  and direction), one PCIe 5.0 switch per GPU shared with its 400 Gb/s NIC, same fabric;
  two AMD EPYC 9004 host CPUs (AMD's MI300X platform reference design, e.g. Supermicro
  AS-8125GS-TNMR2: 2× EPYC 9004, 8× MI300X), joined by Infinity Fabric.
* ``pcie-4090`` (``gpus`` in 2, 4, 8; ``nodes``): RTX 4090s on PCIe 4.0 x16, half the GPUs
  behind each socket's PCIe switch, no peer-to-peer (traffic stages through host memory),
  one 200 Gb/s NIC per socket for more than one host.
* ``local`` (``ranks``, ``latency`` s, ``bandwidth`` B/s, ``hosts``): N CPU ranks, each joined
  to its host's ``cpu`` node by a loopback link; a rank-to-rank route crosses two links, whose
  latency adds up to ``latency`` and whose bottleneck is ``bandwidth``. ``hosts`` (default 1,
  must divide ``ranks``) lays the ranks out as that many equal hosts of one machine, joined
  through zero-latency NICs and one switch (see :func:`local`).

Multi-host built-ins share :func:`treeattn.topo.fabric.build_cluster` (and so the fabric)
with ``FILE:nodes=N`` (:mod:`treeattn.topo.replicate`); the NVIDIA systems and their sourced
table are in :mod:`.builders_nvidia` (the NVSwitch model in :mod:`.fabric`), GPU figures in
:mod:`.hardware`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable

from treeattn.topo import hardware as hw
from treeattn.topo.builders_nvidia import dgx_a100, dgx_b200, dgx_h100, gb200_nvl72, hgx_h200
from treeattn.topo.errors import TopologyError
from treeattn.topo.fabric import MAX_NODES, add_gpu, add_pcie_tree, build_cluster, check_nodes
from treeattn.topo.graphbuild import GraphBuilder

MAX_RANKS = 4096
__all__ = ["MAX_NODES", "BUILDERS", "build_graph", "parse_spec", "spec_gpus"]

_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]*$")


def parse_spec(spec: str) -> tuple[str, dict[str, str]]:
    """Split ``"name:k=v,k=v"`` into the name and a parameter dict.

    >>> parse_spec("dgx-h100:nodes=2")
    ('dgx-h100', {'nodes': '2'})
    """
    if not isinstance(spec, str) or not spec.strip():
        raise TopologyError("empty topology spec")
    name, sep, rest = spec.strip().partition(":")
    name = name.strip().lower()
    if not _NAME.match(name):
        raise TopologyError(f"bad topology spec {spec!r}")
    if sep and not rest.strip():
        raise TopologyError(f"bad topology spec {spec!r}: nothing after ':'")
    params: dict[str, str] = {}
    for item in rest.split(",") if rest.strip() else []:
        key, eq, value = (x.strip() for x in item.partition("="))
        key = key.lower()
        if not eq or not key or not value:
            raise TopologyError(f"bad parameter {item.strip()!r} in spec {spec!r} (want key=value)")
        if key in params:
            raise TopologyError(f"parameter {key!r} given twice in spec {spec!r}")
        params[key] = value
    return name, params


def build_graph(spec: str):
    """Build the graph for a spec string; return ``(graph, canonical spec)``.

    >>> g, name = build_graph("mi300x")
    >>> name, g.number_of_nodes()
    ('mi300x:nodes=1', 26)
    """
    name, params = parse_spec(spec)
    if name not in BUILDERS:
        known = ", ".join(sorted(BUILDERS))
        raise TopologyError(f"unknown topology {name!r} (known: {known})")
    builder, defaults = BUILDERS[name]
    unknown = set(params) - set(defaults)
    if unknown:
        raise TopologyError(
            f"{name}: unknown parameter {sorted(unknown)[0]!r} (known: {', '.join(defaults)})"
        )
    values = {k: _convert(name, k, params.get(k), d) for k, d in defaults.items()}
    canon = name + ":" + ",".join(f"{k}={_fmt(v)}" for k, v in values.items())
    return builder(**values), canon


def spec_gpus(spec: str) -> int | None:
    """GPUs a spec would build, from its parameters alone (``None`` if the spec is bad).

    >>> spec_gpus("pcie-4090:gpus=4,nodes=3")
    12
    """
    try:
        name, params = parse_spec(spec)
        if name not in BUILDERS or set(params) - set(BUILDERS[name][1]):
            return None
        v = {k: _convert(name, k, params.get(k), d) for k, d in BUILDERS[name][1].items()}
    except TopologyError:
        return None
    if name == "pcie-4090":
        return int(v["gpus"]) * int(v["nodes"])
    if name == "local":
        return int(v["ranks"])
    return (72 if name == "gb200-nvl72" else 8) * int(v.get("nodes", v.get("racks", 1)))


def _convert(name: str, key: str, raw: str | None, default: float | int) -> float | int:
    if raw is None:
        return default
    try:
        value = int(raw) if isinstance(default, int) else float(raw)
    except ValueError:
        want = "an integer" if isinstance(default, int) else "a number"
        raise TopologyError(f"{name}: parameter {key}={raw!r} is not {want}") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise TopologyError(f"{name}: parameter {key}={raw!r} is not finite")
    return value


def _fmt(v: float | int) -> str:
    return str(v) if isinstance(v, int) else repr(v)


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
    add_pcie_tree(b, host, gpus, nics, 8, hw.PCIE_BANDWIDTH[5], upi=hw.UPI_BANDWIDTH_AMD,
                  vendor="amd")
    return nics


def pcie_4090(gpus: int = 8, nodes: int = 1):
    """RTX 4090 boxes: no P2P, half the GPUs per socket, traffic through host memory."""
    if gpus not in (2, 4, 8):
        raise TopologyError(f"pcie-4090: gpus={gpus} is not supported (use 2, 4 or 8)")
    check_nodes("pcie-4090", nodes, per_host=gpus)
    multi = nodes > 1

    def host_of(b: GraphBuilder, host: str, h: int) -> list[str]:
        nics = [b.node(f"{host}/nic{s}", "nic", host, rail=s) for s in range(2)] if multi else []
        names = [
            add_gpu(b, host, i, h * gpus + i, "RTX4090", nics[2 * i // gpus] if multi else None)
            for i in range(gpus)
        ]
        add_pcie_tree(b, host, names, [None] * gpus, 2, hw.PCIE_BANDWIDTH[4])
        for s, nic in enumerate(nics):
            b.link(nic, f"{host}/pcie{s}", "pcie", hw.PCIE_BANDWIDTH[4], hw.PCIE_EDGE_LATENCY)
        return nics

    return build_cluster(nodes, 2, host_of, hw.IB_HDR_BANDWIDTH)


def local(ranks: int = 2, latency: float = hw.LOOPBACK_LATENCY,
          bandwidth: float = hw.LOOPBACK_BANDWIDTH, hosts: int = 1):
    """``ranks`` CPU ranks, every pair ``latency`` s and ``bandwidth`` B/s apart, laid out as
    ``hosts`` equal hosts (rank ``r`` on host ``r // (ranks / hosts)``).

    Hosts here are a layout, not another fabric: the ranks share one machine's loopback, so
    a route between two hosts (rank, its host's ``cpu``, its NIC, a zero-latency switch, the
    other NIC and ``cpu``, rank) costs what a route inside one host does. What the layout
    changes is the hosts the schedules see (``hier``'s node and rail groups, hierarchical
    trees), so that two-level schedules run, and are predicted, on CPU ranks. Each rank
    node keeps ``machine="localhost"``: the host model shares one machine's cores among all
    of them (:meth:`treeattn.topo.Topology.machine_of`).
    """
    if not 1 <= ranks <= MAX_RANKS:
        raise TopologyError(f"local: ranks={ranks} must be between 1 and {MAX_RANKS}")
    if latency < 0:
        raise TopologyError(f"local: latency={latency} is negative")
    if bandwidth <= 0:
        raise TopologyError(f"local: bandwidth={bandwidth} is not positive")
    if not 1 <= hosts <= ranks or ranks % hosts:
        raise TopologyError(f"local: hosts={hosts} does not divide ranks={ranks} into equal "
                            "hosts")
    return local_layout([r // (ranks // hosts) for r in range(ranks)], latency, bandwidth)


def local_layout(host_of: list[int], latency: float = hw.LOOPBACK_LATENCY,
                 bandwidth: float = hw.LOOPBACK_BANDWIDTH):
    """CPU ranks on the hosts ``host_of[r]`` (numbered from 0, any sizes, any order), as
    :func:`local` lays them out: the runtime's view of ranks whose hosts it was told."""
    count = max(host_of) + 1
    if sorted(set(host_of)) != list(range(count)):
        raise TopologyError(f"local layout: hosts {sorted(set(host_of))} are not 0..{count - 1}")
    b = GraphBuilder()
    names = ["localhost"] if count == 1 else [f"host{h}" for h in range(count)]
    cpus = [b.node(f"{host}/cpu0", "cpu", host) for host in names]
    nics = [None] * count
    if count > 1:  # each host reaches the others through its NIC and one switch
        switch = b.node("loopback/switch", "net_switch", "loopback")
        for h, host in enumerate(names):
            nics[h] = b.node(f"{host}/nic0", "nic", host, rail=0)
            b.link(cpus[h], nics[h], "loopback", bandwidth, 0.0)
            b.link(nics[h], switch, "loopback", bandwidth, 0.0)
    for r, h in enumerate(host_of):
        # the machine the ranks share (its cores, its memory), whatever hosts they stand for
        extra = {} if nics[h] is None else {"nic": nics[h], "machine": "localhost"}
        rank = b.node(f"{names[h]}/rank{r}", "gpu", names[h], model="cpu", rank=r, p2p=True,
                      **extra)
        b.link(rank, cpus[h], "loopback", bandwidth, latency / 2)
    return b.graph


BUILDERS: dict[str, tuple[Callable, dict[str, float | int]]] = {
    "dgx-a100": (dgx_a100, {"nodes": 1}),
    "dgx-h100": (dgx_h100, {"nodes": 1}),
    "hgx-h200": (hgx_h200, {"nodes": 1}),
    "dgx-b200": (dgx_b200, {"nodes": 1}),
    "gb200-nvl72": (gb200_nvl72, {"racks": 1}),
    "mi300x": (mi300x, {"nodes": 1}),
    "pcie-4090": (pcie_4090, {"gpus": 8, "nodes": 1}),
    "local": (local, {"ranks": 2, "latency": hw.LOOPBACK_LATENCY,
                      "bandwidth": hw.LOOPBACK_BANDWIDTH, "hosts": 1}),
}
