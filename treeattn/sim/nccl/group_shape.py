"""A communicator as NCCL's and RCCL's tuning model sees it, read off the topology graph.

:class:`GroupShape` is step 1 of pricing a collective (:mod:`treeattn.sim.nccl.collectives`):
ranks, nodes, GPUs per node, the link class inside a node (NVLink/xGMI or PCIe), NVSwitch or
not, and the channels and per-channel speed NCCL's topology search would settle on, plus the
calibration multipliers and library-release switches that change how the group is priced.
"""

from __future__ import annotations

import math
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
    # NCCL's node-local latencies (base and NVLink/PCIe hop) describe Hopper; this is the
    # GPU generation's factor on them (nccl_tables: NCCL-gen). 1 on AMD: RCCL's are per arch
    gen_lat_scale: float = 1.0
    # RCCL 2.21.5 – 2.2x (ROCm 6.3 up to MSCCL's removal): small all-reduces on one 8-GPU
    # MI300X node run MSCCL's all-pairs schedule, not the tuner's choice. Off: the current
    # library. :func:`treeattn.sim.nccl.rccl._rccl_msccl_allreduce` has the rule.
    rccl_msccl: bool = False
    # The hosts' CPU vendor as NCCL's topology reports it ("intel", "amd", "mixed" across
    # hosts, "other": ARM, POWER, unknown): it sets the network post overhead of a
    # multi-node ring step and the multi-node LL bandwidth cap (nccl_tables: NCCL-net).
    cpu_vendor: str = "intel"
    # Every host's CPU is x86 (Intel or AMD): NCCL's ``NCCL_TOPO_CPU_ARCH_X86``, which gates
    # the NVLS_TREE bandwidth correction on Blackwell (nccl_tables: treeCorrectionFactor)
    cpu_x86: bool = True
    # GPUs sold in multi-node NVLink fabrics (fabric memory handles across trays: GB200
    # NVL72), which FlashInfer's MNNVL kernels need (treeattn.sim.onesided.ll128). Read from
    # the GPU model: the topology graph does not mark fabric memory; whether the group is
    # one NVLink domain is ``nnodes`` (a rack is one host)
    mnnvl: bool = False
    # NCCL's NVLS graph on one node (search.cc, nccl_tables: NVLS): channels (one per GPU)
    # and its intra and inter speeds, GB/s per channel; 0 channels: no NVLS graph
    nvls_channels: int = 0
    nvls_intra_speed: float = 0.0
    nvls_inter_speed: float = 0.0
    # p2p (paths.cc, enqueue.cc): the communicator's p2p channels and channels per peer
    p2p_channels: int = 1
    p2p_peer_channels: int = 1
    # NCCL_ALLOC_P2P_NET_LL_BUFFERS=1 or NCCL_NET_SHARED_BUFFERS=0 (treeattn.sim.nccl.env):
    # send/recv across hosts may use LL. Off, NCCL's default: network p2p connections have
    # no LL buffer, so Simple.
    p2p_net_ll: bool = False
    # NCCL_NET_SHARED_BUFFERS (treeattn.sim.nccl.env): network send/recv connections draw
    # their slots from a pool the proxy hands out one step at a time (net.cc; default on)
    p2p_net_shared: bool = True
    # The communicator's compute channels (``comm->nChannels``, connect.cc): the channels a
    # ring or tree kernel and the p2p operations run on. 0: derived from the fields above
    # (:func:`compute_channel_count`)
    compute_channels: int = 0

    def __post_init__(self) -> None:
        if not self.compute_channels:
            object.__setattr__(self, "compute_channels", compute_channel_count(
                self.family, self.arch, self.nnodes, self.channels, self.intra_speed))

    @property
    def local_lat_scale(self) -> float:
        """The factor on the library's base and node-local hop latencies: the generation's
        (``gen_lat_scale``) times the calibrated one (``lat_scale``)."""
        return self.lat_scale * self.gen_lat_scale

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
        nvls, peer_links = (0, 0.0, 0.0), 0
        if len(local) > 1:
            edges = topology.route(local[0], local[1])
            kinds = {topology.edge(u, v)["kind"] for u, v in edges}
            nvswitch = any(topology.graph.nodes[v].get("kind") == "nvswitch" for _, v in edges)
            intra = "nvlink" if kinds <= {"nvlink", "xgmi"} else "pci"
            line = gpu_spec(model).link_bandwidth or 1.0
            links_out = round(topology.link_bandwidth_out(local[0]) / line)
            channels, speed, p2p_intra = _intra_channels(
                topology, local, family, arch, intra, nvswitch, links_out)
            if intra == "nvlink":
                peer_links = links_out if nvswitch else round(
                    p2p_intra / T.NCCL_NVLINK_BW.get(arch, 20.0))
            if nvswitch and family == "nvidia" and arch in ("hopper", "blackwell"):
                nvls = nvls_graph(arch, len(local), links_out * T.NCCL_NVLINK_BW[arch])
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
        compute = compute_channel_count(family, arch, nnodes, channels, speed)
        p2p_channels, peer_channels = p2p_channel_counts(
            compute, ppn, nnodes, peer_links, intra, nic_bandwidth=p2p_inter,
            nranks=len(gpus))
        return cls(len(gpus), nnodes, ppn, family, arch, intra, nvswitch, channels,
                   speed, inter_speed, p2p_intra, p2p_inter,
                   gen_lat_scale=(T.NCCL_GEN_LATENCY_SCALE_OF_MODEL.get(
                       model, T.NCCL_GEN_LATENCY_SCALE.get(arch, 1.0))
                                  if family == "nvidia" else 1.0),
                   cpu_vendor=cpu_vendor(topology, per_host),
                   cpu_x86=cpu_is_x86(topology, per_host),
                   mnnvl=model in T.MNNVL_MODELS, nvls_channels=nvls[0],
                   nvls_intra_speed=nvls[1], nvls_inter_speed=nvls[2],
                   p2p_channels=p2p_channels, p2p_peer_channels=peer_channels,
                   compute_channels=compute)


def _speeds(table: dict, arch: str) -> tuple[float, ...]:
    return table.get(arch) or table["other"]


def ring_search(arch: str, total: float) -> tuple[int, float]:
    """(search channels, GB/s per channel) of NCCL's ring graph behind an NVSwitch whose
    GPU carries ``total`` GB/s of NVLink (search.cc ``ncclTopoCompute``, nccl_tables).

    Pass 1 takes the first speed one channel fits, as many channels as the GPU's links carry
    at it, and keeps a lower speed (down to 0.49 of it) only for more channels × speed;
    ``ncclTopoDupChannels`` doubles the channels at half the speed; pass 2 raises the speed
    while the channels still fit. A DGX H100: 6 × 60, doubled to 12 × 30 (NCCL's logs say
    12 × 30); a DGX B200: 8 × 90, doubled to 16 × 45.

    >>> ring_search("hopper", 18 * 20.6), ring_search("blackwell", 18 * 40.1)
    ((12, 30.0), (16, 45.0))
    """
    speeds = _speeds(T.NCCL_SPEEDS_INTRA, arch)
    first = next((s for s in speeds if s <= total), speeds[-1])
    best = (max(1, min(T.NCCL_MAX_SEARCH_CHANNELS, int(total // first))), float(first))
    for s in speeds:
        if s < first and s / first > T.NCCL_SEARCH_LOWER_SPEED_FRACTION:
            nch = min(T.NCCL_MAX_SEARCH_CHANNELS, int(total // s))
            if nch * s > best[0] * best[1]:
                best = (nch, float(s))
    nch, speed = best
    sm90_speed, sm90_channels = T.NCCL_DUP_CHANNELS_SM90_SPEED
    sm90 = arch in ("hopper", "blackwell")
    if speed >= T.NCCL_DUP_CHANNELS_MIN_SPEED and not (
            sm90 and speed < sm90_speed and nch > sm90_channels):
        doubled = min(2 * nch, T.NCCL_MAX_SEARCH_CHANNELS)
        speed /= -(-doubled // nch)
        nch = doubled
    for s in sorted(speeds):  # pass 2: the next higher speed, while the channels fit
        if s > speed and nch * s <= total:
            speed = float(s)
    return nch, speed


def nvls_graph(arch: str, ngpus: int, total: float) -> tuple[int, float, float]:
    """(channels, intra GB/s, inter GB/s) of NCCL's NVLS graph on one node of ``ngpus`` GPUs
    that each carry ``total`` GB/s of NVLink (search.cc; nccl_tables: NVLS). (0, 0, 0): none.

    One channel per GPU up to 32 (a head each), every GPU carrying ``(channels + 1) ×
    speed`` (its share of every channel, twice on the one it heads); pass 2 raises the inter
    speed while it is below twice the intra one. 8 H100s: 8 × 40, inter 60 (NCCL's logs);
    4 H100s: 4 × 60, inter 60; 2: 2 × 60.

    >>> nvls_graph("hopper", 8, 18 * 20.6), nvls_graph("hopper", 4, 18 * 20.6)
    ((8, 40.0, 60.0), (4, 60.0, 60.0))
    """
    nch = min(T.NCCL_MAX_NVLS_ARITY, ngpus)
    if ngpus < 2 or nch < 2:
        return 0, 0.0, 0.0
    speeds = _speeds(T.NCCL_SPEEDS_INTRA, arch)
    fitting = [s for s in speeds if (nch + 1) * s <= total]
    if not fitting:
        return 0, 0.0, 0.0
    intra = float(fitting[0])
    inter = intra
    for s in sorted(speeds):
        if s > inter and inter < 2 * intra:
            inter = float(s)
    return nch, intra, inter


def compute_channel_count(family: str, arch: str, nnodes: int, channels: int,
                          ring_bw_intra: float) -> int:
    """The communicator's compute channels (``comm->nChannels``, connect.cc
    ``ncclTopoPostset``) from the ring's ``channels`` search channels at ``ring_bw_intra``
    GB/s each: twice the search channels, doubled once more on sm90+ across nodes when the
    ring's ``bwIntra`` is above 45 GB/s and they are fewer than 16 (nccl_tables: compute
    channels; the rule compares NVIDIA compute capabilities, so NVIDIA GPUs only).

    >>> compute_channel_count("nvidia", "hopper", 1, 12, 30.0)  # a DGX H100
    24
    >>> compute_channel_count("nvidia", "hopper", 4, 1, 48.0)  # one H100 per node
    4
    """
    compute = min(T.NCCL_MAX_CHANNELS, T.NCCL_COMPUTE_CHANNELS_PER_SEARCH * channels)
    rule = T.NCCL_COMPUTE_CHANNELS_REDOUBLE
    if (family == "nvidia" and T.NCCL_COMP_CAP.get(arch, 0) >= rule["min_comp_cap"]
            and nnodes > 1 and ring_bw_intra > rule["min_ring_bw_intra"]
            and compute < rule["below_channels"]):
        compute = min(T.NCCL_MAX_CHANNELS, 2 * compute)
    return compute


def p2p_channel_counts(compute: int, ppn: int, nnodes: int, peer_links: int, intra: str,
                       nic_bandwidth: float, *, nranks: int) -> tuple[int, int]:
    """(p2p channels, channels per peer) of a communicator (paths.cc
    ``ncclTopoComputeP2pChannels``; nccl_tables: the p2p channels rule).

    ``compute`` are the communicator's compute channels (:func:`compute_channel_count`),
    ``peer_links`` the NVLinks to a peer of the node (0: PCIe), ``nic_bandwidth`` the GB/s of
    a GPU's NIC (its rail) across nodes, ``nranks`` the communicator's ranks. On several
    nodes NCCL then halves the per-peer channels while they times the ranks' groups of
    ``NCCL_MAX_DEV_WORK_P2P_PER_BATCH`` (8) exceed the p2p channels, "to fit all the peers
    within a single round" (``p2pMaxPeers`` is the ranks unless the communicator's config
    sets it).

    >>> p2p_channel_counts(24, 8, 1, 18, "nvlink", 0.0, nranks=8)  # a DGX H100: 32, 32 a peer
    (32, 32)
    >>> p2p_channel_counts(24, 8, 32, 18, "nvlink", 50.0, nranks=256)  # 32 groups of 8
    (32, 1)
    """
    total = _pow2_up(compute)
    per_peer = T.NCCL_MAX_CHANNELS
    if ppn > 1:
        per_peer = 2 * max(1, peer_links) if intra == "nvlink" and peer_links else 2
    if nnodes > 1:  # one NIC per GPU (its rail)
        per_peer = min(per_peer, max(1, math.ceil(nic_bandwidth
                                                  / T.NCCL_P2P_PER_CHANNEL_NET_BW)))
    per_peer = _pow2_up(per_peer)
    if nnodes > 1:
        groups = -(-nranks // T.NCCL_MAX_DEV_WORK_P2P_PER_BATCH)
        while per_peer * groups > total and per_peer > 1:
            per_peer //= 2
    return total, min(total, per_peer)


def _pow2_up(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


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
            nch, speed = ring_search(arch, total)
            return nch, speed, total
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


def cpu_is_x86(topology, hosts) -> bool:
    """Whether every host's CPUs are x86 (vendor "intel" or "amd"; a topology that does not
    say is taken as Intel)."""
    by_host = _host_vendors(topology.graph)
    return all(by_host.get(host, {"intel"}) <= {"intel", "amd"} for host in hosts)


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
