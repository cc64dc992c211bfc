"""Where a context-parallel prefill puts each position: storage shards and zig-zag queries.

The sequence's ``N = C + P`` positions are a *document* of ``C`` tokens whose K/V are known
without running the model (``C = 0`` for a plain prompt) and ``P`` prompt tokens the model
runs through. Storage is the decode cache's contiguous split (rank ``r`` keeps
``split_even(N, W)[r]`` positions, in rank order); compute is zig-zag over the prompt: its
``P`` positions are cut into ``2W`` contiguous chunks and rank ``r`` runs the queries of
chunks ``r`` and ``2W-1-r``. Why zig-zag: causal attention of the query at position ``i``
costs ``i + 1`` keys, so a contiguous split gives the last rank ``2W-1`` times the first
one's work, while pairing an early chunk with its mirror gives every rank the same number of
(query, key) pairs to within one chunk's worth (:meth:`PrefillLayout.pairs`).

Shared by the runtime's ring (:mod:`treeattn.runtime.prefill.ring`) and the simulator's
pricing (:mod:`treeattn.sim.prefill.pricing`), so both see the very same blocks; pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from treeattn.schedule.payloads import SimError

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
            raise SimError(f"bad prefill layout: world {self.world}, context "
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

    def sees(self, q_of: int, k_of: int) -> bool:
        """Whether some query of ``q_of`` sees some key of ``k_of``'s block: the attention
        of the one over the other is not empty (both rings skip it otherwise)."""
        q_pos, k_pos = self.positions(q_of, queries=True), self.positions(k_of)
        return bool(q_pos) and bool(k_pos) and k_pos[0] <= q_pos[-1]

    def pairs(self, rank: int) -> int:
        """Causal (query, key) pairs ``rank`` attends: the balance the zig-zag buys."""
        return sum(b * (b + 1) // 2 - a * (a + 1) // 2 for a, b in self.compute(rank))


def run_pieces(runs: tuple[Run, ...], lo: int, hi: int) -> list[tuple[int, int, int]]:
    """``(offset, start, stop)`` of each part of ``runs`` inside positions ``lo .. hi - 1``,
    ``offset`` counted along the runs laid end to end (as in a block).

    >>> run_pieces(((0, 4), (10, 14)), 2, 12)
    [(2, 2, 4), (4, 10, 12)]
    """
    out, offset = [], 0
    for a, b in runs:
        s, e = max(a, lo), min(b, hi)
        if s < e:
            out.append((offset + s - a, s, e))
        offset += b - a
    return out


def causal_pairs(q: Run, k: Run) -> int:
    """(query, key) pairs with key <= query, queries in run ``q``, keys in run ``k``.

    >>> causal_pairs((0, 3), (0, 3)), causal_pairs((5, 7), (0, 2)), causal_pairs((0, 2), (4, 9))
    (6, 4, 0)
    """
    (qa, qb), (ka, kb) = q, k
    if qb <= ka or kb <= ka or qb <= qa:
        return 0
    tri = lambda n: n * (n + 1) // 2  # noqa: E731
    a, b = max(qa, ka), min(qb, kb)
    inside = tri(b - ka) - tri(a - ka) if b > a else 0
    return inside + max(0, qb - max(qa, kb)) * (kb - ka)
