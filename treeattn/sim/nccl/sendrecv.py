"""Send/recv and all-to-all, priced as NCCL and RCCL run them: as p2p transfers.

NCCL has no table for send/recv or all-to-all (it runs them as p2p transfers). We price a
p2p message as one hop of the protocol NCCL's enqueue picks for it (:func:`p2p_protocol`: LL
only where the connection has LL buffers, which network connections lack by default):
``baseLat[ring] + hwLat[class]`` (the tree's network latency across hosts, where a lone
message's latency is fully exposed), at the pair's bandwidth (halved for LL, whose flags
take half of each line); an all-to-all as the group of p2p transfers to every peer
(:func:`all_to_all`). That is our own analogy, stated as such in the fidelity report.
"""

from __future__ import annotations

import math

from treeattn.sim.nccl import tables as T
from treeattn.sim.nccl.cost import CollectiveCost, net_overhead_us, priced
from treeattn.sim.nccl.group_shape import GroupShape


def p2p_protocol(nbytes: float, s: GroupShape, across_nodes: bool = False) -> int:
    """NCCL's protocol for one send/recv of ``nbytes`` on communicator ``s`` (0 LL, 2 Simple).

    ``addP2pToPlan`` (enqueue.cc) keeps LL only where the connection has an LL buffer and
    the bytes are at most ``nChannels × 16 KiB``,
    ``nChannels = min(nChannelsMin, ceil(bytes / minPartSize))``; the minimum part is the p2p
    chunk over 8 on one node, over 2 on several (512 KiB chunks on an all-NVLink node, 128 KiB
    otherwise). So 64 KiB parts (one channel, LL up to 16 KiB) on NVLink and across nodes,
    16 KiB parts (up to ``nChannelsMin`` = 2 channels, LL up to 32 KiB) on one PCIe node.
    A connection to another host (NCCL's net transport) has an LL buffer only under
    ``NCCL_ALLOC_P2P_NET_LL_BUFFERS=1`` or with its own (unshared) buffers,
    ``NCCL_NET_SHARED_BUFFERS=0`` (``s.p2p_net_ll``, :mod:`treeattn.sim.nccl.env`), so by
    default every message across hosts is Simple; inside a host the p2p and shm transports
    always map one. RCCL runs the same code (its enqueue.cc keeps NCCL_P2P_LL_THRESHOLD, its
    init.cc the same parameter, default 0).

    >>> from treeattn.topo import Topology
    >>> two = GroupShape.of(Topology.from_spec("dgx-h100:nodes=2"), range(16))
    >>> p2p_protocol(16384, two), p2p_protocol(16384, two, across_nodes=True)
    (0, 2)
    """
    if across_nodes and not s.p2p_net_ll:
        return 2
    if s.nnodes == 1 and s.intra == "nvlink":
        chunk, divisor = T.NCCL_P2P_CHUNK["nvlink"], 8
    else:
        chunk, divisor = T.NCCL_P2P_CHUNK["other"], 8 if s.nnodes == 1 else 2
    min_part = chunk // divisor
    channels = max(1, min(T.NCCL_P2P_CHANNELS, math.ceil(nbytes / min_part)))
    return 0 if nbytes <= channels * T.NCCL_P2P_LL_THRESHOLD else 2


def p2p_parts(nbytes: float, s: GroupShape, across_nodes: bool) -> tuple[int, float, float,
                                                                         float]:
    """``(protocol, base µs, hop µs, GB/s)`` of one send/recv: THE p2p price, which the engine
    (:mod:`treeattn.sim.nccl.p2p`), the closed forms, the all-to-all and :func:`p2p_cost` all
    use.

    NCCL has no p2p table; our analogy is one hop of the chosen protocol
    (:func:`p2p_protocol`, which depends on whether the pair crosses hosts):
    ``baseLat[ring][p]`` plus the library's per-hop latency for the link class, at the
    pair's bandwidth as the tuning model sees it (the GPU's NVLink total, or its rail's share
    of the network), halved for LL, whose flags take half of each line. The per-hop latency
    is given per algorithm and a send/recv is neither. Across hosts a lone message's latency
    is fully exposed, and for that case NCCL's own model uses the tree's network latency
    (``tuning.cc``: "With ppn=1 latencies are fully exposed, use the Tree network latency"):
    5.0 µs for LL, 14.0 µs for Simple on NCCL; 10.5 and 25 µs on RCCL (whose tuned 320 µs
    ring-Simple network hop is a selection weight, not a hop's cost). Inside a host we take
    the smaller of the ring's and the tree's figure (the ring's, but PCIe Simple).

    Across hosts NCCL adds one proxy post that its collectives do not pay
    (:func:`slot_post_us`).
    """
    hw = "net" if across_nodes else s.intra
    bw = s.p2p_inter_GBps if across_nodes else s.p2p_intra_GBps
    p = p2p_protocol(nbytes, s, across_nodes)
    hop_scale = s.net_lat_scale if hw == "net" else s.local_lat_scale
    base_t, hw_t = ((T.RCCL_BASE_LAT, T.RCCL_HW_LAT) if s.family == "amd"
                    else (T.NCCL_BASE_LAT, T.NCCL_HW_LAT))
    hop = hw_t[hw]["tree"][p] if across_nodes else min(hw_t[hw]["ring"][p], hw_t[hw]["tree"][p])
    hop *= hop_scale
    if across_nodes:
        hop += slot_post_us(s, p)
    return (p, base_t["ring"][p] * s.local_lat_scale, hop, bw * (0.5 if p == 0 else 1.0))


def slot_post_us(s: GroupShape, p: int) -> float:
    """The proxy's slot post that a send/recv across hosts waits on, µs (0 where none).

    NCCL 2.30.7 ``src/transport/net.cc``: a connection set up without a graph (send/recv's)
    is *shared* unless ``NCCL_NET_SHARED_BUFFERS=0`` (``sendSetup``); a shared send
    connection starts with no credit (``sendConnect``: head = −NCCL_STEPS, "Don't give
    credits yet in shared mode"), and the GPU may write a step only after the proxy has
    taken a slot from the pool and posted its offset and the head (``sendProxyProgress``,
    "Post buffers to the GPU"). A ring's or tree's connection (``graph`` set) owns its
    buffers and starts with every credit, so the per-hop latencies NCCL tunes for those
    algorithms do not contain this post. We price it as one network post at NCCL's own
    figure for one (``getNetOverhead`` in ``tuning.cc``, "Network post overhead": 1 µs on
    Intel and other hosts, 2 on AMD), whatever the protocol: the ×3 NCCL charges a Simple
    ring step covers that step's whole proxy work, not one post. Our analogy. RCCL is left
    as is (its transport was not checked).

    >>> from treeattn.topo import Topology
    >>> two = GroupShape.of(Topology.from_spec("dgx-h100:nodes=2"), range(16))
    >>> slot_post_us(two, 2), slot_post_us(two, 0)
    (1.0, 1.0)
    """
    if s.family != "nvidia" or not s.p2p_net_shared:
        return 0.0
    return net_overhead_us(s, 0)


def p2p_cost(nbytes: int, s: GroupShape, *, across_nodes: bool | None = None,
             op: str = "sendrecv") -> CollectiveCost:
    """One send/recv of ``nbytes`` between two ranks of ``s`` (see :func:`p2p_parts`)."""
    net = s.nnodes > 1 if across_nodes is None else across_nodes
    p, base, hop, bw = p2p_parts(nbytes, s, net)
    return priced(op, nbytes, "p2p", p, base + hop, bw)


def _a2a_channel_limits(s: GroupShape) -> tuple[int, int, int, int]:
    """(channels a small peer transfer may start on, most channels a peer's transfer gets,
    bytes of a minimum part, bytes of a maximum part) in an all-to-all (enqueue.cc
    ``scheduleP2pTasksToPlan``, ``addP2pToPlan``): ``nChannelsMin`` is the per-peer channels
    halved until they times the ranks fit in the p2p channels, ``nChannelsMax`` the per-peer
    channels; a part is at least the p2p chunk over 8 on one node, over 2 on several (64
    KiB on NVLink), and NCCL doubles a transfer's channels (up to ``nChannelsMax``) while its
    part is above the chunk × 32 on one node, the chunk on several.

    >>> from treeattn.topo import Topology
    >>> _a2a_channel_limits(GroupShape.of(Topology.from_spec("dgx-h100"), range(8)))
    (4, 32, 65536, 16777216)
    """
    most = max(1, s.p2p_peer_channels)
    start = most
    while start * s.nranks > s.p2p_channels and start > 1:
        start //= 2
    chunk = T.NCCL_P2P_CHUNK["nvlink" if s.nnodes == 1 and s.intra == "nvlink" else "other"]
    if s.nnodes == 1:
        return start, most, chunk // 8, chunk * 32
    return start, most, chunk // 2, chunk


def _peer_channels(per_peer: float, s: GroupShape) -> float:
    """The channels one peer's transfer of ``per_peer`` bytes runs on in an all-to-all, as a
    real number: NCCL's count is ``min(nChannelsMin, ceil(bytes / minPart))``, doubled while
    the part is above the maximum part (:func:`_a2a_channel_limits`); we take the lower
    envelope, ``bytes / minPart`` between 1 and ``nChannelsMin``, then ``bytes / maxPart`` up
    to ``nChannelsMax`` (never more channels than NCCL's, so the time never falls where a
    part is added).

    >>> from treeattn.topo import Topology
    >>> two = GroupShape.of(Topology.from_spec("dgx-h100:nodes=2"), range(16))
    >>> [_peer_channels(b, two) for b in (4096, 131072, 262144, 524288, 1 << 20)]
    [1.0, 2.0, 2.0, 4.0, 4.0]
    """
    start, most, min_part, max_part = _a2a_channel_limits(s)
    channels = max(1.0, min(float(start), per_peer / min_part))
    if per_peer / channels > max_part:
        channels = max(channels, min(float(most), per_peer / max_part))
    return channels


def all_to_all(nbytes: int, s: GroupShape) -> CollectiveCost:
    """All-to-all as NCCL runs it: a group of sends and receives of ``nbytes / n`` to and from
    every peer, all in flight together (NCCL has no all-to-all algorithm: nccl-tests'
    ``alltoall`` calls ``ncclSend``/``ncclRecv`` to every peer inside one group).

    Latency (our analogy, NCCL keeps no all-to-all entry): for the peers of the node, the
    tuning model's latency of a ring all-gather over the same ranks at the chosen protocol,
    ``baseLat[ring] + (n − 1) · hwLat[class][ring]``: each GPU moves the same ``n − 1``
    shares, and a 2-rank all-to-all is one send/recv. For network peers, one message's
    latency plus the proxy posting each further peer's send and receive one after another
    at NCCL's network post overhead (``getNetOverhead``, by CPU vendor, ×3 for Simple). So
    it grows with the peer count, and never beats one message.

    Bandwidth: each peer's transfer runs on the channels :func:`_peer_channels` gives (the
    lower envelope of NCCL's count; never more channels than NCCL's, so the time never falls
    where a part is added;
    :func:`~treeattn.sim.nccl.collectives.run_channels`
    instead takes the upper envelope of NCCL's floor count), at the compute channel's share
    of the ring's bus bandwidth (search channels × speed / compute channels), the peers of
    one class together at most that class's bandwidth (the GPU's NVLink total, or its
    rail's share of the network); LL halves both.
    """
    per_peer = nbytes // max(1, s.nranks)
    parts = []
    if s.ppn > 1:
        p, base, hop, bw = p2p_parts(per_peer, s, False)
        local = s.ppn - 1
        wire = local * per_peer / (bw * 1e9)
        if s.family == "nvidia" and s.intra_speed > 0:
            per_channel = s.channels * s.intra_speed / s.compute_channels * (
                0.5 if p == 0 else 1.0)
            peer_channels = _peer_channels(per_peer, s)
            peer_bw = min(bw, peer_channels * per_channel)
            wire = max(wire, per_peer / (peer_bw * 1e9))
        parts.append((p, base + local * hop, wire))
    if s.nnodes > 1:
        p, base, hop, bw = p2p_parts(per_peer, s, True)
        remote = s.nranks - s.ppn
        posts = (remote - 1) * net_overhead_us(s, p)  # one step (send + receive) per peer
        parts.append((p, base + hop + posts, remote * per_peer / (bw * 1e9)))
    latency = max(lat for _, lat, _ in parts) * 1e-6
    wire = max(w for _, _, w in parts)
    bandwidth = nbytes / wire if wire else math.inf
    return CollectiveCost("all_to_all", int(nbytes), "p2p", T.PROTOCOLS[parts[-1][0]], latency,
                          bandwidth, latency + wire)
