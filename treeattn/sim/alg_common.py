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


def chunk_bytes(workload: DecodeWorkload, payload: str, index: int, count: int) -> int:
    """Bytes of slice ``index`` of ``count`` of a payload buffer (see schedule.py's chunks).

    ``partial`` is sliced along the query-head axis (``o`` and ``lse`` together);
    ``max``/``num``/``den`` are sliced as flat fp32 arrays.
    """
    m = workload.model
    if payload == "partial":
        heads = split_sizes(m.n_heads, count)[index]
        return FP32 * workload.batch * heads * (m.head_dim + 1)
    elements = workload.buffer_bytes(payload) // FP32
    return FP32 * split_sizes(elements, count)[index]


def local_attention(workload: DecodeWorkload, tokens: int) -> Compute:
    """The partial over a rank's own shard."""
    return Compute("attention", workload.attention_bytes(tokens), workload.attention_flops(tokens))


def empty_steps(world: int) -> list[list[Step]]:
    return [[] for _ in range(world)]
