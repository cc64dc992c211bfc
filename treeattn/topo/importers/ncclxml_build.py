"""Turn the elements of an NCCL/RCCL topology XML into graph nodes and links.

See :mod:`treeattn.topo.importers.ncclxml` for what each element becomes.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field

import networkx as nx

from treeattn.topo import hardware as hw
from treeattn.topo.errors import TopologyError
from treeattn.topo.graphbuild import GraphBuilder
from treeattn.topo.importers import common as ic
from treeattn.topo.importers.ncclxml_peers import add_peer_links

_SPEED = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*GT/s", re.I)
MAX_DEPTH = 32


@dataclass
class Device:
    """One ``<pci>`` device (or a bare ``<nic>``) found in the XML."""

    kind: str  # "gpu", "nic" or "pcie_switch"
    el: ET.Element
    parent: int | str  # index of the parent Device, or a cpu node name
    busid: str
    bw: float | None = None
    name: str = ""
    extra: dict = field(default_factory=dict)


def link_bandwidth(el: ET.Element) -> float | None:
    """Effective PCIe bandwidth of a ``<pci>`` element's link, or ``None`` when unknown.

    >>> el = ET.fromstring('<pci link_speed="32.0 GT/s PCIe" link_width="16"/>')
    >>> round(link_bandwidth(el) / 1e9, 1)
    50.4
    """
    speed, width = el.get("link_speed", ""), el.get("link_width", "").strip()
    m = _SPEED.match(speed)
    if not m or not (width.isascii() and width.isdigit()) or int(width) == 0:
        return None
    gts = float(m.group(1))
    if not 0 < gts <= 256 or int(width) > 64:
        raise TopologyError(f"NCCL XML: PCIe link {speed!r} x{width} out of range")
    encoding = 128 / 130 if gts >= 8 else 8 / 10  # PCIe 3.0+ use 128b/130b, 1.x/2.x 8b/10b
    return gts * 1e9 * encoding / 8 * int(width) * 0.8


def cpu_vendor(el: ET.Element) -> str:
    """The CPU's maker as NCCL's tuning reads it (``<cpu arch= vendor=>``): "intel", "amd"
    (x86 only) or "other"."""
    arch = el.get("arch", "x86_64").strip().lower()
    vendor = el.get("vendor", "").strip()
    if arch not in ("x86_64", "x86", ""):
        return "other"
    return {"GenuineIntel": "intel", "AuthenticAMD": "amd"}.get(vendor, "other")


def cpu_link_bandwidth(cpus: list[ET.Element]) -> float:
    """Inter-socket bandwidth from the CPU vendor and model."""
    if cpus[0].get("vendor", "") == "AuthenticAMD":
        return hw.UPI_BANDWIDTH_AMD
    if cpus[0].get("modelid", "") in ("143", "207"):  # Sapphire / Emerald Rapids
        return hw.UPI_BANDWIDTH_SPR
    return hw.UPI_BANDWIDTH_DESKTOP


def _int_attr(el: ET.Element, key: str, lo: int, hi: int, default: int | None = None) -> int:
    raw = el.get(key)
    if raw is None and default is not None:
        return default
    digits = "" if raw is None else raw.strip().lstrip("-")
    if not (digits.isascii() and digits.isdigit()) or len(digits) > 18:
        raise TopologyError(f"NCCL XML: <{el.tag}> attribute {key}={raw!r} is not an integer")
    value = int(raw)
    if not lo <= value <= hi:
        raise TopologyError(f"NCCL XML: <{el.tag}> attribute {key}={value} out of range")
    return value


class XmlGraph:
    """Collect the devices of an XML topology, then build the graph."""

    def __init__(self, gpu_override: str | None) -> None:
        self.override = gpu_override
        self.b = GraphBuilder()
        self.devices: list[Device] = []
        self.cpus: list[str] = []
        self.busids: set[str] = set()

    def build(self, cpus: list[ET.Element]) -> nx.DiGraph:
        for i, el in enumerate(cpus):
            self._cpu(el, i)
        gpus = [d for d in self.devices if d.kind == "gpu"]
        ic.check_count(len(gpus), "GPUs in the NCCL XML")
        self._name_devices(gpus)
        self._pcie_links()
        ic.mesh_cpus(self.b, self.cpus, cpu_link_bandwidth(cpus))
        self._peer_links(gpus)
        return self.b.graph

    # -- collecting ---------------------------------------------------------------------------
    def _cpu(self, el: ET.Element, i: int) -> None:
        numa = el.get("numaid", str(i)).strip() or str(i)
        name = f"{ic.HOST}/cpu{numa}"
        if name in self.b.graph:
            name = f"{ic.HOST}/cpu{numa}_{i}"
        self.cpus.append(self.b.node(name, "cpu", ic.HOST, numa=numa, vendor=cpu_vendor(el)))
        for child in el:
            if child.tag == "pci":
                self._pci(child, name, 1)
            elif child.tag == "nic":
                self.devices.append(Device("nic", child, name, f"cpu{i}-nic"))

    def _pci(self, el: ET.Element, parent: int | str, depth: int) -> float | None:
        if depth > MAX_DEPTH:
            raise TopologyError("NCCL XML: PCI tree nested too deeply")
        busid = el.get("busid", "").strip().lower()
        if not busid:
            raise TopologyError("NCCL XML: <pci> without busid")
        if busid in self.busids:
            raise TopologyError(f"NCCL XML: duplicate PCI busid {busid[:40]!r}")
        self.busids.add(busid)
        cls = el.get("class", "").strip().lower()
        kind = _pci_kind(el, cls)
        if kind is None:
            return link_bandwidth(el)  # another device (NVMe, ...): not part of the model
        dev = Device(kind, el, parent, busid)
        index = len(self.devices)
        self.devices.append(dev)
        below = [self._pci(c, index, depth + 1) for c in el if c.tag == "pci"]
        fastest = max((x for x in below if x), default=None)
        own = link_bandwidth(el)
        if kind == "pcie_switch":  # a bridge is never slower than what hangs below it
            own = max(own or 0.0, fastest or hw.PCIE_BANDWIDTH[4])
        dev.bw = own if own is not None else fastest
        return dev.bw

    # -- building -----------------------------------------------------------------------------
    def _name_devices(self, gpus: list[Device]) -> None:
        ranks = [d.el.find("gpu") for d in gpus]
        given = [r.get("rank") if r is not None else None for r in ranks]
        if sorted(given, key=str) == [str(i) for i in range(len(gpus))]:
            order = [int(r) for r in given]  # type: ignore[arg-type]
        else:
            order = list(range(len(gpus)))
        for dev, rank in zip(gpus, order, strict=True):
            model = ic.resolve_model(self.override, _detect_model(dev))
            dev.name = ic.add_gpu(self.b, rank, rank, model, busid=dev.busid)
        counters = {"nic": 0, "pcie_switch": 0}
        for dev in self.devices:
            if dev.kind == "gpu":
                continue
            k = counters[dev.kind]
            counters[dev.kind] += 1
            prefix = "nic" if dev.kind == "nic" else "pcie"
            dev.name = self.b.node(f"{ic.HOST}/{prefix}{k}", dev.kind, ic.HOST, busid=dev.busid,
                                   **_nic_attrs(dev.el))

    def _pcie_links(self) -> None:
        for dev in self.devices:
            parent = dev.parent if isinstance(dev.parent, str) else self.devices[dev.parent].name
            bw = dev.bw or hw.PCIE_BANDWIDTH[4]
            if dev.kind == "nic":
                bw = min(bw, _nic_speed(dev.el) or bw)
            self.b.link(dev.name, parent, "pcie", bw, hw.PCIE_EDGE_LATENCY)

    def _peer_links(self, gpus: list[Device]) -> None:
        add_peer_links(self.b, gpus, self.override)


def _pci_kind(el: ET.Element, cls: str) -> str | None:
    if el.find("gpu") is not None or cls.startswith(("0x03", "0x12")):
        return "gpu"
    if el.find("nic") is not None or cls.startswith("0x02"):
        return "nic"
    if cls.startswith("0x0604") or any(c.tag == "pci" for c in el):
        return "pcie_switch"
    return None


def _detect_model(dev: Device) -> str | None:
    device = dev.el.get("device", "").strip().lower()
    if device in hw.PCI_DEVICE_MODELS:
        return hw.PCI_DEVICE_MODELS[device]
    gpu = dev.el.find("gpu")
    if gpu is None:
        return None
    return hw.SM_MODELS.get(gpu.get("sm", "")) or hw.GFX_MODELS.get(gpu.get("gcn", ""))


def _nets(el: ET.Element) -> list[ET.Element]:
    nic = el if el.tag == "nic" else el.find("nic")
    return [] if nic is None else [n for n in nic if n.tag == "net"]


def _nic_speed(el: ET.Element) -> float | None:
    """Sum of the ports' speeds in bytes/s (``speed`` is in Mb/s), ``None`` if not given."""
    speeds = [_int_attr(n, "speed", 0, 10**7, default=0) for n in _nets(el)]
    total = sum(speeds) * 1e6 / 8
    return total if total > 0 else None


def _nic_attrs(el: ET.Element) -> dict:
    nets = _nets(el)
    return {"device": nets[0].get("name", "")} if nets else {}
