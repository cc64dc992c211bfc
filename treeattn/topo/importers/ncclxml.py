"""Importer for NCCL / RCCL topology XML (``NCCL_TOPO_DUMP_FILE``, ``NCCL_TOPO_FILE``).

Elements and what they become:

* ``<cpu numaid=..>``: a ``cpu`` node per NUMA node; CPUs are joined by inter-socket links
  (Sapphire Rapids / other Intel / AMD figures from :mod:`treeattn.topo.hardware`).
* ``<pci class=0x0604..>``: a ``pcie_switch``; a ``pci`` with a display / processing
  accelerator class (``0x03....``, ``0x12....``) or a ``<gpu>`` child: a GPU; a network class
  (``0x02....``) or a ``<nic>`` child: a NIC. Each ``pci`` is joined to its parent by a
  ``pcie`` link of ``link_speed x link_width`` (x 0.8 for protocol overhead). A missing or zero
  width, or a bridge slower than the device below it (the 2.5 GT/s x1 stubs VMs expose),
  takes the fastest link below it, else PCIe gen4 x16.
* ``<gpu rank=..>``: rank order (document order when ranks are missing or not a
  permutation); the model comes from the PCI device ID, else ``sm`` / ``gcn``, else ``gpu=``.
* ``<nvlink target=.. count=..>``: to another GPU's bus ID a direct NVLink; to anything else
  an NVSwitch chip. GPUs that reach NVSwitch chips are routed through one logical switch
  whose edges bond all their switch links (the chips forward in parallel), as in the
  ``dgx-h100`` builder.
* ``<xgmi target=.. count=..>`` (RCCL): a direct xGMI link.
* ``<nic><net name speed(Mb/s)>``: a NIC (directly under ``<cpu>`` it hangs off the CPU).

Hand-written files without ``<gpu>`` children (Azure's NDv5 file) carry no NVLink facts;
with ``gpu=`` naming an SXM model whose 8 GPUs always sit on NVSwitch (A100, H100, H200, B200)
the NVSwitch is added.

The parser refuses DOCTYPE and ENTITY declarations, so entity expansion cannot blow up.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET

import networkx as nx

from treeattn.topo.errors import TopologyError
from treeattn.topo.importers.ncclxml_build import XmlGraph


def parse_nccl_xml(text: str, gpu: str | None = None) -> nx.DiGraph:
    """Parse NCCL/RCCL topology XML into a topology graph (host ``node0``).

    >>> xml = ('<system version="1"><cpu numaid="0"><pci busid="0000:01:00.0" '
    ...        'class="0x030200" link_speed="16 GT/s" link_width="16"><gpu dev="0" sm="80" '
    ...        'rank="0"/></pci></cpu></system>')
    >>> g = parse_nccl_xml(xml)
    >>> g.nodes["node0/gpu0"]["model"]
    'A100'
    """
    root = _parse(text)
    if root.tag != "system":
        raise TopologyError(f"NCCL XML: root element is <{root.tag}>, expected <system>")
    cpus = [c for c in root if c.tag == "cpu"]
    if not cpus:
        raise TopologyError("NCCL XML: no <cpu> element")
    return XmlGraph(gpu).build(cpus)


def _parse(text: str) -> ET.Element:
    upper = text.upper()
    if "<!DOCTYPE" in upper or "<!ENTITY" in upper:
        raise TopologyError("NCCL XML: DOCTYPE/ENTITY declarations are not accepted")
    try:
        return ET.fromstring(text)
    except (ET.ParseError, ValueError) as exc:
        raise TopologyError(f"NCCL XML: not well-formed XML ({exc})") from None
