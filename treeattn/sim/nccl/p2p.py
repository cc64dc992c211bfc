"""What one point-to-point message costs: one model for the engine and the closed forms.

On GPUs whose messages go through NCCL or RCCL (the ``nccl``/``rccl`` backends), a Send/Recv
is priced as the library would run it (:func:`treeattn.sim.nccl.sendrecv.p2p_parts`): the
protocol its enqueue picks for the size and the connection (LL up to 16 KiB inside a host;
across hosts Simple, or LL up to 16 KiB where the backend sets
``NCCL_ALLOC_P2P_NET_LL_BUFFERS=1`` or ``NCCL_NET_SHARED_BUFFERS=0``), that
protocol's ring base latency, the protocol's
per-hop latency for the link class the pair crosses (NVLink/xGMI, PCIe or the network) and
the pair's bandwidth as the library's model sees it (the GPU's NVLink total, its rail's
share of the network), halved for LL. The base latency is split evenly between the sender's
post and the receiver's completion; as a size can take one protocol inside a host and
another across, the two ends pay half of the smaller base and a pair whose protocol's base is
larger carries the difference on its wire (so every message still totals its own protocol's
base plus hop). The communicator is the whole topology, as in the schedules (every rank talks
to every rank).

So the same message costs the same in :mod:`treeattn.sim.engine` and in
:mod:`treeattn.sim.closed_form`, and the same as ``treeattn comm sendrecv``. The engine keeps
its links: a message still books every link of its route, with the hop latency spread over
the route's edges in proportion to their own latencies and each edge held at no more than
the pair's bandwidth, so contention works as before and, uncontended, the wire time is
exactly ``hop + bytes / bandwidth``.

On a one-sided transport (:mod:`treeattn.sim.onesided`: NCCL's symmetric kernels, torch's
``symm_mem``, the MNNVL LL128 FIFOs, each inside one NVLink domain), a message is a store into
the peer's registered buffer: the base latency is the transport's own (``put_base_us``: for
NCCL's symmetric kernels, that of its symmetric all-gather, our analogy), the hop and
bandwidth stay the protocol's.

Elsewhere (CPU ranks on gloo, or a GPU topology priced with the ``gloo`` backend) a message
costs the backend's calibrated ``send_s`` and ``recv_s`` and the route's own link latencies
and bottleneck, as measured (:mod:`treeattn.testbed.host.profiles`).
"""

from __future__ import annotations

LIBRARIES = ("nccl", "rccl")


class P2PModel:
    """Per-message costs for one (topology, backend, hardware): protocol-aware on NCCL/RCCL.

    ``send_s(n)`` and ``recv_s(n)`` are the two ends' software costs, ``hops(a, b, n)`` the
    route's ``(edge, bandwidth B/s, latency s)`` for the engine's link calendar, and
    ``summary(a, b, n)`` its ``(Σ latency, 1 / bottleneck)`` for the closed forms.
    """

    def __init__(self, topology, backend, network, hardware, transport: str = "nccl") -> None:
        self.net = network
        self.backend = backend
        self.library = (backend.name in LIBRARIES
                        and not all(h.name == "cpu" for h in hardware))
        self.shape = None
        self._hops: dict = {}
        self._protocols: dict = {}
        self._prices: dict = {}
        if self.library and topology.num_gpus > 1:
            from treeattn.sim.nccl.env import with_env
            from treeattn.sim.nccl.group_shape import GroupShape

            shape = with_env(GroupShape.of(topology, range(topology.num_gpus)),
                             backend.nccl_env)
            if backend.calibration is not None:  # measured on this cluster: its scales
                shape = backend.calibration.shape(shape)
            self.shape = shape
            self.hosts = [topology.host_of(r) for r in range(topology.num_gpus)]
        else:
            self.library = False
        # the one-sided transport messages are stores on, where this cluster offers it
        self.one_sided = None
        if self.library and transport != "nccl":
            from treeattn.sim.onesided import one_sided

            found = one_sided(transport)
            if found.domain_unavailable(self.shape) is None:
                self.one_sided = found

    def protocol(self, nbytes: float, across: bool = False) -> int:
        """NCCL's protocol index for a message of ``nbytes`` inside a host or across hosts
        (-1: not a library message)."""
        if not self.library:
            return -1
        return self._regime(nbytes)[across]

    def regime(self, nbytes: float) -> tuple[int, int]:
        """``(protocol inside a host, protocol across)`` of a message of ``nbytes``: the key
        under which every size prices alike (``(-1, -1)``: not a library message)."""
        return self._regime(nbytes) if self.library else (-1, -1)

    def _regime(self, nbytes: float) -> tuple[int, int]:
        found = self._protocols.get(nbytes)
        if found is None:
            from treeattn.sim.nccl.sendrecv import p2p_protocol

            found = self._protocols[nbytes] = (p2p_protocol(nbytes, self.shape, False),
                                               p2p_protocol(nbytes, self.shape, True))
        return found

    def _priced(self, nbytes: float) -> tuple:
        """``(half base s, ((hop s, cap B/s) inside a node, (hop s, cap B/s) across))`` of
        the protocols a message of ``nbytes`` takes (cached per pair of protocols). A class
        whose base latency is above the smaller one carries the difference in its hop."""
        key = self._regime(nbytes)
        found = self._prices.get(key)
        if found is None:
            from treeattn.sim.nccl.sendrecv import p2p_parts

            parts = []
            for across in (False, True):
                p, base, hop, gbps = p2p_parts(nbytes, self.shape, across)
                if self.one_sided is not None:
                    base = self.one_sided.put_base_us(self.shape, p == 0)
                parts.append((base, hop, gbps))
            least = min(base for base, _, _ in parts)
            classes = tuple(((hop + base - least) * 1e-6, gbps * 1e9)
                            for base, hop, gbps in parts)
            found = self._prices[key] = (0.5e-6 * least, classes)
        return found

    def send_s(self, nbytes: float) -> float:
        """The sender's post: half the smaller ring base latency of the protocols a message
        of ``nbytes`` takes (or ``send_s``)."""
        if not self.library:
            return self.backend.send_s
        return self._priced(nbytes)[0]

    def recv_s(self, nbytes: float) -> float:
        """The receiver's completion: the other half (or ``recv_s``)."""
        if not self.library:
            return self.backend.recv_s
        return self._priced(nbytes)[0]

    def hops(self, src: int, dst: int, nbytes: float) -> tuple:
        """The route of a message of ``nbytes`` from ``src`` to ``dst``, priced as sent."""
        raw = self.net.hops(src, dst)
        if not self.library or not raw:
            return raw
        key = (src, dst, self._regime(nbytes))
        found = self._hops.get(key)
        if found is None:
            hop, cap = self._priced(nbytes)[1][self.hosts[src] != self.hosts[dst]]
            total = sum(lat for _, _, lat in raw)
            share = ([lat / total for _, _, lat in raw] if total > 0
                     else [1.0 / len(raw)] * len(raw))
            found = tuple((edge, min(bw, cap), hop * f) for (edge, bw, _), f in zip(raw, share))
            self._hops[key] = found
        return found

    def summary_matrices(self, nbytes: float) -> tuple:
        """``(latency, inverse bandwidth)`` (W, W) arrays: :meth:`summary` of every pair for a
        message of ``nbytes``, from the topology's all-pairs route matrices (one pass over
        the routes, which the topology caches) instead of one route look-up per pair."""
        import numpy as np

        topology = self.net.topology
        lat, bw = topology.latency_matrix(), topology.bandwidth_matrix()
        with np.errstate(divide="ignore"):
            inv = np.where(bw > 0, 1.0 / bw, 0.0)
        if not self.library:
            return lat, inv
        (hop_in, cap_in), (hop_x, cap_x) = self._priced(nbytes)[1]
        hosts = np.array([hash(h) for h in self.hosts])
        across = hosts[:, None] != hosts[None, :]
        route = (lat > 0) | (inv > 0)  # a GPU to itself has no route, and costs nothing
        hop = np.where(route, np.where(across, hop_x, hop_in), 0.0)
        floor = np.where(across, 1 / cap_x if cap_x else 0.0, 1 / cap_in if cap_in else 0.0)
        return hop, np.where(route, np.maximum(inv, floor), 0.0)

    def summary(self, src: int, dst: int, nbytes: float) -> tuple[float, float]:
        """``(Σ latency s, 1 / bottleneck B/s)`` of the priced route (that of :meth:`hops`)."""
        raw_lat, raw_inv = self.net.summary(src, dst)
        if not self.library or (raw_lat == 0.0 and raw_inv == 0.0):
            return raw_lat, raw_inv
        hop, cap = self._priced(nbytes)[1][self.hosts[src] != self.hosts[dst]]
        return hop, max(raw_inv, 1.0 / cap)
