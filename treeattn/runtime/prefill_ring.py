"""Context-parallel prefill attention: a ring that passes KV blocks (pass-KV), causally balanced.

The sequence's ``N = C + P`` positions are a *document* of ``C`` tokens whose K/V are known
without running the model (:mod:`treeattn.llm.generate_context`; ``C = 0`` for a plain
prompt) followed by ``P`` prompt tokens that the model runs through. Two layouts meet here:

* **Storage** (the decode cache's layout, :class:`treeattn.llm.cache.ShardedKVCache`): rank
  ``r`` keeps the contiguous run ``offsets[r] .. offsets[r] + lengths[r]`` of the ``N``
  positions, ``lengths = split_lengths(N, world)``.
* **Compute** (zig-zag over the prompt): the ``P`` prompt positions are cut into ``2W``
  contiguous chunks and rank ``r`` runs the queries of chunks ``r`` and ``2W-1-r``, as in
  the zig-zag layout of ring attention for training. Why: causal attention of a query at
  position ``i`` costs ``i`` keys, so the contiguous split would give the last rank
  ``2W-1`` times the first one's work; pairing an early chunk with the mirrored late chunk
  gives every rank the same number of (query, key) pairs to within one chunk.

The two layouts are reconciled for free: in a pass-KV ring every rank's block visits every
other rank, so each rank *keeps* the parts of the blocks passing by that fall into its storage
run, and no all-to-all is needed at the end.

Per layer, rank ``r``'s block is ``(2, B, Hkv, S_r, D)``: the document part of its storage run
(positions ``< C``) followed by the K/V of its own compute chunks. Ring step ``s`` attends the
block of rank ``(r - s) mod W`` while the next one is on the wire (one ``isend`` to ``r+1``,
one ``irecv`` from ``r-1``, both posted before the step's attention). A rank therefore holds,
besides its storage shard, at most three blocks of one layer: its own (being built), the one
being attended to and forwarded, and the one arriving. Every rank knows every block's runs
from the layout alone, so only tensors travel, and empty blocks are never sent.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import torch

from treeattn.runtime.errors import RuntimeFailure
from treeattn.runtime.group import RankContext, wait_work
from treeattn.runtime.shm import MAX_TAGS
from treeattn.runtime.transport import transport_for

PREFILL_TAG = MAX_TAGS + 16  # above the mailboxes' tags: blocks always take the process group
TILE_Q, TILE_K = 256, 1024  # score tiles: bound the (queries x keys) fp32 scratch
PREFILL_ALGORITHMS = ("pass-kv",)  # what the runtime runs; the simulator prices more

Run = tuple[int, int]  # positions start .. stop-1


def split_even(n: int, parts: int) -> list[int]:
    """``n`` split into ``parts`` contiguous lengths; the first ``n % parts`` get one more.

    >>> split_even(5, 3), split_even(1, 3)
    ([2, 2, 1], [1, 0, 0])
    """
    base, extra = divmod(n, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def _runs_length(runs: tuple[Run, ...]) -> int:
    return sum(b - a for a, b in runs)


@dataclass(frozen=True)
class PrefillLayout:
    """Which positions each rank stores and which queries it computes (module docstring)."""

    world: int
    context: int  # C: document positions 0 .. C-1, K/V known without the model
    prompt: int  # P: prompt positions C .. C+P-1, run through the model

    def __post_init__(self) -> None:
        if self.world < 1 or self.context < 0 or self.prompt < 1:
            raise RuntimeFailure(f"bad prefill layout: world {self.world}, context "
                                 f"{self.context}, prompt {self.prompt}")

    @property
    def total(self) -> int:
        return self.context + self.prompt

    @cached_property
    def lengths(self) -> list[int]:
        """Storage shard lengths (the decode cache's contiguous split)."""
        return split_even(self.total, self.world)

    def storage(self, rank: int) -> Run:
        lo = sum(self.lengths[:rank])
        return lo, lo + self.lengths[rank]

    def document(self, rank: int) -> Run:
        """The document positions of ``rank``'s storage run (possibly empty)."""
        lo, hi = self.storage(rank)
        return min(lo, self.context), min(hi, self.context)

    @cached_property
    def _chunks(self) -> list[Run]:
        out, pos = [], self.context
        for n in split_even(self.prompt, 2 * self.world):
            out.append((pos, pos + n))
            pos += n
        return out

    def compute(self, rank: int) -> tuple[Run, ...]:
        """The prompt positions whose queries ``rank`` runs: zig-zag chunks, ascending."""
        pair = (self._chunks[rank], self._chunks[2 * self.world - 1 - rank])
        return tuple(run for run in pair if run[1] > run[0])

    def block(self, rank: int) -> tuple[Run, ...]:
        """The runs of ``rank``'s ring block, in the block's order (document first)."""
        doc = self.document(rank)
        head = (doc,) if doc[1] > doc[0] else ()
        return head + self.compute(rank)

    def block_length(self, rank: int) -> int:
        return _runs_length(self.block(rank))

    @property
    def last_owner(self) -> int:
        """The rank whose queries include the last position (it computes the logits)."""
        last = self.total - 1
        return next(r for r in range(self.world)
                    if any(a <= last < b for a, b in self.compute(r)))

    def positions(self, rank: int, queries: bool = False) -> list[int]:
        """The positions of ``rank``'s block (or of its queries), in order; cached."""
        key = (rank, queries)
        if key not in self._positions:
            runs = self.compute(rank) if queries else self.block(rank)
            self._positions[key] = [p for a, b in runs for p in range(a, b)]
        return self._positions[key]

    @cached_property
    def _positions(self) -> dict:
        return {}

    def pairs(self, rank: int) -> int:
        """Causal (query, key) pairs ``rank`` attends: the balance the zig-zag buys."""
        return sum(b * (b + 1) // 2 - a * (a + 1) // 2 for a, b in self.compute(rank))


def run_positions(runs: tuple[Run, ...], device) -> torch.Tensor:
    """The positions of ``runs``, concatenated (n,) int64."""
    if not runs:
        return torch.zeros(0, dtype=torch.int64, device=device)
    return torch.cat([torch.arange(a, b, device=device) for a, b in runs])


def _merge(acc, part):
    """Log-sum-exp merge of two partials ``(o (B,Hq,T,D), lse (B,Hq,T))``, fp32; rows with
    ``lse = -inf`` (no key seen) are the identity."""
    (o1, l1), (o2, l2) = acc, part
    m = torch.maximum(l1, l2)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # both -inf: weights 0
    w1, w2 = torch.exp(l1 - m), torch.exp(l2 - m)  # (B, Hq, T)
    total = w1 + w2
    safe = torch.where(total > 0, total, torch.ones_like(total))
    o = (o1 * w1[..., None] + o2 * w2[..., None]) / safe[..., None]  # (B, Hq, T, D)
    return o, m + torch.log(total)


def causal_partial(q: torch.Tensor, q_pos: list[int], kv: torch.Tensor, k_pos: list[int],
                   scale: float | None = None):
    """Partial attention of ``q`` (B, Hq, T, D) at ascending positions ``q_pos`` over the keys
    of ``kv`` (2, B, Hkv, S, D) at ascending ``k_pos``, query ``i`` seeing keys ``<= q_pos[i]``.

    Returns ``(o (B,Hq,T,D), lse (B,Hq,T))`` in fp32; a query that sees no key gets
    ``(0, -inf)``. Tiled (:data:`TILE_Q` x :data:`TILE_K`) so the fp32 scores stay small;
    tiles wholly in the future are skipped and wholly past ones need no mask.
    """
    b, hq, t, d = q.shape
    hkv, s = kv.shape[2], kv.shape[3]
    group = hq // hkv
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    o = torch.zeros(b, hq, t, d, dtype=torch.float32, device=q.device)
    lse = torch.full((b, hq, t), -math.inf, dtype=torch.float32, device=q.device)
    qp_all = torch.tensor(q_pos, dtype=torch.int64, device=q.device)  # (T,)
    kp_all = torch.tensor(k_pos, dtype=torch.int64, device=q.device)  # (S,)
    for q0 in range(0, t, TILE_Q):
        q1 = min(t, q0 + TILE_Q)
        n = q1 - q0
        qt = q[:, :, q0:q1].float().reshape(b, hkv, group * n, d)  # (B, Hkv, G*n, D)
        acc = (torch.zeros(b, hkv, group * n, d, dtype=torch.float32, device=q.device),
               torch.full((b, hkv, group * n), -math.inf, dtype=torch.float32, device=q.device))
        for k0 in range(0, s, TILE_K):
            k1 = min(s, k0 + TILE_K)
            if k_pos[k0] > q_pos[q1 - 1]:
                break  # this tile and all later ones are in every query's future
            kt, vt = kv[0, :, :, k0:k1].float(), kv[1, :, :, k0:k1].float()  # (B, Hkv, m, D)
            scores = torch.matmul(qt, kt.transpose(-1, -2)) * scale  # (B, Hkv, G*n, m)
            if k_pos[k1 - 1] > q_pos[q0]:  # some key is in some query's future
                mask = kp_all[None, k0:k1] <= qp_all[q0:q1, None]  # (n, m)
                scores = scores.masked_fill(~mask.repeat(group, 1), -math.inf)
            tile_lse = torch.logsumexp(scores, dim=-1)  # (B, Hkv, G*n)
            finite = torch.where(torch.isinf(tile_lse), torch.zeros_like(tile_lse), tile_lse)
            probs = torch.exp(scores - finite[..., None])  # masked entries exp(-inf) = 0
            acc = _merge(acc, (torch.matmul(probs, vt), tile_lse))
        o[:, :, q0:q1] = acc[0].reshape(b, hq, n, d)
        lse[:, :, q0:q1] = acc[1].reshape(b, hq, n)
    return o, lse


@dataclass
class RingStats:
    """What one rank's rings moved and held, summed over layers."""

    bytes_sent: int = 0
    peak_block_bytes: int = 0  # the most bytes of ring blocks held at once (one layer)


def ring_attention(ctx: RankContext, layout: PrefillLayout, q: torch.Tensor,
                   own: torch.Tensor, keep: Callable[[int, torch.Tensor], None],
                   stats: RingStats | None = None, scale: float | None = None) -> torch.Tensor:
    """One layer's causal attention of this rank's queries over every earlier position.

    ``q`` (B, Hq, T, D) are this rank's compute queries (``layout.compute(rank)``); ``own``
    (2, B, Hkv, S, D) is this rank's block (``layout.block(rank)``). ``keep(src, block)`` is
    called once with every block as it is attended, ``src`` the rank it belongs to, so the
    caller can store what falls in its storage run. Returns the output (B, Hq, T, D) fp32.
    """
    rank, world = ctx.rank, ctx.world
    transport = transport_for(ctx) if world > 1 else None
    q_pos = layout.positions(rank, queries=True)
    b, hq, t, d = q.shape
    acc = (torch.zeros(b, hq, t, d, dtype=torch.float32, device=q.device),
           torch.full((b, hq, t), -math.inf, dtype=torch.float32, device=q.device))
    current = own
    for step in range(world):
        src = (rank - step) % world
        pending = []
        nxt = None
        if step < world - 1:  # forward the current block, receive the next one
            incoming = (rank - step - 1) % world
            if current.shape[3]:
                pending.append((transport.isend(current.contiguous(), (rank + 1) % world,
                                                PREFILL_TAG + step), (rank + 1) % world))
                if stats is not None:
                    stats.bytes_sent += current.numel() * current.element_size()
            n_in = layout.block_length(incoming)
            if n_in:
                nxt = current.new_empty(*current.shape[:3], n_in, current.shape[4])
                pending.append((transport.irecv(nxt, (rank - 1) % world, PREFILL_TAG + step),
                                (rank - 1) % world))
        if stats is not None:
            blocks = {id(x): x for x in (own, current, nxt) if x is not None}
            held = sum(x.numel() * x.element_size() for x in blocks.values())
            stats.peak_block_bytes = max(stats.peak_block_bytes, held)
        if current.shape[3]:
            keep(src, current)
            k_pos = layout.positions(src)
            if t and k_pos[0] <= q_pos[-1]:
                acc = _merge(acc, causal_partial(q, q_pos, current, k_pos, scale))
        for work, peer in pending:
            wait_work(work, ctx, peer, f"prefill ring step {step}")
        if step < world - 1:
            current = nxt if nxt is not None else own.new_empty(*own.shape[:3], 0, own.shape[4])
    return acc[0]
