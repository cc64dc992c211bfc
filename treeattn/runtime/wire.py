"""The wire format of every payload, and the message sizes a schedule implies.

Every payload buffer is kept as one flat tensor, so a Send or a chunk of it is a contiguous
slice sent without a copy:

- ``"partial"``: ``o`` (B, Hq, D) then ``lse`` (B, Hq), packed into one flat fp32 tensor;
- ``"max"``, ``"den"``: (B, Hq) fp32; ``"num"``: (B, Hq, D) fp32;
- ``"kv"``: K then V of a block of ``T`` tokens, (2, B, Hkv, T, D) in the cache dtype;
- ``"qblock"`` (Bq, Hq, D) in the cache dtype, ``"outbox"`` ``o`` (P, Bq, Hq, D) then
  ``lse`` (P, Bq, Hq) fp32 (``ring-passq``, see :mod:`treeattn.runtime.passq`).

When the schedule's ``partial_dtype`` is ``"bf16"`` (:mod:`treeattn.schedule.ir`), a sender
rounds the ``o`` it is about to move of a partial or an outbox to bf16 (:func:`round_wire`)
and keeps the rounded buffer, so every replica merges exactly the values its peers received;
the buffers stay fp32 tensors holding bf16-representable values.

Only a KV block's length varies. :func:`kv_message_lengths` runs the schedule symbolically
(no data) to learn the length of every KV message, so each rank can post its receives with
the right size even when the shards are uneven.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from treeattn.runtime.errors import RuntimeFailure
from treeattn.schedule.ir import Recv, Schedule, Send
from treeattn.schedule.payloads import (
    PAYLOAD_LAYOUTS,
    Payload,
    payload_numel,
    query_slots,
    shard_bounds,
)


@dataclass(frozen=True)
class AttnDims:
    """Shapes of one attention layer's decode step."""

    batch: int
    n_heads: int  # Hq
    n_kv_heads: int  # Hkv
    head_dim: int  # D
    kv_dtype: torch.dtype = torch.float32
    world: int = 1  # P: sizes pass-Q's query block and outbox (the executor sets it)
    # how partials travel (DecodeWorkload.partial_dtype; None: each algorithm's own)
    partial_dtype: str | None = None

    @property
    def query_slots(self) -> int:
        """``Bq``: the query slots each rank owns in ``ring-passq``."""
        return query_slots(self.batch, self.world)

    def numel(self, payload: str, kv_len: int = 0) -> int:
        """Elements in the flat buffer of ``payload`` (``kv_len`` tokens for ``"kv"``)."""
        if payload not in PAYLOAD_LAYOUTS:
            raise RuntimeFailure(f"unknown payload {payload!r}")
        return payload_numel(payload, {"B": self.batch, "Hq": self.n_heads,
                                       "Hkv": self.n_kv_heads, "D": self.head_dim, "T": kv_len,
                                       "P": self.world, "Bq": self.query_slots})

    def dtype(self, payload: str) -> torch.dtype:
        cache = PAYLOAD_LAYOUTS[Payload(payload)].dtype == "cache"
        return self.kv_dtype if cache else torch.float32


def pack_partial(o: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """(B, Hq, D) and (B, Hq) fp32 -> one flat fp32 tensor (a new tensor)."""
    return torch.cat([o.reshape(-1).float(), lse.reshape(-1).float()])


def unpack_partial(flat: torch.Tensor, dims: AttnDims) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pack_partial`; returns views ``o`` (B, Hq, D), ``lse`` (B, Hq)."""
    b, hq, d = dims.batch, dims.n_heads, dims.head_dim
    o = flat[: b * hq * d].view(b, hq, d)  # (B, Hq, D)
    lse = flat[b * hq * d :].view(b, hq)  # (B, Hq)
    return o, lse


def round_wire(flat: torch.Tensor, dims: AttnDims, payload: str, chunk,
               partial_dtype: str) -> torch.Tensor:
    """``flat`` with the ``o`` that a Send of ``chunk`` (or a collective, ``chunk=None``)
    moves rounded to the wire format: a new tensor, or ``flat`` itself when nothing rounds
    (fp32, or a payload that is no partial)."""
    layout = PAYLOAD_LAYOUTS[Payload(payload)]
    if partial_dtype == "fp32" or not layout.wire:
        return flat
    out = flat.clone()
    first = layout.arrays[0]
    sizes = {"B": dims.batch, "Hq": dims.n_heads, "D": dims.head_dim, "P": dims.world,
             "Bq": dims.query_slots}
    o = out[: math.prod(sizes[a] for a in first)].view(*(sizes[a] for a in first))
    if chunk is not None and layout.chunk_axis == "Hq":
        h0, h1 = _heads(dims, chunk)
        o = o[:, h0:h1]  # (B, h, D): the heads this message carries
    o.copy_(o.to(torch.bfloat16))
    return out


def _heads(dims: AttnDims, chunk: tuple[int, int] | None) -> tuple[int, int]:
    return chunk_bounds(dims.n_heads, chunk)


def message_numel(dims: AttnDims, payload: str, chunk, kv_len: int = 0) -> int:
    """Elements of one message: a chunk of a flat buffer, or of the heads of a partial."""
    if payload == "partial" and chunk is not None:
        h0, h1 = _heads(dims, chunk)
        return dims.batch * (h1 - h0) * (dims.head_dim + 1)
    lo, hi = chunk_bounds(dims.numel(payload, kv_len), chunk)
    return hi - lo


def take_slice(flat: torch.Tensor, dims: AttnDims, payload: str, chunk) -> torch.Tensor:
    """What a Send of ``chunk`` of this flat buffer puts on the wire.

    A slice of a flat buffer is a view; a chunk of a partial (a range of query heads, ``o``
    and ``lse`` together) is packed into a new tensor.
    """
    if payload == "partial" and chunk is not None:
        o, lse = unpack_partial(flat, dims)
        h0, h1 = _heads(dims, chunk)
        return pack_partial(o[:, h0:h1], lse[:, h0:h1])
    lo, hi = chunk_bounds(flat.numel(), chunk)
    return flat[lo:hi]


def put_slice(flat: torch.Tensor, dims: AttnDims, payload: str, chunk, msg) -> torch.Tensor:
    """A copy of the flat buffer with ``chunk`` replaced by the message ``msg``."""
    out = flat.clone()
    if payload == "partial" and chunk is not None:
        o, lse = unpack_partial(out, dims)
        h0, h1 = _heads(dims, chunk)
        o_msg, lse_msg = unpack_heads(msg, dims, h1 - h0)
        o[:, h0:h1], lse[:, h0:h1] = o_msg, lse_msg
        return out
    lo, hi = chunk_bounds(out.numel(), chunk)
    out[lo:hi] = msg
    return out


def unpack_heads(flat: torch.Tensor, dims: AttnDims, heads: int):
    """A packed partial of ``heads`` query heads: views (B, heads, D) and (B, heads)."""
    b, d = dims.batch, dims.head_dim
    return flat[: b * heads * d].view(b, heads, d), flat[b * heads * d :].view(b, heads)


def identity_partial(dims: AttnDims, device: torch.device | str = "cpu") -> torch.Tensor:
    """The packed identity partial (o = 0, lse = -inf): what an empty shard contributes."""
    o = torch.zeros(dims.batch, dims.n_heads, dims.head_dim, device=device)  # (B, Hq, D)
    lse = torch.full((dims.batch, dims.n_heads), float("-inf"), device=device)  # (B, Hq)
    return pack_partial(o, lse)


def chunk_bounds(numel: int, chunk: tuple[int, int] | None) -> tuple[int, int]:
    """``[lo, hi)`` of the ``index``-th of ``count`` near-equal slices (larger ones first).

    >>> chunk_bounds(10, (0, 3)), chunk_bounds(10, (2, 3)), chunk_bounds(10, None)
    ((0, 4), (7, 10), (0, 10))
    """
    if chunk is None:
        return 0, numel
    index, count = chunk
    if not 0 <= index < count:
        raise RuntimeFailure(f"chunk {chunk} is out of range")
    return shard_bounds(numel, count)[index]


def kv_message_lengths(schedule: Schedule, lengths: list[int]) -> dict[tuple[int, int], int]:
    """Token count of the KV block carried by every KV Send/Recv, keyed by (rank, step index).

    Runs the schedule without data: a rank's ``"kv"`` buffer starts as its own shard and a
    replacing KV Recv gives it the sender's block length.

    Raises
    ------
    RuntimeFailure
        A KV receive that no send matches (the schedule would deadlock).
    """
    world = schedule.world
    if len(lengths) != world:
        raise RuntimeFailure(f"{len(lengths)} shard lengths for a schedule of world {world}")
    pc, kv_len = [0] * world, list(lengths)
    sent: dict[tuple[int, int, int], int] = {}
    out: dict[tuple[int, int], int] = {}
    progress = True
    while progress:
        progress = False
        for rank, steps in enumerate(schedule.steps):
            while pc[rank] < len(steps):
                step = steps[pc[rank]]
                if isinstance(step, Send) and step.payload == "kv":
                    sent[(rank, step.dst, step.tag)] = kv_len[rank]
                    out[(rank, pc[rank])] = kv_len[rank]
                elif isinstance(step, Recv) and step.payload == "kv":
                    key = (step.src, rank, step.tag)
                    if key not in sent:
                        break
                    out[(rank, pc[rank])] = sent[key]
                    if not step.reduce and step.chunk is None:
                        kv_len[rank] = sent[key]
                pc[rank] += 1
                progress = True
    stuck = [r for r in range(world) if pc[r] < len(schedule.steps[r])]
    if stuck:
        r = stuck[0]
        raise RuntimeFailure(f"schedule deadlocks: rank {r} waits forever at step {pc[r]}")
    return out
