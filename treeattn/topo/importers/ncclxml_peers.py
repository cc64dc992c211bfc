"""NVLink and xGMI peer links of an NCCL/RCCL topology XML (read by :mod:`.ncclxml`).

NVSwitch chips forward in parallel, so when a GPU reaches more than one chip its routes cross a
logical switch ``node0/nvswitch`` whose edges (``logical=True``) bond all the GPU's switch
links; the chips (``routed_via``) carry the physical per-chip links, as in the builders.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET

from treeattn.topo import hardware as hw
from treeattn.topo.errors import TopologyError
from treeattn.topo.graphbuild import GraphBuilder
from treeattn.topo.importers import common as ic

NVSWITCH_MODELS = ("A100", "H100", "H200", "B200")  # 8-GPU SXM boards always use NVSwitch

MAX_LINKS = 64  # per link element and per GPU in all (an H100 has 18, an MI300X 7)


def add_peer_links(b: GraphBuilder, gpus: list, override: str | None) -> None:
    """Add ``<nvlink>`` / ``<xgmi>`` links of ``gpus`` (``Device`` records) to ``b``."""
    by_bus = {d.busid: d.name for d in gpus}
    direct: dict[tuple[str, str], tuple[str, int]] = {}
    switch_links: dict[str, dict[str, int]] = {}  # gpu -> {switch busid: count}
    for dev in gpus:
        gpu_el = dev.el.find("gpu")
        total = 0
        for link in [] if gpu_el is None else list(gpu_el):
            if link.tag not in ("nvlink", "xgmi"):
                continue
            target = link.get("target", "").strip().lower()
            count = _count(link)
            total += count
            if target == dev.busid:
                raise TopologyError(f"NCCL XML: {link.tag} of {dev.name} targets itself "
                                    f"({target}): a self-link")
            if total > MAX_LINKS:
                raise TopologyError(f"NCCL XML: {dev.name} has more than {MAX_LINKS} "
                                    f"{link.tag} links in all")
            if target in by_bus and by_bus[target] != dev.name:
                pair = tuple(sorted((dev.name, by_bus[target])))
                direct[pair] = (link.tag, max(count, direct.get(pair, ("", 0))[1]))
            elif link.tag == "nvlink" and target:
                switch_links.setdefault(dev.name, {})[target] = count
            else:
                raise TopologyError(
                    f"NCCL XML: {link.tag} of {dev.name} targets unknown {target!r}"
                )
    for (u, v), (kind, count) in sorted(direct.items()):
        model = b.graph.nodes[u]["model"]
        bw = ic.need_link_bandwidth(model, kind)
        lat = hw.NVLINK_HOP_LATENCY if kind == "nvlink" else hw.XGMI_HOP_LATENCY
        b.link(u, v, kind, count * bw, lat, count=count)
    if switch_links:
        _add_switches(b, switch_links)
    elif not direct and override is not None:
        _assume_nvswitch(b, [d.name for d in gpus])


def _count(link: ET.Element) -> int:
    raw = link.get("count", "1").strip()
    if not (raw.isascii() and raw.isdigit()) or len(raw) > 4 or not 1 <= int(raw) <= MAX_LINKS:
        raise TopologyError(f"NCCL XML: <{link.tag}> count={raw!r} is not in 1..{MAX_LINKS}")
    return int(raw)


def _add_switches(b: GraphBuilder, switch_links: dict[str, dict[str, int]]) -> None:
    chips = sorted({bus for links in switch_links.values() for bus in links})
    logical = None
    if len(chips) > 1:
        logical = b.node(f"{ic.HOST}/nvswitch", "nvswitch", ic.HOST, logical=True,
                         chips=len(chips))
    names = {}
    for k, bus in enumerate(chips):
        attrs = {"routed_via": logical} if logical else {}
        names[bus] = b.node(f"{ic.HOST}/nvswitch{k}", "nvswitch", ic.HOST, busid=bus, **attrs)
    hop = hw.NVLINK_HOP_LATENCY / 2
    for gpu, links in sorted(switch_links.items()):
        bw = ic.need_link_bandwidth(b.graph.nodes[gpu]["model"], "nvlink")
        for bus, count in sorted(links.items()):
            b.link(gpu, names[bus], "nvlink", count * bw, hop, count=count)
        if logical:
            total = sum(links.values())
            b.link(gpu, logical, "nvlink", total * bw, hop, count=total, logical=True)


def _assume_nvswitch(b: GraphBuilder, gpus: list[str]) -> None:
    """Hand-written files carry no NVLink facts; 8 SXM GPUs of these models sit on NVSwitch."""
    model = b.graph.nodes[gpus[0]]["model"]
    if model in NVSWITCH_MODELS and len(gpus) == 8:
        spec = hw.GPU_SPECS[model]
        ic.add_nvswitch(b, gpus, spec.links, spec.link_bandwidth)
