"""Time to first token of a context-parallel prefill, per algorithm, on a topology.

Every algorithm runs the zig-zag compute layout of :class:`~treeattn.sim.prefill.layout.
PrefillLayout` (balanced causal work) and must leave each rank with its contiguous shard of
the decode cache. Per layer, on rank ``r`` holding ``T_r`` query tokens:

* the projections (Q/K/V before attention, O and the gated MLP after) cost
  ``2 · T_r · weights`` FLOPs and one read of the layer's weights, the same for every
  algorithm;
* the attention of ``r``'s queries over a block of keys costs ``4 · Hq · D`` FLOPs per causal
  (query, key) pair (:func:`~treeattn.sim.prefill.layout.causal_pairs`: masked tiles are
  skipped, as flash attention does) and one read of the block.

The algorithms differ in what travels and what overlaps:

* ``pass-kv`` (Ring Attention, Liu et al. 2023, arXiv 2310.01889): ``W`` steps; at step
  ``s`` rank ``r`` attends the K/V block of rank ``r - s`` while forwarding it to ``r + 1``
  and receiving the next from ``r - 1``: a step ends when both its attention and the next
  block's arrival are done (the compute-communication overlap of the engine's decode ring).
  Each rank keeps the passing pieces of its storage run: no further traffic.
* ``pass-q`` (Meta's context-parallel inference, Yang et al. 2024, arXiv 2411.01783): the
  query blocks go round instead, with the same overlap; the partial output a rank makes for
  another's queries goes straight back to their owner during the next step (overlapped
  too, as :mod:`treeattn.runtime.prefill.passq` runs it); and since the K/V never moved,
  each rank's zig-zag prompt K/V must still reach its contiguous storage shard: one message
  per (computing rank, storing rank) pair per layer, each rank's sends and receives taking
  turns on its links (:func:`_to_storage`).
* ``all-gather-kv`` (Llama 3's context parallelism, Dubey et al. 2024, arXiv 2407.21783):
  one all-gather of every rank's K/V per layer, then every rank attends its queries over the
  whole layer, with no overlap; each rank holds the whole layer's K/V meanwhile.

A *context* of ``C`` tokens may precede the prompt: a document or earlier turns whose K/V
are already in the ranks' shards (the engines' persistent KV cache; ``generate
--context-tokens``). Their K/V take part in attention as keys and travel in pass-KV's ring
and all-gather-KV's gather; pass-Q moves only the prompt's queries, which is where it wins.

Collectives are priced by the cost model's library model (NCCL's tuning model on GPUs, gloo's
on CPU ranks); point-to-point messages as the decode's are (:mod:`treeattn.sim.nccl.p2p`: on
NCCL/RCCL the protocol each size and pair takes, its two ends' halves of the base latency
and its wire; on gloo the calibrated send and receive costs). The first token's logits cost
one head matmul on one rank. Everything here is closed-form over ``W²`` (rank, step) pairs,
so a 1M-token prefill is priced in milliseconds.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from treeattn.schedule.payloads import CollectiveOp, SimError
from treeattn.schedule.workload import FP32, DecodeWorkload
from treeattn.sim.network import CostModel
from treeattn.sim.prefill.layout import PrefillLayout

PREFILL_ALGORITHMS = ("pass-kv", "pass-q", "all-gather-kv")
# The pricing holds a handful of (W, W) float64 arrays and every pair's route: 4096 GPUs is
# about 1 GiB and half a minute; past that it is refused, not run out of memory.
MAX_PREFILL_GPUS = 4096
SOURCES = {"pass-kv": "Ring Attention (pass-KV)", "pass-q": "Meta CP (pass-Q)",
           "all-gather-kv": "Llama 3 CP (all-gather KV)"}


@dataclass(frozen=True)
class PrefillPrediction:
    """One algorithm's predicted prefill on one topology."""

    algorithm: str
    ttft_s: float  # time to first token: every layer, plus the head
    layer_s: float  # one layer
    attention_s: float  # one layer's attention part (ring, collectives and kernels)
    comm_bytes: int  # bytes the busiest rank sends per layer
    peak_bytes: int  # the most any rank holds beyond the weights: shard + in flight
    fits: bool  # peak + weights within the device memory (True when it is unknown)

    def to_json(self) -> dict:
        return {"algorithm": self.algorithm, "system": SOURCES[self.algorithm],
                "ttft_s": self.ttft_s, "layer_s": self.layer_s, "attention_s": self.attention_s,
                "comm_bytes": self.comm_bytes, "peak_memory_bytes": self.peak_bytes,
                "fits": self.fits}


def _runs(of, world: int, most: int) -> tuple[np.ndarray, np.ndarray]:
    """Starts and stops (world, most) of the runs ``of(rank)`` gives; missing runs empty."""
    starts, stops = np.zeros((world, most)), np.zeros((world, most))
    for r in range(world):
        for i, (a, b) in enumerate(of(r)):
            starts[r, i], stops[r, i] = a, b
    return starts, stops


def _pair_matrix(layout: PrefillLayout, rows: int = 256) -> np.ndarray:
    """(W, W) causal (query, key) pairs: ``[q_of, k_of]``, the queries of rank ``q_of`` over
    the block of rank ``k_of`` (:func:`~treeattn.sim.prefill.layout.causal_pairs`, summed over
    their runs), vectorised: a rank has at most 2 query runs and 3 block runs. Built
    ``rows`` query ranks at a time, so the temporaries stay (rows, W, 2, 3)."""
    w = layout.world
    qa, qb = _runs(layout.compute, w, 2)  # (W, 2) each
    ka, kb = _runs(layout.block, w, 3)  # (W, 3) each
    ka, kb = ka[None, :, None, :], kb[None, :, None, :]  # (1, W, 1, 3)
    tri = lambda n: n * (n + 1) / 2  # noqa: E731
    out = np.empty((w, w))
    for r0 in range(0, w, rows):
        a, b = qa[r0:r0 + rows, None, :, None], qb[r0:r0 + rows, None, :, None]  # (n,1,2,1)
        lo, hi = np.maximum(a, ka), np.minimum(b, kb)
        inside = np.where(hi > lo, tri(hi - ka) - tri(lo - ka), 0.0)
        past = np.maximum(0.0, b - np.maximum(a, kb)) * (kb - ka)
        empty = (b <= ka) | (kb <= ka) | (b <= a)
        out[r0:r0 + rows] = np.where(empty, 0.0, inside + past).sum(axis=(2, 3))
    return out


def _attention_times(hw, nbytes: np.ndarray, flops: np.ndarray) -> np.ndarray:
    """:meth:`HardwareModel.attention_time` over arrays; 0 where there is no pair."""
    rate = hw.attention_flops or hw.peak_flops
    bw = (np.vectorize(hw.bandwidth_at)(nbytes) if hw.bandwidth_shape
          else hw.memory_bandwidth_Bps)
    return np.where(flops > 0, np.maximum(nbytes / bw, flops / rate) + hw.launch_s, 0.0)


class _Prefill:
    """The per-rank costs of one layer that every algorithm shares, as (W,) and (W, W)
    arrays so that a ring of ``W`` steps over ``W`` ranks is ``W`` vector operations."""

    def __init__(self, topology, model, prompt: int, hardware=None, backend=None,
                 context: int = 0) -> None:
        self.world = topology.num_gpus
        if self.world > MAX_PREFILL_GPUS:
            raise SimError(f"the prefill is priced on at most {MAX_PREFILL_GPUS:,} GPUs (it "
                           f"holds arrays of every GPU pair); this cluster has "
                           f"{self.world:,}")
        if prompt < 1:
            raise SimError(f"prefill needs at least one prompt token, got {prompt}")
        if context < 0:
            raise SimError(f"the cached context must not be negative, got {context}")
        self.layout = PrefillLayout(self.world, context, prompt)
        workload = DecodeWorkload(model, max(context + prompt, 2 * self.world))
        self.cm = CostModel(topology, workload, hardware, backend)
        self.m = m = workload.model
        self.item = m.dtype_bytes
        self.per_token = 2 * m.n_kv_heads * m.head_dim * self.item  # one layer's K and V
        w = self.world
        self.queries = np.array([sum(b - a for a, b in self.layout.compute(r))
                                 for r in range(w)], dtype=float)
        self.block_tokens = np.array([self.layout.block_length(r) for r in range(w)],
                                     dtype=float)
        before = m.dim * m.head_dim * (m.n_heads + 2 * m.n_kv_heads)
        after = m.dim * m.head_dim * m.n_heads + 3 * m.dim * m.ffn_dim
        self.proj = np.array([self._matmul(r, before) for r in range(w)])
        self.rest = np.array([self._matmul(r, after) for r in range(w)])
        self.pairs = _pair_matrix(self.layout)  # (W, W) [q_of, k_of]
        nbytes = (self.block_tokens[None, :] * self.per_token
                  + self.queries[:, None] * m.n_heads * m.head_dim * (self.item + FP32))
        flops = 4.0 * m.n_heads * m.head_dim * self.pairs
        hws = self.cm.hardware
        if all(h is hws[0] for h in hws):  # one model: who runs a pair does not matter
            times = _attention_times(hws[0], nbytes, flops)
            self.kv_work, self.q_work = times, times.T
        else:  # kv_work[r, k]: r's queries over k's block; q_work[r, o]: o's over r's block
            self.kv_work = np.stack([_attention_times(h, nbytes[r], flops[r])
                                     for r, h in enumerate(hws)])
            self.q_work = np.stack([_attention_times(h, nbytes[:, r], flops[:, r])
                                    for r, h in enumerate(hws)])

    def _matmul(self, rank: int, weights: int) -> float:
        t = self.queries[rank]
        nbytes = weights * self.item + 2 * t * self.m.dim * self.item
        return self.cm.compute(rank, nbytes, 2.0 * t * weights) if t else 0.0

    def messages(self, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
        """Seconds of each message ``src[i] -> dst[i]`` of ``nbytes[i]`` (0 bytes: none)."""
        nbytes = np.asarray(nbytes, dtype=float)
        sizes = np.maximum(nbytes, 1.0)
        wire = self.cm.wire_vec(src, dst, sizes)
        return np.where(nbytes > 0, self.ends(sizes) + wire, 0.0)

    def ends(self, nbytes) -> np.ndarray:
        """The two ends' software cost of messages of ``nbytes`` (each size's protocol on
        NCCL/RCCL, :mod:`treeattn.sim.nccl.p2p`), elementwise."""
        return self.cm.send_vec(nbytes) + self.cm.send_vec(nbytes, recv=True)

    def ring(self, sizes: np.ndarray, work: np.ndarray) -> np.ndarray:
        """End times of a ring whose step ``s`` on rank ``r`` costs ``work[r, (r - s) % W]``
        while the message of ``sizes[(r - s - 1) % W]`` bytes arrives from ``r - 1``."""
        w = self.world
        ranks = np.arange(w)
        prev = (ranks - 1) % w
        t = self.proj.copy()
        for s in range(w):
            start = t
            t = start + work[ranks, (ranks - s) % w]
            if s < w - 1:
                arrival = start[prev] + self.messages(prev, ranks, sizes[(ranks - s - 1) % w])
                t = np.maximum(t, arrival)
        return t

    def collective(self, op: CollectiveOp, nbytes: float) -> float:
        return self.cm.collective_time(op, tuple(range(self.world)), max(1, int(nbytes)))

    @property
    def shard_bytes(self) -> int:
        return max(self.layout.lengths) * self.per_token * self.m.n_layers

    def finish(self, algorithm: str, ends: np.ndarray, comm: float, in_flight: float):
        layer = float(np.max(ends + self.rest))
        attention = float(np.max(ends - self.proj))
        m, owner = self.m, self.layout.last_owner
        head = self.cm.compute(owner, m.vocab_size * m.dim * self.item,
                               2.0 * m.vocab_size * m.dim)
        peak = self.shard_bytes + in_flight
        capacity = min((h.memory_bytes for h in self.cm.hardware), default=0.0)
        weights = m.weight_bytes_per_token()
        fits = bool(not capacity or peak + weights <= capacity)
        return PrefillPrediction(algorithm, m.n_layers * layer + head, layer, attention,
                                 int(comm), int(peak), fits)


def _pass_kv(p: _Prefill) -> PrefillPrediction:
    w = p.world
    sizes = p.block_tokens * p.per_token
    ends = p.ring(sizes, p.kv_work)
    return p.finish("pass-kv", ends, sizes.max() * (w - 1), 3 * sizes.max())


def _pass_q(p: _Prefill) -> PrefillPrediction:
    """As :mod:`treeattn.runtime.prefill.passq` runs it: at step ``s`` rank ``r`` attends the
    queries of ``r - s`` over its own block while the next query block arrives from
    ``r - 1`` and the partial ``r + s - 1`` made of ``r``'s queries in the last step comes
    back; a partial of no pair is neither made nor sent (both sides know it)."""
    w, m = p.world, p.m
    qbytes = p.queries * m.n_heads * m.head_dim * p.item
    partial = p.queries * m.n_heads * (m.head_dim + 1) * FP32
    ranks = np.arange(w)
    prev = (ranks - 1) % w
    # the partials go between every pair over the ring's steps: all pairs' routes at once
    lat, inv = _pair_summaries(p, np.broadcast_to(partial[None, :], (w, w)))
    overheads = p.ends(np.maximum(partial, 1.0))  # (W,): the partial of each rank's queries
    t = p.proj.copy()
    for s in range(w + 1):  # the last pass only brings the last partials home
        start = t
        t = start + (p.q_work[ranks, (ranks - s) % w] if s < w else 0.0)
        if s < w - 1:  # the next query block, from r - 1
            arrival = start[prev] + p.messages(prev, ranks, qbytes[(ranks - s - 1) % w])
            t = np.maximum(t, arrival)
        if s >= 1:  # the partial of r's queries, from the rank that made it last step
            helper = (ranks + s - 1) % w
            sent = (helper != ranks) & (p.pairs[ranks, helper] > 0)
            back = lat[helper, ranks] + partial * inv[helper, ranks] + overheads
            t = np.maximum(t, start[helper] + np.where(sent, back, 0.0))
    pieces = _moved_matrix(p.layout) * p.per_token  # (W, W) prompt K/V [computed, stored]
    ends = _to_storage(p, t, pieces) if w > 1 else t
    kv = float(pieces.sum(axis=1).max()) if w > 1 else 0.0  # the most one rank sends
    comm = qbytes.max() * (w - 1) + partial.max() * (w - 1) + kv
    own = p.block_tokens.max() * p.per_token
    landing = float(pieces.sum(axis=0).max()) if w > 1 else 0.0
    return p.finish("pass-q", ends, comm,
                    own + 2 * qbytes.max() + 3 * partial.max() + landing)


def _moved_matrix(layout: PrefillLayout) -> np.ndarray:
    """(W, W) prompt positions rank ``k`` computed that rank ``o`` stores, ``[k, o]``, off
    the diagonal (a rank's own pieces are stored in place)."""
    w = layout.world
    qa, qb = _runs(layout.compute, w, 2)
    lo = np.array([layout.storage(r)[0] for r in range(w)], dtype=float)
    hi = np.array([layout.storage(r)[1] for r in range(w)], dtype=float)
    out = np.zeros((w, w))
    for i in range(2):  # (W, 1) runs against (1, W) storage runs
        out += np.maximum(0.0, np.minimum(qb[:, i, None], hi[None, :])
                          - np.maximum(qa[:, i, None], lo[None, :]))
    np.fill_diagonal(out, 0.0)
    return out


def _pair_summaries(p: _Prefill, nbytes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(W, W) latency and inverse bandwidth of a message of ``nbytes[src, dst]`` between
    every pair, each with the protocol NCCL picks for its size (one pass over all routes
    per protocol, :meth:`~treeattn.sim.nccl.p2p.P2PModel.summary_matrices`)."""
    w = p.world
    lat, inv = np.zeros((w, w)), np.zeros((w, w))
    by_protocol: dict[tuple, list[float]] = {}
    for n in np.unique(nbytes[nbytes > 0]):
        by_protocol.setdefault(p.cm.p2p.regime(float(n)), []).append(float(n))
    for sizes in by_protocol.values():
        pick = np.isin(nbytes, sizes)
        route_lat, route_inv = p.cm.p2p.summary_matrices(sizes[0])
        lat, inv = np.where(pick, route_lat, lat), np.where(pick, route_inv, inv)
    return lat, inv


def _to_storage(p: _Prefill, ready: np.ndarray, pieces: np.ndarray) -> np.ndarray:
    """End times of the K/V pieces' messages, all posted at once when each sender is ready.

    Our model of one round of point-to-point messages between every pair: a rank's pieces
    leave one after another over its links, and a rank's incoming pieces arrive one after
    another over its links, each at its route's bandwidth as NCCL's protocol sees it, after
    the first's latency. With a long cached context the prompt's K/V all belong to the last
    ranks, so their incoming side is what takes the time, which an even all-to-all would
    not show."""
    lat, inv = _pair_summaries(p, pieces)
    some = pieces > 0
    overheads = p.ends(np.maximum(pieces, 1.0))  # (W, W), [sender, receiver]
    wire = pieces * inv  # (W, W) seconds on the wire, [sender, receiver]
    first = np.where(some, ready[:, None] + lat + overheads, -np.inf)  # (W, W)
    received = np.where(some.any(axis=0), first.max(axis=0) + wire.sum(axis=0), 0.0)
    sent = ready + wire.sum(axis=1)
    return np.maximum.reduce([ready, received, sent])


def _all_gather(p: _Prefill) -> PrefillPrediction:
    w = p.world
    whole = p.layout.total * p.per_token  # the context's K/V travel too: they are stored
    gather = p.collective(CollectiveOp.ALL_GATHER, whole) if w > 1 else 0.0
    ends = p.proj + gather + p.kv_work.sum(axis=1)
    return p.finish("all-gather-kv", ends, whole * (w - 1) // w, whole)


_PRICERS = {"pass-kv": _pass_kv, "pass-q": _pass_q, "all-gather-kv": _all_gather}


def predict_prefill(topology, model, prompt: int, hardware=None, backend=None,
                    algorithms=PREFILL_ALGORITHMS, context: int = 0) -> list[PrefillPrediction]:
    """Every algorithm's prefill of ``prompt`` tokens after ``context`` cached ones, fastest
    first (those that fit first)."""
    unknown = [a for a in algorithms if a not in _PRICERS]
    if unknown:
        raise SimError(f"unknown prefill algorithm {unknown[0]!r} (known: "
                       f"{', '.join(PREFILL_ALGORITHMS)})")
    p = _Prefill(topology, model, prompt, hardware, backend, context)
    out = [_PRICERS[a](p) for a in algorithms]
    return sorted(out, key=lambda x: (not x.fits, x.ttft_s))
