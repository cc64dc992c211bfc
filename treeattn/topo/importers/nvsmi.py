"""Importer for ``nvidia-smi topo -m`` text.

The matrix gives, for each pair of devices (GPUs and NICs), the closest connection:

* ``NV#``: a bonded set of # NVLinks. When *every* GPU pair shows ``NV#`` the GPUs hang off
  an NVSwitch (one ``nvswitch`` node, ``#`` links per GPU); otherwise each ``NV#`` pair gets a
  direct NVLink edge of ``#`` bonded links (e.g. 3090 NVLink bridges).
* ``PIX``, ``PXB``, ``PHB``, ``NODE``, ``SYS`` (``SOC`` in old drivers): PCIe relations, turned
  into a plausible tree. Devices joined by anything but ``SYS`` share a NUMA node (one ``cpu``
  node each, named after the NUMA affinity column; the ``cpu`` nodes are joined by ``upi``).
  Inside a NUMA node, groups joined by ``PIX``/``PXB``/``PHB`` share a host bridge (a
  ``pcie_switch`` under the CPU when the NUMA node has several), groups joined by
  ``PIX``/``PXB`` share a PCIe switch, and ``PIX`` groups inside those get their own switch.

Link bandwidth comes from the GPU model (:mod:`treeattn.topo.hardware`). The model is guessed
from the NVLink count where it is unambiguous per link (NV18 -> H100, NV12 -> A100, NV8 ->
A800, NV6 -> V100, NV4 -> RTX3090); ``gpu=`` (``--gpu``) overrides it.
"""

from __future__ import annotations

import functools
import re

import networkx as nx

from treeattn.topo import hardware as hw
from treeattn.topo.errors import TopologyError
from treeattn.topo.graphbuild import GraphBuilder
from treeattn.topo.importers import common as ic

PCIE_RELATIONS = ("PIX", "PXB", "PHB", "NODE", "SYS")
_NV = re.compile(r"^NV(\d{1,3})$")
_DEVICE = re.compile(r"^(GPU\d+|NIC\d+|mlx\d+_\d+|[A-Za-z]+\d*_\d+)$")


def parse_nvidia_smi(text: str, gpu: str | None = None) -> nx.DiGraph:
    """Parse ``nvidia-smi topo -m`` output into a topology graph (host ``node0``).

    >>> text = "\\tGPU0\\tGPU1\\tCPU Affinity\\tNUMA Affinity\\n" \\
    ...        "GPU0\\t X \\tNV4\\t0-7\\t0\\nGPU1\\tNV4\\t X \\t0-7\\t0\\n"
    >>> g = parse_nvidia_smi(text)
    >>> g.edges["node0/gpu0", "node0/gpu1"]["count"], g.nodes["node0/gpu0"]["model"]
    (4, 'RTX3090')
    """
    names, rows = _read_matrix(text)
    rel = _relations(names, rows)
    gpus = [i for i, n in enumerate(names) if n.startswith("GPU")]
    ic.check_count(len(gpus), "GPU rows in the nvidia-smi output")
    model = ic.resolve_model(gpu, _guess_model(rel, gpus))
    b = GraphBuilder()
    nodes = _add_devices(b, names, rows, model, _nic_legend(text))
    _add_pcie_tree(b, names, rows, rel, nodes, model)
    _add_nvlinks(b, rel, gpus, nodes, model)
    return b.graph


TRAILERS = ("CPU Affinity", "NUMA Affinity", "GPU NUMA ID")
MAX_NV = max(spec.links for spec in hw.GPU_SPECS.values())  # 18 (H100/H200/B200)


def _read_matrix(text: str) -> tuple[list[str], dict[str, list[str]]]:
    """Header device names and each device's row; linear in the size of ``text``."""
    lines = text.splitlines()
    k = next((i for i, line in enumerate(lines)
              if line[:1].isspace() and line.split()[:1] == ["GPU0"]), None)
    if k is None:
        raise TopologyError("nvidia-smi: no header line with GPU0 found")
    names = _header(lines[k], k + 1)
    known = set(names)
    rows: dict[str, list[str]] = {}
    for line in lines[k + 1:]:
        tokens = line.split()
        if not tokens or tokens[0] not in known:
            if rows:
                break
            continue
        if tokens[0] in rows:
            raise TopologyError(f"nvidia-smi: duplicate row {tokens[0]}")
        rows[tokens[0]] = tokens[1:]
    for name in names:
        if name not in rows or len(rows[name]) < len(names):
            raise TopologyError(f"nvidia-smi: row {name} missing or short (truncated output?)")
    return names, rows


def _header(line: str, lineno: int) -> list[str]:
    """Device columns of the header, then only the known trailer columns (else an error)."""
    names: list[str] = []
    seen: set[str] = set()
    tokens = (t.strip() for t in re.split(r"\t| {2,}", line.strip()))
    for token in tokens:
        if not token:
            continue
        if not _DEVICE.match(token):
            if token not in TRAILERS:
                raise TopologyError(f"nvidia-smi: bad header column {token[:40]!r} (line {lineno})")
            break
        if token in seen:
            raise TopologyError(f"nvidia-smi: duplicate column {token}")
        seen.add(token)
        names.append(token)
        if len(names) > ic.MAX_DEVICES:  # refuse before reading the rest of a huge line
            ic.check_count(len(names), "device columns in the nvidia-smi header")
    for token in tokens:
        if token and token not in TRAILERS:
            raise TopologyError(f"nvidia-smi: bad header column {token[:40]!r} (line {lineno})")
    ic.check_count(len(names), "device columns in the nvidia-smi header")
    return names


def _relations(names: list[str], rows: dict[str, list[str]]) -> list[list[str]]:
    """The upper-cased, checked relation matrix (``SOC`` read as ``SYS``)."""
    n = len(names)
    rel = [[_canon(rows[names[i]][j]) for j in range(n)] for i in range(n)]
    for i in range(n):
        row = rel[i]
        for j in range(n):
            cell = row[j]
            if (i == j) != (cell == "X") or (i != j and _nv_count(cell) is None):
                what = "bad cell" if (i == j) != (cell == "X") else "unknown relation"
                raise TopologyError(
                    f"nvidia-smi: {what} {cell[:20]!r} at {names[i]}/{names[j]}"
                )
            if cell[:2] == "NV" and not 1 <= _nv_count(cell) <= MAX_NV:
                raise TopologyError(f"nvidia-smi: {cell} at {names[i]}/{names[j]} is not "
                                    f"1 to {MAX_NV} NVLinks (what a GPU can have)")
    for i in range(n):
        for j in range(i):
            if rel[i][j] != rel[j][i]:
                raise TopologyError(
                    f"nvidia-smi: matrix not symmetric at {names[i]}/{names[j]} "
                    f"({rel[i][j]} vs {rel[j][i]})"
                )
    return rel


@functools.lru_cache(maxsize=1024)
def _canon(cell: str) -> str:
    cell = cell.upper()
    return "SYS" if cell == "SOC" else cell


@functools.lru_cache(maxsize=1024)
def _nv_count(cell: str) -> int | None:
    """NVLinks of a cell: ``NV#`` -> #, a PCIe relation or ``X`` -> 0, anything else None."""
    m = _NV.match(cell)
    if m:
        return int(m.group(1))
    return 0 if cell in PCIE_RELATIONS or cell == "X" else None


def _guess_model(rel: list[list[str]], gpus: list[int]) -> str | None:
    counts = {_nv_count(rel[i][j]) for i in gpus for j in gpus if i != j} - {0}
    return hw.NV_COUNT_MODELS.get(max(counts)) if counts else None


def _nic_legend(text: str) -> dict[str, str]:
    """``NIC#: device`` lines; a NIC or a device named twice is damaged output."""
    legend: dict[str, str] = {}
    for nic, dev in re.findall(r"^[ \t]*(NIC\d+):[ \t]*(\S+)[ \t]*$", text, flags=re.M):
        if nic in legend or dev in legend.values():
            raise TopologyError(f"nvidia-smi: NIC Legend names {nic} or {dev} twice")
        legend[nic] = dev
    return legend


def _add_devices(b, names, rows, model, legend) -> dict[int, str]:
    nodes: dict[int, str] = {}
    gpu_index = nic_index = 0
    for i, name in enumerate(names):
        if name.startswith("GPU"):
            extras = rows[name][len(names):]
            numa = extras[1] if len(extras) > 1 else "N/A"
            nodes[i] = ic.add_gpu(b, gpu_index, gpu_index, model, label=name, numa=numa,
                                  cpu_affinity=extras[0] if extras else "N/A")
            gpu_index += 1
        else:
            nodes[i] = b.node(f"{ic.HOST}/nic{nic_index}", "nic", ic.HOST, label=name,
                              device=legend.get(name, name))
            nic_index += 1
    return nodes


def _groups(n_items: list[int], rel, allowed: tuple[str, ...]) -> list[list[int]]:
    """Connected components of ``n_items`` under the relations in ``allowed``."""
    g = nx.Graph()
    g.add_nodes_from(n_items)
    for i in n_items:
        for j in n_items:
            if i < j and rel[i][j] in allowed:
                g.add_edge(i, j)
    return sorted((sorted(c) for c in nx.connected_components(g)), key=lambda c: c[0])


def _add_pcie_tree(b, names, rows, rel, nodes, model) -> None:
    bw, lat = ic.pcie_bandwidth(model), hw.PCIE_EDGE_LATENCY
    counter = {"pcie": 0, "hb": 0}
    cpus = []
    for comp in _groups(list(range(len(names))), rel, PCIE_RELATIONS[:4]):
        label = _numa_label(comp, names, rows, len(cpus))
        cpu = f"{ic.HOST}/cpu{label}"
        if cpu not in b.graph:  # devices with the same NUMA affinity share its socket
            ic.check_count(len(cpus) + 1, "NUMA nodes", ic.MAX_CPUS)
            cpus.append(b.node(cpu, "cpu", ic.HOST, numa=label))
        bridges = _groups(comp, rel, PCIE_RELATIONS[:3])
        for bridge in bridges:
            top = cpu
            if len(bridges) > 1:
                top = b.node(f"{ic.HOST}/hostbridge{counter['hb']}", "pcie_switch", ic.HOST)
                counter["hb"] += 1
                b.link(top, cpu, "pcie", bw, lat)
            for sw_group in _groups(bridge, rel, PCIE_RELATIONS[:2]):
                _attach(b, sw_group, rel, nodes, top, counter, bw)
    ic.mesh_cpus(b, cpus, hw.UPI_BANDWIDTH_DESKTOP)


def _attach(b, members, rel, nodes, parent, counter, bw) -> None:
    """Hang ``members`` (one PXB group) under ``parent``; PIX subgroups get a leaf switch."""
    lat = hw.PCIE_EDGE_LATENCY
    if len(members) > 1:
        sw = b.node(f"{ic.HOST}/pcie{counter['pcie']}", "pcie_switch", ic.HOST)
        counter["pcie"] += 1
        b.link(sw, parent, "pcie", bw, lat)
        parent = sw
    subgroups = _groups(members, rel, ("PIX",))
    for sub in subgroups:
        target = parent
        if len(sub) > 1 and len(subgroups) > 1:
            target = b.node(f"{ic.HOST}/pcie{counter['pcie']}", "pcie_switch", ic.HOST)
            counter["pcie"] += 1
            b.link(target, parent, "pcie", bw, lat)
        for i in sub:
            b.link(nodes[i], target, "pcie", bw, lat)


def _numa_label(comp, names, rows, fallback: int) -> str:
    for i in comp:
        if names[i].startswith("GPU"):
            extras = rows[names[i]][len(names):]
            if len(extras) > 1 and extras[1].isdigit():
                return extras[1]
    return f"x{fallback}"


def _add_nvlinks(b, rel, gpus, nodes, model) -> None:
    pairs = [(i, j, _nv_count(rel[i][j])) for i in gpus for j in gpus if i < j]
    nv = [(i, j, k) for i, j, k in pairs if k]
    if not nv:
        return
    link_bw = ic.need_link_bandwidth(model, "nvlink")
    counts = {k for _, _, k in nv}
    most = ic.links_of(model).links
    if model != ic.UNKNOWN and max(counts) > most:
        raise TopologyError(f"nvidia-smi: NV{max(counts)} but a {model} has {most} NVLinks")
    if len(gpus) >= 3 and len(nv) == len(pairs) and len(counts) == 1:
        ic.add_nvswitch(b, [nodes[i] for i in gpus], counts.pop(), link_bw)
        return
    for i, j, k in nv:
        b.link(nodes[i], nodes[j], "nvlink", k * link_bw, hw.NVLINK_HOP_LATENCY, count=k)
