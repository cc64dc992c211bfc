"""Pieces every built-in builder shares: size limits, GPU nodes, the NVSwitch domain.

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
"""

from __future__ import annotations

from treeattn.topo import hardware as hw
from treeattn.topo.errors import TopologyError
from treeattn.topo.graphbuild import GraphBuilder

MAX_NODES = 4096
MAX_GPUS = 65536  # any cluster, built-in or replicated from a file


def check_nodes(name: str, nodes: int, key: str = "nodes", per_host: int = 8) -> None:
    """Refuse a host count out of range, before anything is built."""
    if not 1 <= nodes <= MAX_NODES:
        raise TopologyError(f"{name}: {key}={nodes} must be between 1 and {MAX_NODES}")
    if nodes * per_host > MAX_GPUS:
        raise TopologyError(
            f"{name}: {key}={nodes} x {per_host} GPUs is more than {MAX_GPUS} GPUs"
        )


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
