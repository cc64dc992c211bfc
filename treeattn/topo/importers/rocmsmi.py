"""Importer for ``rocm-smi --showtopo`` text.

The output has four blocks: *Weight*, *Hops* and *Link Type between two GPUs* (GPU x GPU
matrices) and *Numa Nodes* (``GPU[n] : (Topology) Numa Node: k``, or ``GPU n`` in older
releases). A pair whose link type is ``XGMI`` with one hop becomes a direct ``xgmi`` link
that keeps rocm-smi's weight (15 for xGMI) as ``weight``. ``XGMI`` pairs more than one hop
apart (MI250 GCDs across packages) and ``PCIE`` pairs get no direct edge and are routed
through the CPUs. Each NUMA node becomes a ``cpu`` node, every GPU hangs off its NUMA node's
CPU over PCIe, and the CPUs are joined by inter-socket links.

rocm-smi does not name the GPU model, and the link bandwidth depends on it. An 8-GPU full
xGMI mesh is taken to be MI300X; otherwise pass ``gpu=`` (``--gpu``), e.g. ``MI210``,
``MI250`` or ``MI300A``, or the model stays ``"unknown"`` with the assumed per-link figure of
:data:`treeattn.topo.importers.common.ASSUMED_LINK_BANDWIDTH`.
"""

from __future__ import annotations

import re

import networkx as nx

from treeattn.topo import hardware as hw
from treeattn.topo.errors import TopologyError
from treeattn.topo.graphbuild import GraphBuilder
from treeattn.topo.importers import common as ic

_TITLE = re.compile(r"^=+\s*(.*?)\s*=+\s*$")
_NUMA = re.compile(r"^GPU\s*\[?(\d+)\]?\s*:\s*\(Topology\)\s*Numa Node:\s*(-?\d+)", re.M)
LINK_TYPES = ("XGMI", "PCIE")
MAX_NUMA = 4095  # Linux's largest NODES_SHIFT (10) allows 1024 nodes; more is damage


def parse_rocm_smi(text: str, gpu: str | None = None) -> nx.DiGraph:
    """Parse ``rocm-smi --showtopo`` output into a topology graph (host ``node0``).

    >>> text = "=== Link Type between two GPUs ===\\n  GPU0  GPU1\\n" \\
    ...        "GPU0  0  XGMI\\nGPU1  XGMI  0\\n"
    >>> g = parse_rocm_smi(text, gpu="MI210")
    >>> g.edges["node0/gpu0", "node0/gpu1"]["kind"]
    'xgmi'
    """
    sections = _sections(text)
    if "link type between two gpus" not in sections:
        raise TopologyError("rocm-smi: no 'Link Type between two GPUs' block")
    links = _matrix(sections["link type between two gpus"], "Link Type")
    n = len(links)
    ic.check_count(n, "GPUs in the rocm-smi output")
    hops = _optional(sections, "Hops", n)
    weights = _optional(sections, "Weight", n)
    xgmi = _xgmi_pairs(links, hops)
    detected = "MI300X" if n == 8 and len(xgmi) == 28 else None
    model = ic.resolve_model(gpu, detected)
    numa = _numa(text, n)
    return _build(n, xgmi, numa, model, weights)


def _optional(sections: dict[str, list[str]], what: str, n: int) -> list[list[str]] | None:
    """The ``What between two GPUs`` matrix if present; its size must match Link Type's."""
    key = f"{what.lower()} between two gpus"
    if key not in sections:
        return None
    matrix = _matrix(sections[key], what)
    if len(matrix) != n:
        raise TopologyError(f"rocm-smi: {what} block has {len(matrix)} GPUs, Link Type has {n}")
    for i, row in enumerate(matrix):
        for j, cell in enumerate(row):
            if not (cell.isascii() and cell.isdigit()) or len(cell) > 7 or int(cell) > 10**6:
                raise TopologyError(f"rocm-smi: {what} cell {cell!r} at GPU{i}/GPU{j}")
    return matrix


def _sections(text: str) -> dict[str, list[str]]:
    sections: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        m = _TITLE.match(line.strip())
        if m:
            current = sections.setdefault(m.group(1).strip().lower(), [])
        elif current is not None and line.strip():
            current.append(line)
    return sections


def _matrix(lines: list[str], what: str) -> list[list[str]]:
    if not lines:
        raise TopologyError(f"rocm-smi: {what} block is empty")
    header = lines[0].split()
    ic.check_count(len(header), f"GPUs in the {what} block")
    if not header or any(h != f"GPU{i}" for i, h in enumerate(header)):
        raise TopologyError(f"rocm-smi: bad {what} header {lines[0].strip()!r}")
    ic.check_count(len(header), f"GPUs in the {what} block")
    known = set(header)
    rows: dict[str, list[str]] = {}
    for line in lines[1:]:
        tokens = line.split()
        if tokens[0] in rows:
            raise TopologyError(f"rocm-smi: duplicate {what} row {tokens[0]}")
        if tokens[0] in known:
            rows[tokens[0]] = tokens[1:]
    out = []
    for name in header:
        cells = rows.get(name)
        if cells is None or len(cells) != len(header):
            raise TopologyError(f"rocm-smi: {what} row {name} missing or wrong length")
        out.append([c.upper() for c in cells])
    return out


def _xgmi_pairs(links: list[list[str]], hops: list[list[str]] | None) -> list[tuple[int, int]]:
    n, pairs = len(links), []
    for i in range(n):
        for j in range(n):
            cell = links[i][j]
            if i == j:
                if cell not in ("0", "X"):
                    raise TopologyError(f"rocm-smi: diagonal cell GPU{i}/GPU{j} is {cell!r}")
                continue
            if cell not in LINK_TYPES:
                raise TopologyError(f"rocm-smi: unknown link type {cell!r} at GPU{i}/GPU{j}")
            if cell != links[j][i]:
                raise TopologyError(f"rocm-smi: link type not symmetric at GPU{i}/GPU{j}")
            if i < j and cell == "XGMI" and _hop_count(hops, i, j) <= 1:
                pairs.append((i, j))
    return pairs


def _hop_count(hops: list[list[str]] | None, i: int, j: int) -> int:
    return 1 if hops is None else int(hops[i][j])


def _numa(text: str, n: int) -> list[int]:
    numa = [0] * n
    seen: set[int] = set()
    for gpu, node in _NUMA.findall(text):
        if len(gpu) > 6 or int(gpu) >= n:
            raise TopologyError(f"rocm-smi: Numa block names GPU{gpu[:8]}, but there are {n} GPUs")
        if len(node) > 6 or int(node) > MAX_NUMA:
            raise TopologyError(f"rocm-smi: GPU{gpu} Numa Node {node[:8]} is not in 0..{MAX_NUMA}")
        if int(gpu) in seen:
            raise TopologyError(f"rocm-smi: Numa block names GPU{gpu} twice")
        seen.add(int(gpu))
        numa[int(gpu)] = max(0, int(node))
    return numa


def _build(
    n: int, xgmi: list[tuple[int, int]], numa: list[int], model: str,
    weights: list[list[str]] | None,
) -> nx.DiGraph:
    b = GraphBuilder()
    gpus = [ic.add_gpu(b, i, i, model, numa=numa[i]) for i in range(n)]
    cpus = {k: b.node(f"{ic.HOST}/cpu{k}", "cpu", ic.HOST, numa=k) for k in sorted(set(numa))}
    bw = ic.pcie_bandwidth(model)
    for i, gpu in enumerate(gpus):
        b.link(gpu, cpus[numa[i]], "pcie", bw, 2 * hw.PCIE_EDGE_LATENCY)
    ic.mesh_cpus(b, list(cpus.values()), hw.UPI_BANDWIDTH_AMD)
    if xgmi:
        link_bw = ic.need_link_bandwidth(model, "xgmi")
        for i, j in xgmi:
            extra = {"weight": int(weights[i][j])} if weights else {}  # rocm-smi's weight
            b.link(gpus[i], gpus[j], "xgmi", link_bw, hw.XGMI_HOP_LATENCY, **extra)
    return b.graph
