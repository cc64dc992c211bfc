"""``FILE:nodes=N,...``: an imported host replicated N times over a rail-optimized fabric.

Options (after the file name, ``key=value`` separated by commas; ``treeattn topo import FILE
--nodes N --nic-gbps G --rails R --leaf K`` builds the same string):

* ``nodes`` (required, 1..4096): hosts. At most 65536 GPUs in all; refused before anything
  is built.
* ``nic_gbps`` (default 400, InfiniBand NDR): speed of every host-to-leaf link, Gb/s.
* ``rails`` (default: the host's NIC count, or its GPU count when it has no NIC): rails per
  host, i.e. NICs that join the fabric.
* ``leaf`` (default 0 = automatic): hosts per leaf switch; more hosts add a spine level
  (:mod:`treeattn.topo.fabric`; automatic = one leaf up to 64 hosts, else 32 per leaf).

**Which NICs.** A host that lists NICs (NCCL XML usually does; ``nvidia-smi topo -m``
sometimes) puts its first ``rails`` NICs, in name order (``nic0``, ``nic1``, ... ``nic10``),
on rails 0, 1, ...; ``rails`` may not exceed them. Each GPU then uses the closest rail NIC
by host-internal route cost (PCIe switch before CPU before the other socket), ties going to
the NIC with fewer GPUs so far, then the lower rail, as NCCL picks a GPU's NIC.
A host without NICs gets ``rails`` new ones (``railnicR``): spread evenly over the GPUs,
NIC ``r`` is plugged next to GPU ``r * gpus // rails`` (``r mod gpus`` when there are more
rails than GPUs) into the PCIe switch, else the CPU, that GPU hangs from, at that GPU's PCIe
link speed; GPU ``g`` uses NIC ``g * rails // gpus`` (``g`` when rails >= GPUs), so
consecutive GPUs, which share a socket on real boards, share a NIC.

The source must be exactly one host with a CPU or PCIe switch (where NICs live) and no
network switch; host ``h`` of the result is ``node{h}`` with ranks ``h * gpus + local rank``.
"""

from __future__ import annotations

import math
import re

import networkx as nx

from treeattn.topo import hardware as hw
from treeattn.topo.errors import TopologyError
from treeattn.topo.fabric import MAX_NODES, build_cluster, check_fabric, check_gpus
from treeattn.topo.graphbuild import GraphBuilder
from treeattn.topo.hostsearch import host_adjacency, search
from treeattn.topo.routing import REF_BYTES

OPTIONS = {"nodes": None, "nic_gbps": 400.0, "rails": 0, "leaf": 0}
MAX_RAILS = 64
_OPTS = re.compile(r"^\s*[A-Za-z_]+\s*=[^,]*(,\s*[A-Za-z_]+\s*=[^,]*)*$")


def split_source(source: str) -> tuple[str, str] | None:
    """``("box.json", "nodes=4")`` for ``"box.json:nodes=4"``; ``None`` when there are no
    options (the last ``:`` is followed by ``key=value`` pairs)."""
    path, sep, opts = source.rpartition(":")
    if not sep or not path or not _OPTS.match(opts):
        return None
    return path, opts


def parse_options(text: str, where: str) -> dict:
    """Checked options dict from ``"nodes=4,rails=8"`` (``TopologyError`` naming the issue)."""
    values: dict = {}
    for item in text.split(","):
        key, _, raw = (x.strip() for x in item.partition("="))
        key = key.lower()
        if key not in OPTIONS:
            raise TopologyError(
                f"{where}: unknown option {key!r} (known: {', '.join(OPTIONS)})")
        if key in values:
            raise TopologyError(f"{where}: option {key!r} given twice")
        try:
            values[key] = float(raw) if key == "nic_gbps" else int(raw)
        except ValueError:
            want = "a number" if key == "nic_gbps" else "an integer"
            raise TopologyError(f"{where}: {key}={raw!r} is not {want}") from None
    opts = {**OPTIONS, **values}
    if opts["nodes"] is None:
        raise TopologyError(f"{where}: options need nodes=N")
    if not 1 <= opts["nodes"] <= MAX_NODES:
        raise TopologyError(f"{where}: nodes={opts['nodes']} must be between 1 and {MAX_NODES}")
    if not (math.isfinite(opts["nic_gbps"]) and 1 <= opts["nic_gbps"] <= 1e6):
        raise TopologyError(f"{where}: nic_gbps={opts['nic_gbps']} must be in [1, 1e6] Gb/s")
    if not 0 <= opts["rails"] <= MAX_RAILS:
        raise TopologyError(f"{where}: rails={opts['rails']} must be between 1 and {MAX_RAILS}")
    if not 0 <= opts["leaf"] <= MAX_NODES:
        raise TopologyError(f"{where}: leaf={opts['leaf']} must be between 1 and {MAX_NODES}")
    return opts


def replicate(g: nx.DiGraph, opts: dict, where: str) -> nx.DiGraph:
    """The cluster of ``opts["nodes"]`` copies of the one host in ``g`` (see module doc)."""
    host = _single_host(g, where)
    gpus = sorted((n for n, d in g.nodes(data=True) if d["kind"] == "gpu"),
                  key=lambda n: g.nodes[n]["rank"])
    nodes = opts["nodes"]
    check_gpus(where, "nodes", nodes, len(gpus))
    template = g.copy()
    rail_nics = _attach_rails(template, host, gpus, opts["rails"], where)
    check_fabric(nodes, len(rail_nics), opts["leaf"])
    local = {n: _local(n, host) for n in template}

    def add_host(b: GraphBuilder, name: str, h: int) -> list[str]:
        rename = {n: f"{name}/{loc}" for n, loc in local.items()}
        for n, d in template.nodes(data=True):
            attrs = {k: rename.get(v, v) if isinstance(v, str) else v for k, v in d.items()}
            attrs["host"] = name
            if attrs["kind"] == "gpu":
                attrs["rank"] = h * len(gpus) + d["rank"]
            b.graph.add_node(rename[n], **attrs)
        b.graph.add_edges_from((rename[u], rename[v], dict(d))
                               for u, v, d in template.edges(data=True))
        return [rename[n] for n in rail_nics]

    return build_cluster(nodes, len(rail_nics), add_host, opts["nic_gbps"] * 1e9 / 8,
                         opts["leaf"])


def _single_host(g: nx.DiGraph, where: str) -> str:
    hosts = {d["host"] for _, d in g.nodes(data=True) if d["kind"] == "gpu"}
    if len(hosts) != 1:
        names = ", ".join(sorted(hosts)[:3]) + (", ..." if len(hosts) > 3 else "")
        raise TopologyError(f"{where}: nodes=N replicates one host, but the file has "
                            f"{len(hosts)} ({names})")
    host = hosts.pop()
    kinds = {d["kind"] for _, d in g.nodes(data=True)}
    if "net_switch" in kinds or any(d["host"] != host for _, d in g.nodes(data=True)):
        raise TopologyError(f"{where}: nodes=N needs a single host without a network fabric")
    if not kinds & {"cpu", "pcie_switch"}:
        raise TopologyError(f"{where}: no host structure (no CPU or PCIe switch) to attach "
                            "NICs to; nodes=N needs one")
    return host


def _local(n: str, host: str) -> str:
    return n[len(host) + 1:] if n.startswith(host + "/") else n


def _natural(name: str) -> tuple:
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name))


def _attach_rails(g: nx.DiGraph, host: str, gpus: list[str], rails: int, where: str) -> list[str]:
    """Pick or add the rail NICs of ``g``'s host (in place) and give every GPU its ``nic``."""
    nics = sorted((n for n, d in g.nodes(data=True) if d["kind"] == "nic"), key=_natural)
    if nics:
        if rails > len(nics):
            raise TopologyError(f"{where}: rails={rails} but the host has {len(nics)} NICs")
        chosen = nics[:rails or len(nics)]
        for r, nic in enumerate(chosen):
            g.nodes[nic]["rail"] = r
        tables = host_adjacency(g, host, REF_BYTES)
        load = dict.fromkeys(chosen, 0)
        for gpu in gpus:
            dist = search(g, tables, gpu, None)[0]
            best = min(chosen, key=lambda n: (dist.get(n, math.inf), load[n], g.nodes[n]["rail"]))
            if best not in dist:
                raise TopologyError(f"{where}: GPU {gpu} has no route to any NIC")
            load[best] += 1
            g.nodes[gpu]["nic"] = best
        return chosen
    rails = rails or len(gpus)
    added = []
    for r in range(rails):
        gpu = gpus[r * len(gpus) // rails] if rails <= len(gpus) else gpus[r % len(gpus)]
        parent, bw = _pcie_parent(g, gpu, where)
        nic = f"{host}/railnic{r}"
        if nic in g:
            raise TopologyError(f"{where}: the host already has a node {nic!r}")
        g.add_node(nic, kind="nic", host=host, rail=r)
        for u, v in ((nic, parent), (parent, nic)):
            g.add_edge(u, v, kind="pcie", bandwidth=float(bw), latency=hw.PCIE_EDGE_LATENCY,
                       count=1)
        added.append(nic)
    for i, gpu in enumerate(gpus):
        g.nodes[gpu]["nic"] = added[i * rails // len(gpus) if rails <= len(gpus) else i]
    return added


def _pcie_parent(g: nx.DiGraph, gpu: str, where: str) -> tuple[str, float]:
    """The PCIe switch (else CPU) ``gpu`` hangs from over PCIe, and that link's bandwidth."""
    best = None
    for v, d in g.adj[gpu].items():
        kind = g.nodes[v]["kind"]
        if d["kind"] == "pcie" and kind in ("pcie_switch", "cpu"):
            key = (kind != "pcie_switch", _natural(v))
            if best is None or key < best[0]:
                best = (key, v, d["bandwidth"])
    if best is None:
        raise TopologyError(f"{where}: GPU {gpu} has no PCIe link to a switch or CPU to "
                            "plug a NIC into")
    return best[1], best[2]
