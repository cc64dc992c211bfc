"""The torch side of ``ring-passq`` (Meta's CP pass-Q decode): its buffers, its two compute
labels and its two collectives on the outbox.

Kept out of :mod:`treeattn.runtime.executor`, which calls in here for the ``"qblock"`` and
``"outbox"`` payloads and the ``attention_qblock`` / ``place_rows`` labels. Semantics are
those of :mod:`treeattn.schedule.ir`:

* ``"qblock"`` is a flat (Bq, Hq, D) tensor in the cache dtype. Rank ``k`` starts with its
  own block, slot ``i`` holding query ``b = i·p + k``, or a zero dummy when ``b ≥ B``
  (queries are replicated, so this costs no message). The ring's Send/Recv move it as is.
* ``"outbox"`` is a flat fp32 tensor, ``o`` (P, Bq, Hq, D) then ``lse`` (P, Bq, Hq); it
  starts as the identity. A chunk of it is one origin slot of both arrays, so every
  collective piece is equal-sized (no padding, unlike head chunks).
* The ``j``-th ``attention_qblock`` of rank ``k`` attends the block of origin
  ``s = (k − j) mod p``: real slot ``i`` against the own KV shard of sequence ``i·p + s``;
  padding slots are skipped and keep the identity (as priced: only real slots read KV).
"""

from __future__ import annotations

import torch

from treeattn.kernels import merge, partial_attention
from treeattn.runtime.collective_ops import CollectiveOps
from treeattn.runtime.group import RankContext
from treeattn.runtime.wire import AttnDims
from treeattn.schedule.ir import Collective
from treeattn.schedule.payloads import CollectiveOp

LABELS = ("attention_qblock", "place_rows")


def uses_passq(steps) -> bool:
    """Whether a rank's steps run pass-Q (so the executor sets up its buffers)."""
    return any(getattr(s, "label", None) == "attention_qblock" for s in steps)


def initial_buffers(q: torch.Tensor, rank: int, dims: AttnDims) -> dict[str, torch.Tensor]:
    """The own query block (origin ``rank``) and the identity outbox, both flat."""
    p, bq = dims.world, dims.query_slots
    block = torch.zeros(bq, dims.n_heads, dims.head_dim, dtype=dims.kv_dtype,
                        device=q.device)  # (Bq, Hq, D)
    rows = list(range(rank, dims.batch, p))  # queries b = i·p + rank < B
    block[:len(rows)] = q[rows].to(dims.kv_dtype)
    o = torch.zeros(p * bq * dims.n_heads * dims.head_dim, device=q.device)  # (P, Bq, Hq, D)
    lse = torch.full((p * bq * dims.n_heads,), float("-inf"), device=q.device)  # (P, Bq, Hq)
    return {"qblock": block.reshape(-1), "outbox": torch.cat([o, lse])}


def outbox_views(flat: torch.Tensor, dims: AttnDims) -> tuple[torch.Tensor, torch.Tensor]:
    """Views ``o`` (P, Bq, Hq, D) and ``lse`` (P, Bq, Hq) of a flat outbox."""
    p, bq, hq, d = dims.world, dims.query_slots, dims.n_heads, dims.head_dim
    return flat[: p * bq * hq * d].view(p, bq, hq, d), flat[p * bq * hq * d:].view(p, bq, hq)


def _slot(flat: torch.Tensor, dims: AttnDims, s: int) -> torch.Tensor:
    """Origin slot ``s`` of both arrays, packed flat (o then lse): one collective piece."""
    o, lse = outbox_views(flat, dims)
    return torch.cat([o[s].reshape(-1), lse[s].reshape(-1)])


def _with_slot(flat: torch.Tensor, dims: AttnDims, s: int, piece: torch.Tensor) -> torch.Tensor:
    """A copy of the outbox whose slot ``s`` is the packed ``piece``."""
    out = flat.clone()
    o, lse = outbox_views(out, dims)
    n = o[s].numel()
    o[s], lse[s] = piece[:n].view_as(o[s]), piece[n:].view_as(lse[s])
    return out


def compute(state, label: str) -> int:
    """Run ``label`` on the executor's run state; return its updated pass-Q step count."""
    ex, bufs, j = state.ex, state.bufs, state.passq_steps
    if label == "place_rows":
        bufs["partial"] = place_rows(bufs["outbox"], ex.dims)
        return j
    attend(bufs, state.own_kv, ex.ctx.rank, j, ex.dims, ex.scale)
    return j + 1


def attend(bufs: dict, own_kv: torch.Tensor, rank: int, j: int, dims: AttnDims,
           scale: float) -> None:
    """The ``j``-th ``attention_qblock``: the held block against the own KV shard, written
    into the outbox slot of its origin ``(rank − j) mod p``."""
    p, bq, b = dims.world, dims.query_slots, dims.batch
    origin = (rank - j) % p
    if own_kv.shape[3] == 0:  # an empty shard contributes the identity the slot holds
        return
    block = bufs["qblock"].view(bq, dims.n_heads, dims.head_dim)  # (Bq, Hq, D)
    # Real slots i hold sequences i·p + origin < B: a strided *view* of the shard (indexing
    # with a list would copy the whole shard on every step, 3x the memory traffic priced).
    real = max(0, -(-(b - origin) // p))  # slots with i·p + origin < B
    if not real:  # a block of padding only: nothing to attend, the slot stays the identity
        return
    kv = own_kv[:, origin : origin + (real - 1) * p + 1 : p]  # (2, real, Hkv, T, D)
    o, lse = partial_attention(block[:real], kv[0], kv[1], scale=scale)  # (real, Hq, D/-)
    o_slot, lse_slot = (t[origin].clone() for t in outbox_views(bufs["outbox"], dims))
    o_slot[:real], lse_slot[:real] = o.float(), lse.float()  # padding rows: the identity
    piece = torch.cat([o_slot.reshape(-1), lse_slot.reshape(-1)])
    bufs["outbox"] = _with_slot(bufs["outbox"], dims, origin, piece)


def place_rows(outbox: torch.Tensor, dims: AttnDims) -> torch.Tensor:
    """The packed (B, Hq, D) partial from every origin slot; dummy rows are dropped."""
    o, lse = outbox_views(outbox, dims)  # (P, Bq, Hq, D), (P, Bq, Hq)
    b = dims.batch
    rows_o = o.transpose(0, 1).reshape(-1, dims.n_heads, dims.head_dim)[:b]  # row i·p + s
    rows_lse = lse.transpose(0, 1).reshape(-1, dims.n_heads)[:b]  # (B, Hq)
    return torch.cat([rows_o.reshape(-1), rows_lse.reshape(-1)])


def run_collective(ctx: RankContext, ops: CollectiveOps, step: Collective, flat: torch.Tensor,
                   dims: AttnDims):
    """The outbox's all-to-all (each slot home to its origin) or sharded all-gather (every
    owner's merged slot to everyone); returns ``("keep", kept)`` or ``("replace", flat)``
    like :func:`treeattn.runtime.collectives.run_collective`."""
    p, me = len(step.group), step.group.index(ctx.rank)
    what = f"{step.op} of 'outbox' over ranks {list(step.group)}"
    if step.op == CollectiveOp.ALL_TO_ALL:
        chunks = torch.cat([_slot(flat, dims, j) for j in range(p)])  # (p * slot,)
        arrived = torch.empty_like(chunks)
        ops.all_to_all(arrived, chunks, what)
        pieces = arrived.view(p, -1)
        return "keep", ("slots", me, p, [pieces[j] for j in range(p) if j != me])
    if step.op == CollectiveOp.ALL_GATHER and step.sharded:
        mine = _slot(flat, dims, me)
        pieces = [torch.empty_like(mine) for _ in range(p)]
        ops.all_gather(pieces, mine, what)
        out = flat
        for j in range(p):
            out = _with_slot(out, dims, j, pieces[j])
        return "replace", out
    raise RuntimeError(f"ring-passq does not run {step.op} on the outbox")


def fold_slots(flat: torch.Tensor, kept, dims: AttnDims) -> torch.Tensor:
    """``Merge("partial", tag)`` after the all-to-all: fold every rank's partial of my
    queries into my own slot, in group order; returns a new outbox."""
    _, me, _, pieces = kept
    o, lse = outbox_views(flat, dims)
    mine = (o[me], lse[me])  # (Bq, Hq, D), (Bq, Hq)
    n = o[me].numel()
    for piece in pieces:
        mine = merge(mine, (piece[:n].view_as(o[me]), piece[n:].view_as(lse[me])))
    return _with_slot(flat, dims, me, torch.cat([mine[0].reshape(-1), mine[1].reshape(-1)]))
