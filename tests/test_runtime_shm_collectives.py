"""Collectives through the shared-memory mailboxes (treeattn/testbed/transport/shm_collectives.py).

In-process: each member is a thread with its own end of one segment (a plain array), so
hypothesis can draw many groups, orders, sizes and dtypes cheaply; every result is checked
against the definition of the collective, computed here. Across processes: a launched group
runs each collective on the mailboxes and on gloo, on the world and on a subgroup listed out
of rank order, against the same definition, while a point-to-point message waits unread in
a tagged mailbox.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from treeattn.runtime.collective_ops import CollectiveOps
from treeattn.runtime.errors import RankTimeout
from treeattn.runtime.group import RankContext, all_gather_objects, wait_work
from treeattn.runtime.launch import LaunchOptions, launch
from treeattn.runtime.transport import transport_for
from treeattn.testbed.transport import shm
from treeattn.testbed.transport.shm_collectives import MailboxCollectives

WORLD = 4
OPS = ("all_reduce_sum", "all_reduce_max", "broadcast", "all_gather", "reduce_scatter",
       "all_to_all")


def _channels(world: int = WORLD, timeout_s: float = 20.0) -> list[shm.ShmChannel]:
    seg = np.zeros(shm.segment_bytes(world), dtype=np.uint8)
    return [shm.ShmChannel(RankContext(r, world, r, torch.device("cpu"), "gloo", timeout_s), seg)
            for r in range(world)]


def _inputs(members, numel: int, dtype: torch.dtype, seed: int) -> dict[int, torch.Tensor]:
    """Each member's buffer (p · numel,): distinct values per member and position."""
    g = torch.Generator().manual_seed(seed)
    p = len(members)
    return {r: torch.randn(p * numel, generator=g).to(dtype) for r in members}


def run_op(ops: CollectiveOps, op: str, data: torch.Tensor, root: int) -> torch.Tensor:
    """One member's result of ``op`` on its buffer ``data`` (p · n,), as one flat tensor."""
    p = len(ops.members)
    if op.startswith("all_reduce"):
        out = data.clone()
        ops.all_reduce(out, op.rsplit("_", 1)[1], op)
        return out
    if op == "broadcast":
        out = data.clone()
        ops.broadcast(out, root, op)
        return out
    if op == "all_gather":
        mine = data[: data.numel() // p].clone()
        pieces = [torch.empty_like(mine) for _ in range(p)]
        ops.all_gather(pieces, mine, op)
        return torch.cat(pieces)
    if op == "reduce_scatter":
        own = torch.empty(data.numel() // p, dtype=data.dtype)
        ops.reduce_scatter(own, data, op)
        return own
    arrived = torch.empty_like(data)
    ops.all_to_all(arrived, data, op)
    return arrived


def expected(op: str, members, inputs: dict, rank: int, root: int) -> torch.Tensor:
    """The collective's definition: what member ``rank`` must end with."""
    p, me = len(members), members.index(rank)
    stacked = torch.stack([inputs[r].double() for r in members])  # (p, p · n), member order
    if op == "all_reduce_sum":
        return stacked.sum(0)
    if op == "all_reduce_max":
        return stacked.amax(0)
    if op == "broadcast":
        return inputs[root].double()
    split = stacked.view(p, p, -1)  # (member, piece, n)
    if op == "all_gather":
        return split[:, 0].reshape(-1)  # everyone's first piece, in member order
    if op == "reduce_scatter":
        return split[:, me].sum(0)
    return split[:, me].reshape(-1)  # all-to-all: piece `me` of every member


def _run_threads(channels, members, op: str, inputs: dict, root: int) -> dict:
    results, errors = {}, []

    def member(rank: int) -> None:
        try:
            ops = MailboxCollectives(channels[rank].ctx, members, None, channels[rank])
            results[rank] = run_op(ops, op, inputs[rank], root)
        except Exception as exc:  # reported below, with the member that raised it
            errors.append((rank, exc))

    threads = [threading.Thread(target=member, args=(r,)) for r in members]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert all(not t.is_alive() for t in threads)
    return results


@settings(max_examples=40, deadline=None)
@given(op=st.sampled_from(OPS),
       members=st.lists(st.integers(0, WORLD - 1), min_size=1, max_size=WORLD,
                        unique=True).map(tuple),
       numel=st.integers(1, 300), bf16=st.booleans(), seed=st.integers(0, 2**16),
       repeat=st.integers(1, 3))
def test_every_collective_matches_its_definition_on_any_group_in_any_order(
        op, members, numel, bf16, seed, repeat):
    """Repeated calls reuse the mailboxes: a member may run ahead into the next call."""
    dtype = torch.bfloat16 if bf16 else torch.float32
    channels = _channels()
    ops_members = members
    for call in range(repeat):
        inputs = _inputs(members, numel, dtype, seed + call)
        root = members[seed % len(members)]
        got = _run_threads(channels, ops_members, op, inputs, root)
        sums = op in ("all_reduce_sum", "reduce_scatter")
        tol = (dict(atol=3e-2, rtol=3e-2) if bf16 else dict(atol=1e-5, rtol=1e-5)) if sums \
            else dict(atol=0, rtol=0)
        for rank in members:
            want = expected(op, members, inputs, rank, root).to(dtype)
            torch.testing.assert_close(got[rank], want, **tol)
        if op.startswith("all_reduce"):  # every member reduced in member order: same bits
            first = got[members[0]]
            assert all(torch.equal(got[r].view(torch.int16 if bf16 else torch.int32),
                                   first.view(torch.int16 if bf16 else torch.int32))
                       for r in members)


def test_a_member_that_never_joins_is_named_in_the_timeout():
    channels = _channels(world=2, timeout_s=0.3)
    ops = MailboxCollectives(channels[1].ctx, (0, 1), None, channels[1])
    pieces = [torch.empty(4) for _ in range(2)]
    with pytest.raises(RankTimeout, match=r"rank 1: timed out after 0.3s waiting for rank 0 "
                                          r"\(all_gather of the test\)"):
        ops.all_gather(pieces, torch.ones(4), "all_gather of the test")


def test_only_collectives_whose_messages_fit_a_slot_take_the_mailboxes():
    ops = MailboxCollectives(_channels()[0].ctx, (0, 1), None, _channels()[0])
    assert ops.through_mailboxes(shm.SLOT_BYTES) and not ops.through_mailboxes(shm.SLOT_BYTES + 1)


@dataclass(frozen=True)
class BothPaths:
    """Every collective on the world and on the subgroup (2, 0), whose member order is not
    torch.distributed's, against its definition: small (mailboxes), over a slot and with the
    mailboxes off (the process group). Rank 0 first leaves a point-to-point message unread
    in rank 1's tag-0 mailbox for the whole time."""

    def __call__(self, ctx):
        channel = transport_for(ctx).channel
        sub = (2, 0)
        handle = dist.new_group(list(sub), timeout=ctx.timeout)
        pending = torch.arange(6.0)
        if ctx.rank == 0:
            transport_for(ctx).isend(pending, 1, 0)
        failures = []
        for members, group in (((0, 1, 2), None), (sub, handle)):
            if ctx.rank not in members:
                continue
            ops = MailboxCollectives(ctx, members, group, channel)
            for numel in (5, shm.SLOT_BYTES // 4 + 1):  # fp32: one slot + 4 bytes per piece
                inputs = _inputs(members, numel, torch.float32, seed=numel)
                mine = inputs[ctx.rank]
                for op in OPS:
                    root = members[-1]
                    want = expected(op, members, inputs, ctx.rank, root).float()
                    for path in (ops, CollectiveOps(ctx, members, group)):
                        got = run_op(path, op, mine, root)
                        if not torch.allclose(got, want, atol=1e-5, rtol=1e-5):
                            failures.append((members, numel, op, path is ops))
        if ctx.rank == 1:
            buf = torch.empty(6)
            wait_work(transport_for(ctx).irecv(buf, 0, 0), ctx, 0, "the pending message")
            if not torch.equal(buf, pending):
                failures.append("pending message")
        return all_gather_objects(ctx, {"kind": transport_for(ctx).kind, "failures": failures})


@pytest.mark.timeout(180)
def test_both_paths_follow_member_order_and_leave_tagged_messages_alone():
    out = launch(BothPaths(), 3, LaunchOptions(timeout_s=30))
    assert [r["kind"] for r in out] == ["shm+gloo"] * 3
    assert [r["failures"] for r in out] == [[], [], []]


def _starts_then_gathers(ctx: RankContext) -> list:
    """Timed-step starts interleaved with a schedule's mailbox all-gathers; every rank's
    ``(used the mailboxes, what it gathered)``."""
    from treeattn.runtime.measure import timing

    channel = transport_for(ctx).channel
    ops = MailboxCollectives(ctx, tuple(range(ctx.world)), None, channel)
    gathered = []
    for i in range(12):
        timing.start_together(ctx)
        pieces = [torch.zeros(2) for _ in range(ctx.world)]
        ops.all_gather(pieces, torch.tensor([ctx.rank, i], dtype=torch.float32), "gather")
        gathered.append([float(v) for piece in pieces for v in piece])
    return all_gather_objects(ctx, ((id(channel), ctx.rank) in timing._STARTS, gathered))


def test_timed_starts_go_through_the_mailboxes_and_leave_collectives_intact():
    out = launch(_starts_then_gathers, 3, LaunchOptions(timeout_s=30))
    for used_mailboxes, gathered in out:
        assert used_mailboxes  # the release after the barrier took the shared memory
        assert gathered == [[0.0, i, 1.0, i, 2.0, i] for i in range(12)]
