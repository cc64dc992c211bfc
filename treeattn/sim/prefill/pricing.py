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
  too, as :mod:`treeattn.runtime.prefill_passq` runs it); and since the K/V never moved,
  each rank's zig-zag prompt K/V must still reach its contiguous storage shard: one
  all-to-all of prompt K/V per layer.
* ``all-gather-kv`` (Llama 3's context parallelism, Dubey et al. 2024, arXiv 2407.21783):
  one all-gather of every rank's K/V per layer, then every rank attends its queries over the
  whole layer, with no overlap; each rank holds the whole layer's K/V meanwhile.

A *context* of ``C`` tokens may precede the prompt: a document or earlier turns whose K/V
are already in the ranks' shards (the engines' persistent KV cache; ``generate
--context-tokens``). Their K/V take part in attention as keys and travel in pass-KV's ring
and all-gather-KV's gather; pass-Q moves only the prompt's queries, which is where it wins.

Collectives are priced by the cost model's library model (NCCL's tuning model on GPUs, gloo's
on CPU ranks); point-to-point messages by its wire time plus the backend's send and receive
overheads. The first token's logits cost one head matmul on one rank. Everything here is
closed-form over ``W²`` (rank, step) pairs, so a 1M-token prefill is priced in milliseconds.
"""

from __future__ import annotations

from dataclasses import dataclass

from treeattn.sim.network import CostModel
from treeattn.sim.payloads import CollectiveOp, SimError
from treeattn.sim.prefill.layout import PrefillLayout, causal_pairs
from treeattn.sim.workload import FP32, DecodeWorkload

PREFILL_ALGORITHMS = ("pass-kv", "pass-q", "all-gather-kv")
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


class _Prefill:
    """The per-rank costs of one layer that every algorithm shares."""

    def __init__(self, topology, model, prompt: int, hardware=None, backend=None,
                 context: int = 0) -> None:
        self.world = topology.num_gpus
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
        self.queries = [sum(b - a for a, b in self.layout.compute(r)) for r in range(w)]
        self.block_tokens = [self.layout.block_length(r) for r in range(w)]
        before = m.dim * m.head_dim * (m.n_heads + 2 * m.n_kv_heads)
        after = m.dim * m.head_dim * m.n_heads + 3 * m.dim * m.ffn_dim
        self.proj = [self._matmul(r, before) for r in range(w)]
        self.rest = [self._matmul(r, after) for r in range(w)]

    def _matmul(self, rank: int, weights: int) -> float:
        t = self.queries[rank]
        nbytes = weights * self.item + 2 * t * self.m.dim * self.item
        return self.cm.compute(rank, nbytes, 2.0 * t * weights) if t else 0.0

    def attend(self, rank: int, q_of: int, k_of: int) -> float:
        """Rank ``rank`` attends the queries of ``q_of`` over the K/V block of ``k_of``."""
        pairs = sum(causal_pairs(q, k) for q in self.layout.compute(q_of)
                    for k in self.layout.block(k_of))
        if not pairs:
            return 0.0
        m = self.m
        nbytes = (self.block_tokens[k_of] * self.per_token
                  + self.queries[q_of] * m.n_heads * m.head_dim * (self.item + FP32))
        return self.cm.hardware[rank].attention_time(nbytes, 4.0 * m.n_heads * m.head_dim * pairs)

    def message(self, src: int, dst: int, nbytes: float) -> float:
        if not nbytes:
            return 0.0
        return self.cm.least_send_s + self.cm.wire(src, dst, nbytes) + self.cm.least_recv_s

    def ring(self, sizes: list[int], work) -> list[float]:
        """End times of a ring whose step ``s`` on rank ``r`` costs ``work(r, s)`` while the
        message of ``sizes[(r - s - 1) % W]`` bytes arrives from ``r - 1`` (overlapped)."""
        w = self.world
        t = list(self.proj)
        for s in range(w):
            start = list(t)
            for r in range(w):
                done = start[r] + work(r, s)
                if s < w - 1:
                    prev = (r - 1) % w
                    arrival = start[prev] + self.message(prev, r, sizes[(r - s - 1) % w])
                    done = max(done, arrival)
                t[r] = done
        return t

    def collective(self, op: CollectiveOp, nbytes: float) -> float:
        return self.cm.collective_time(op, tuple(range(self.world)), max(1, int(nbytes)))

    @property
    def shard_bytes(self) -> int:
        return max(self.layout.lengths) * self.per_token * self.m.n_layers

    def finish(self, algorithm: str, ends: list[float], comm: int, in_flight: int):
        layer = max(e + self.rest[r] for r, e in enumerate(ends))
        attention = max(ends[r] - self.proj[r] for r in range(self.world))
        m, owner = self.m, self.layout.last_owner
        head = self.cm.compute(owner, m.vocab_size * m.dim * self.item,
                               2.0 * m.vocab_size * m.dim)
        peak = self.shard_bytes + in_flight
        capacity = min((h.memory_bytes for h in self.cm.hardware), default=0.0)
        weights = m.weight_bytes_per_token()
        fits = not capacity or peak + weights <= capacity
        return PrefillPrediction(algorithm, m.n_layers * layer + head, layer, attention,
                                 int(comm), int(peak), fits)


def _pass_kv(p: _Prefill) -> PrefillPrediction:
    w = p.world
    sizes = [n * p.per_token for n in p.block_tokens]
    ends = p.ring(sizes, lambda r, s: p.attend(r, r, (r - s) % w))
    return p.finish("pass-kv", ends, max(sizes) * (w - 1), 3 * max(sizes))


def _contributes(p: _Prefill, origin: int, holder: int) -> bool:
    """Whether ``holder``'s block holds a key some query of ``origin`` sees (both sides of the
    runtime skip the partial otherwise)."""
    q, k = p.layout.compute(origin), p.layout.block(holder)
    return bool(q) and bool(k) and k[0][0] < q[-1][1]


def _pass_q(p: _Prefill) -> PrefillPrediction:
    w, m = p.world, p.m
    qbytes = [n * m.n_heads * m.head_dim * p.item for n in p.queries]
    partial = [n * m.n_heads * (m.head_dim + 1) * FP32 for n in p.queries]
    t = list(p.proj)
    for s in range(w + 1):  # the last pass only brings the last partials home
        start = list(t)
        for r in range(w):
            origin = (r - s) % w
            done = start[r]
            if s < w and _contributes(p, origin, r):
                done += p.attend(r, origin, r)
            if s < w - 1:  # the next query block, from r - 1
                prev = (r - 1) % w
                done = max(done, start[prev] + p.message(prev, r, qbytes[(r - s - 1) % w]))
            helper = (r + s - 1) % w  # attended r's queries in the last step
            if s >= 1 and helper != r and _contributes(p, r, helper):
                done = max(done, start[helper] + p.message(helper, r, partial[r]))
            t[r] = done
    kv = max(p.queries) * p.per_token  # each rank's prompt K/V, to their storage owners
    moved = p.collective(CollectiveOp.ALL_TO_ALL, kv) if w > 1 else 0.0
    ends = [e + moved for e in t]
    comm = max(qbytes) * (w - 1) + max(partial) * (w - 1) + kv
    own = max(p.block_tokens) * p.per_token
    return p.finish("pass-q", ends, comm, own + 2 * max(qbytes) + 2 * max(partial) + kv)


def _all_gather(p: _Prefill) -> PrefillPrediction:
    w = p.world
    whole = p.layout.total * p.per_token  # the context's K/V travel too: they are stored
    gather = p.collective(CollectiveOp.ALL_GATHER, whole) if w > 1 else 0.0
    ends = [p.proj[r] + gather + sum(p.attend(r, r, j) for j in range(w)) for r in range(w)]
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
