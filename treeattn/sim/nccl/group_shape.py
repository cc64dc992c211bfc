"""A communicator as NCCL's and RCCL's tuning model sees it, read off the topology graph.

:class:`GroupShape` is step 1 of pricing a collective (:mod:`treeattn.sim.nccl.collectives`):
ranks, nodes, GPUs per node, the link class inside a node (NVLink/xGMI or PCIe), NVSwitch or
not, and the channels and per-channel speed NCCL's topology search would settle on, plus the
calibration multipliers and library-release switches that change how the group is priced.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, replace

from treeattn.schedule.payloads import SimError
from treeattn.sim.nccl import tables as T


@dataclass(frozen=True)
class GroupShape:
    """A communicator as the tuning model sees it. Bandwidths in GB/s, as in NCCL."""

    nranks: int
    nnodes: int
    ppn: int  # GPUs of the group per node (the largest host's share)
    family: str  # "nvidia" or "amd"
    arch: str  # key of nccl_tables.ARCH_OF_MODEL's values
    intra: str  # "nvlink" (NVLink/xGMI) or "pci"
    nvswitch: bool
    channels: int  # search channels
    intra_speed: float  # GB/s per channel inside a node
    inter_speed: float  # GB/s per channel across nodes (0 on one node)
    p2p_intra_GBps: float  # one GPU's bandwidth to a peer of its node
    p2p_inter_GBps: float  # one GPU's network bandwidth
    # Calibration (``treeattn calibrate --nccl-tests``): multipliers on the model's latency
    # inside a node (base and hop latencies) and on its network hop latency. 1 = as sourced.
    lat_scale: float = 1.0
    net_lat_scale: float = 1.0
    # RCCL 2.21.5 – 2.2x (ROCm 6.3 up to MSCCL's removal): small all-reduces on one 8-GPU
    # MI300X node run MSCCL's all-pairs schedule, not the tuner's choice. Off: the current
    # library. :func:`_rccl_msccl_allreduce` has the rule.
    rccl_msccl: bool = False
    # The hosts' CPU vendor as NCCL's topology reports it ("intel", "amd", "mixed" across
    # hosts, "other": ARM, POWER, unknown): it sets the network post overhead of a
    # multi-node ring step and the multi-node LL bandwidth cap (nccl_tables: NCCL-net).
    cpu_vendor: str = "intel"
    # GPUs sold in multi-node NVLink fabrics (fabric memory handles across trays: GB200
    # NVL72), which FlashInfer's MNNVL kernels need (treeattn.sim.onesided.ll128). Read from
    # the GPU model: the topology graph does not mark fabric memory; whether the group is
    # one NVLink domain is ``nnodes`` (a rack is one host)
    mnnvl: bool = False

    def scaled(self, lat: float = 1.0, net_lat: float = 1.0, bw: float = 1.0,
               net_bw: float = 1.0) -> GroupShape:
        """This shape with calibrated multipliers on latencies and on bandwidths."""
        return replace(self, lat_scale=self.lat_scale * lat,
                       net_lat_scale=self.net_lat_scale * net_lat,
                       intra_speed=self.intra_speed * bw, inter_speed=self.inter_speed * net_bw,
                       p2p_intra_GBps=self.p2p_intra_GBps * bw,
                       p2p_inter_GBps=self.p2p_inter_GBps * net_bw)

    @classmethod
    def of(cls, topology, ranks: Iterable[int]) -> GroupShape:
        """Read the group's shape off ``topology`` (ranks in the topology's rank order)."""
        from treeattn.topo.hardware import gpu_spec, normalize_model

        gpus = [topology.gpu(r) for r in ranks]
        if not gpus:
            raise SimError("a collective needs at least one rank")
        model = normalize_model(topology.gpu_model(gpus[0]))
        arch = T.ARCH_OF_MODEL.get(model)
        if arch is None:
            raise SimError(f"no NCCL/RCCL model for {model!r} GPUs (CPU groups use gloo)")
        family = "amd" if arch.startswith("cdna") else "nvidia"
        per_host = Counter(topology.host_of(g) for g in gpus)
        nnodes, ppn = len(per_host), max(per_host.values())
        host = max(per_host, key=per_host.get)
        local = [g for g in gpus if topology.host_of(g) == host]
        intra, nvswitch, channels, speed, p2p_intra = "nvlink", False, 1, 0.0, 0.0
        if len(local) > 1:
            edges = topology.route(local[0], local[1])
            kinds = {topology.edge(u, v)["kind"] for u, v in edges}
            nvswitch = any(topology.graph.nodes[v].get("kind") == "nvswitch" for _, v in edges)
            intra = "nvlink" if kinds <= {"nvlink", "xgmi"} else "pci"
            line = gpu_spec(model).link_bandwidth or 1.0
            links_out = round(topology.link_bandwidth_out(local[0]) / line)
            channels, speed, p2p_intra = _intra_channels(
                topology, local, family, arch, intra, nvswitch, links_out)
        inter_speed, p2p_inter = 0.0, 0.0
        if nnodes > 1:
            # the NICs the group's GPUs of that host use (their rails), not every NIC of it
            nic_total = _rail_bandwidth(topology, local) / 1e9
            p2p_inter = nic_total / max(1, ppn)
            cap = speed if speed else nic_total
            inter_speed = _largest_at_most(_speeds(T.NCCL_SPEEDS_INTER, arch),
                                           min(cap, nic_total / channels))
            if ppn == 1:  # one GPU per node: every channel crosses the network
                speed, p2p_intra = inter_speed, p2p_inter
        return cls(len(gpus), nnodes, ppn, family, arch, intra, nvswitch, channels,
                   speed, inter_speed, p2p_intra, p2p_inter,
                   cpu_vendor=cpu_vendor(topology, per_host),
                   mnnvl=model in T.MNNVL_MODELS)


def _speeds(table: dict, arch: str) -> tuple[float, ...]:
    return table["hopper"] if arch in ("hopper", "blackwell") else table["other"]


def _largest_at_most(speeds: tuple[float, ...], limit: float) -> float:
    fitting = [s for s in speeds if s <= limit]
    return max(fitting) if fitting else min(speeds)


def _intra_channels(topology, local, family, arch, intra, nvswitch, links_out):
    """(search channels, GB/s per channel, GB/s to one peer) inside one node.

    Our reading of NCCL's graph search, per link layout: behind an NVSwitch it settles on 12
    channels at the fastest search speed that 12 channels fit in the GPU's NVLink total
    (12 × 30 on a DGX H100, as its logs show); over direct NVLinks or xGMI each link to the
    next GPU carries a channel at the library's per-link figure; over PCIe it runs 2 channels.
    """
    a, b = local[0], local[1]
    direct = int(topology.graph.edges[a, b].get("count", 1)) if topology.graph.has_edge(a, b) else 1
    if intra == "nvlink" and family == "amd":
        peers = min(len(local) - 1, max(1, links_out))
        per_link = T.RCCL_XGMI_BW.get(arch, 48.0)
        return peers, per_link, per_link * direct
    if intra == "nvlink":
        per_link = T.NCCL_NVLINK_BW.get(arch, 20.0)
        total = links_out * per_link
        if nvswitch:
            nch = T.NCCL_SEARCH_CHANNELS_NVSWITCH
            return nch, _largest_at_most(_speeds(T.NCCL_SPEEDS_INTRA, arch), total / nch), total
        return direct, per_link, direct * per_link
    path_bw = topology.path_bandwidth(a, b) / 1e9
    return 2, _largest_at_most(_speeds(T.NCCL_SPEEDS_INTRA, arch), path_bw / 2), path_bw


def _rail_bandwidth(topology, local: list[str]) -> float:
    """Bytes/s into the network from the NICs that ``local`` (GPUs of one host) use.

    A GPU's NIC is the one its route to another host leaves through (its rail on a
    rail-optimised fabric, the NIC behind its PCIe switch): NCCL's search gives each GPU its
    nearest NIC, and a tensor-parallel group's context-parallel slice of one GPU per host
    sends through that GPU's rail only, not through every NIC of the host.
    """
    graph = topology.graph
    host = topology.host_of(local[0])
    other = next((h for h in topology.hosts if h != host), None)
    if other is None:
        raise SimError(f"host {host}: no other host to price a multi-node collective over")
    mine, theirs = topology.gpus_on(host), topology.gpus_on(other)
    nics = set()
    for gpu in local:  # to the GPU in the same position there: its own rail (no PXN hop)
        peer = theirs[mine.index(gpu) % len(theirs)]
        for u, v in topology.route(gpu, peer):
            if graph.nodes[u].get("kind") == "nic" and graph.edges[u, v].get("kind") == "ib":
                nics.add((u, v))
                break
    total = sum(float(graph.edges[e]["bandwidth"]) for e in nics)
    if total <= 0:
        raise SimError(f"host {host}: no network interface to price a multi-node collective")
    return total


def cpu_vendor(topology, hosts) -> str:
    """The CPU vendor NCCL would report for a communicator on ``hosts``: one vendor, or
    "mixed" when the hosts differ (nodes of kind ``cpu`` carry ``vendor``; "intel" when a
    topology does not say, NCCL's most common case and this model's earlier assumption)."""
    by_host = _host_vendors(topology.graph)
    found = set()
    for host in hosts:
        found |= by_host.get(host, set())
    if len(found) > 1:
        return "mixed"
    return found.pop() if found else "intel"


_VENDORS_OF: list = [None, {}]  # the last graph read, and its hosts' CPU vendors


def _host_vendors(graph) -> dict[str, set[str]]:
    """Each host's CPU vendors, read off ``graph`` once (a plan prices hundreds of groups
    of one topology; scanning every node for each would dominate a 1024-GPU plan)."""
    if _VENDORS_OF[0] is not graph:
        vendors: dict[str, set[str]] = {}
        for _node, data in graph.nodes(data=True):
            if data.get("kind") == "cpu":
                vendors.setdefault(data.get("host"), set()).add(str(data.get("vendor", "intel")))
        _VENDORS_OF[:] = [graph, vendors]
    return _VENDORS_OF[1]
