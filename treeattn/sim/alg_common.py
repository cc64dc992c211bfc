"""Helpers shared by the schedule generators: tags, chunk sizes, the local partial."""

from __future__ import annotations

from collections import defaultdict

from treeattn.sim.schedule import Compute, Step
from treeattn.sim.workload import FP32, DecodeWorkload


class Tags:
    """Hands out tags unique per (src, dst) pair: 0, 1, 2, … in the order they are asked."""

    def __init__(self) -> None:
        self._next: dict[tuple[int, int], int] = defaultdict(int)

    def __call__(self, src: int, dst: int) -> int:
        tag = self._next[(src, dst)]
        self._next[(src, dst)] = tag + 1
        return tag


def split_sizes(total: int, count: int) -> list[int]:
    """``numpy.array_split`` sizes: the first ``total % count`` slices get one more element."""
    base, extra = divmod(total, count)
    return [base + (1 if i < extra else 0) for i in range(count)]


def chunk_sizes(workload: DecodeWorkload, payload: str, count: int) -> list[int]:
    """Bytes of each of ``count`` slices of a payload buffer (see schedule.py's chunks).

    ``partial`` is sliced along the query-head axis (``o`` and ``lse`` together);
    ``max``/``num``/``den`` are sliced as flat fp32 arrays.

    >>> from treeattn.sim.workload import DecodeWorkload
    >>> chunk_sizes(DecodeWorkload("debug", 8), "partial", 3)  # 4 heads: 2, 1, 1
    [136, 68, 68]
    """
    m = workload.model
    if payload == "partial":
        per_head = FP32 * workload.batch * (m.head_dim + 1)
        return [per_head * h for h in split_sizes(m.n_heads, count)]
    elements = workload.buffer_bytes(payload) // FP32
    return [FP32 * n for n in split_sizes(elements, count)]


def local_attention(workload: DecodeWorkload, tokens: int) -> Compute:
    """The partial over a rank's own shard."""
    return Compute("attention", workload.attention_bytes(tokens), workload.attention_flops(tokens))


def empty_steps(world: int) -> list[list[Step]]:
    return [[] for _ in range(world)]
