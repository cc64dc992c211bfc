"""Named cluster builders, selected by a spec string such as ``"dgx-h100:nodes=4"``.

Spec grammar: ``NAME[:KEY=VALUE[,KEY=VALUE...]]``. Names and their parameters:

* ``dgx-h100`` (``nodes``): 8 H100 SXM per host, 4 NVSwitch chips, 4 PCIe 5.0 switches
  (2 GPUs + 2 NICs each), 2 CPU sockets on UPI, one 400 Gb/s NDR NIC per GPU, and a
  rail-optimized InfiniBand fabric for more than one host.
* ``mi300x`` (``nodes``): 8 MI300X per host in an xGMI full mesh (one 64 GB/s link per peer
  and direction), one PCIe 5.0 switch per GPU shared with its 400 Gb/s NIC, same fabric.
* ``pcie-4090`` (``gpus`` in 2, 4, 8; ``nodes``): RTX 4090s on PCIe 4.0 x16, half the GPUs
  behind each socket's PCIe switch, no peer-to-peer (traffic stages through host memory),
  one 200 Gb/s NIC per socket for more than one host.
* ``local`` (``ranks``, ``latency`` s, ``bandwidth`` B/s): N CPU ranks on one host, each joined
  to one ``cpu`` node by a loopback link; a rank-to-rank route crosses two links, whose latency
  adds up to ``latency`` and whose bottleneck is ``bandwidth``.

**The NVSwitch model (dgx-h100).** Each GPU's 18 NVLink4 links go 5/4/4/5 to the four physical
NVSwitch chips (``nodeN/nvswitch0..3``; edge ``count`` = links, ``bandwidth`` = links x
25 GB/s), so the physical NVLink bandwidth out of a GPU sums to 450 GB/s. NCCL stripes every
transfer over all four chips, which forward in parallel, so a GPU-to-GPU transfer gets the
GPU's full 450 GB/s, not one chip's share. Routes therefore cross the *logical* switch
``nodeN/nvswitch`` (node and edges carry ``logical=True``; its edges bond all 18 links at
450 GB/s, 0.3 us per hop). The physical chips carry ``routed_via="nodeN/nvswitch"`` and are
never routed; physical views (:meth:`Topology.links`, ``describe``, ``draw``) skip logical
edges, so nothing is counted twice.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable

from treeattn.topo import hardware as hw
from treeattn.topo.errors import TopologyError
from treeattn.topo.fabric import add_pcie_tree, add_rail_fabric
from treeattn.topo.graphbuild import GraphBuilder

MAX_NODES = 4096
MAX_RANKS = 4096
NVSWITCH_SPLIT = (5, 4, 4, 5)  # H100 NVLink4 links per NVSwitch chip (DGX H100 user guide)
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
    per_host = {"dgx-h100": 8, "mi300x": 8}.get(name)
    if per_host:
        return per_host * int(v["nodes"])
    return int(v["gpus"]) * int(v["nodes"]) if name == "pcie-4090" else int(v["ranks"])


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


def _check_nodes(name: str, nodes: int) -> None:
    if not 1 <= nodes <= MAX_NODES:
        raise TopologyError(f"{name}: nodes={nodes} must be between 1 and {MAX_NODES}")


def _gpu(b: GraphBuilder, host: str, i: int, rank: int, model: str, nic: str | None) -> str:
    attrs = {"nic": nic} if nic else {}
    p2p = hw.gpu_spec(model).p2p
    return b.node(f"{host}/gpu{i}", "gpu", host, model=model, rank=rank, p2p=p2p, **attrs)


def dgx_h100(nodes: int = 1):
    """DGX H100 hosts (see the module docstring for the NVSwitch model)."""
    _check_nodes("dgx-h100", nodes)
    b, fabric_nics = GraphBuilder(), []
    link = hw.gpu_spec("H100")
    hop = hw.NVLINK_HOP_LATENCY / 2
    for h in range(nodes):
        host = f"node{h}"
        nics = [b.node(f"{host}/nic{i}", "nic", host, rail=i) for i in range(8)]
        gpus = [_gpu(b, host, i, h * 8 + i, "H100", nics[i]) for i in range(8)]
        logical = b.node(f"{host}/nvswitch", "nvswitch", host, logical=True, chips=4)
        for k, links in enumerate(NVSWITCH_SPLIT):
            chip = b.node(f"{host}/nvswitch{k}", "nvswitch", host, routed_via=logical)
            for gpu in gpus:
                b.link(gpu, chip, "nvlink", links * link.link_bandwidth, hop, count=links)
        for gpu in gpus:
            b.link(gpu, logical, "nvlink", link.links * link.link_bandwidth, hop,
                   count=link.links, logical=True)
        add_pcie_tree(b, host, gpus, nics, 4, hw.PCIE_BANDWIDTH[5])
        fabric_nics.append(nics)
    add_rail_fabric(b, fabric_nics, hw.IB_NDR_BANDWIDTH)
    return b.graph


def mi300x(nodes: int = 1):
    """MI300X hosts: xGMI full mesh, one link per peer at 64 GB/s per direction."""
    _check_nodes("mi300x", nodes)
    b, fabric_nics = GraphBuilder(), []
    link = hw.gpu_spec("MI300X")
    for h in range(nodes):
        host = f"node{h}"
        nics = [b.node(f"{host}/nic{i}", "nic", host, rail=i) for i in range(8)]
        gpus = [_gpu(b, host, i, h * 8 + i, "MI300X", nics[i]) for i in range(8)]
        for i in range(8):
            for j in range(i + 1, 8):
                b.link(gpus[i], gpus[j], "xgmi", link.link_bandwidth, hw.XGMI_HOP_LATENCY)
        add_pcie_tree(b, host, gpus, nics, 8, hw.PCIE_BANDWIDTH[5])
        fabric_nics.append(nics)
    add_rail_fabric(b, fabric_nics, hw.IB_NDR_BANDWIDTH)
    return b.graph


def pcie_4090(gpus: int = 8, nodes: int = 1):
    """RTX 4090 boxes: no P2P, half the GPUs per socket, traffic through host memory."""
    if gpus not in (2, 4, 8):
        raise TopologyError(f"pcie-4090: gpus={gpus} is not supported (use 2, 4 or 8)")
    _check_nodes("pcie-4090", nodes)
    b, fabric_nics = GraphBuilder(), []
    multi = nodes > 1
    for h in range(nodes):
        host = f"node{h}"
        nics = [b.node(f"{host}/nic{s}", "nic", host, rail=s) for s in range(2)] if multi else []
        names = [
            _gpu(b, host, i, h * gpus + i, "RTX4090", nics[2 * i // gpus] if multi else None)
            for i in range(gpus)
        ]
        add_pcie_tree(b, host, names, [None] * gpus, 2, hw.PCIE_BANDWIDTH[4])
        for s, nic in enumerate(nics):
            b.link(nic, f"{host}/pcie{s}", "pcie", hw.PCIE_BANDWIDTH[4], hw.PCIE_EDGE_LATENCY)
        fabric_nics.append(nics)
    if multi:
        add_rail_fabric(b, fabric_nics, hw.IB_HDR_BANDWIDTH)
    return b.graph


def local(ranks: int = 2, latency: float = hw.LOOPBACK_LATENCY,
          bandwidth: float = hw.LOOPBACK_BANDWIDTH):
    """``ranks`` CPU ranks on one host, every pair ``latency`` s and ``bandwidth`` B/s apart."""
    if not 1 <= ranks <= MAX_RANKS:
        raise TopologyError(f"local: ranks={ranks} must be between 1 and {MAX_RANKS}")
    if latency < 0:
        raise TopologyError(f"local: latency={latency} is negative")
    if bandwidth <= 0:
        raise TopologyError(f"local: bandwidth={bandwidth} is not positive")
    b, host = GraphBuilder(), "localhost"
    cpu = b.node(f"{host}/cpu0", "cpu", host)
    for r in range(ranks):
        rank = b.node(f"{host}/rank{r}", "gpu", host, model="cpu", rank=r, p2p=True)
        b.link(rank, cpu, "loopback", bandwidth, latency / 2)
    return b.graph


BUILDERS: dict[str, tuple[Callable, dict[str, float | int]]] = {
    "dgx-h100": (dgx_h100, {"nodes": 1}),
    "mi300x": (mi300x, {"nodes": 1}),
    "pcie-4090": (pcie_4090, {"gpus": 8, "nodes": 1}),
    "local": (local, {"ranks": 2, "latency": hw.LOOPBACK_LATENCY,
                      "bandwidth": hw.LOOPBACK_BANDWIDTH}),
}
