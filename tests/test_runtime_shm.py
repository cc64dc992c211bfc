"""The shared-memory transport (treeattn/testbed/transport/shm.py, transport.py).

In-process: two ends of one segment (a plain array standing in for the shared file) check
the mailbox protocol itself: FIFO per tag, independent tags, a send to a full mailbox pushed
by a later wait, a timeout, a size disagreement. Across processes: a local group picks shared
memory, carries small and large messages of several dtypes on both paths intact, leaves no
file behind, and the executor's results equal the reference with shared memory on and off,
collective-based schedules included (their collectives take the mailboxes too).
"""

from __future__ import annotations

import glob
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import pytest
import torch

from treeattn.kernels.reference import naive_attention
from treeattn.llm.verify import Case, CasesJob
from treeattn.runtime.errors import RankTimeout, RuntimeFailure
from treeattn.runtime.group import RankContext, wait_work
from treeattn.runtime.launch import LaunchOptions, launch
from treeattn.runtime.transport import transport_for
from treeattn.testbed.transport import shm


def _pair(world: int = 2, timeout_s: float = 5.0) -> list[shm.ShmChannel]:
    seg = np.zeros(shm.segment_bytes(world), dtype=np.uint8)
    return [shm.ShmChannel(RankContext(r, world, r, torch.device("cpu"), "gloo", timeout_s), seg)
            for r in range(world)]


def test_messages_arrive_in_order_per_tag_and_tags_do_not_block_each_other():
    a, b = _pair()
    first, second = torch.arange(6.0), torch.arange(6.0) + 100
    other = torch.tensor([7, 8], dtype=torch.int64)
    a.isend(first, 1, tag=0)
    a.isend(other, 1, tag=3)
    a.isend(second, 1, tag=0)  # the tag-0 mailbox is full: deferred, not lost
    assert len(a.deferred) == 1
    got_other = torch.zeros(2, dtype=torch.int64)
    assert b.irecv(got_other, 0, tag=3).wait()  # read out of send order: another mailbox
    got = torch.zeros(6)
    assert b.irecv(got, 0, tag=0).wait()
    assert torch.equal(got, first) and torch.equal(got_other, other)
    a.progress()  # the slot is free again: the deferred send goes out
    assert not a.deferred
    assert b.irecv(got, 0, tag=0).wait() and torch.equal(got, second)


def test_a_message_larger_than_a_slot_is_refused_not_copied_past_it():
    a, b = _pair()
    big = torch.zeros(shm.SLOT_BYTES // 4 + 1)  # one float over the slot
    with pytest.raises(RuntimeFailure, match="does not fit"):
        a.isend(big, 1, tag=0)
    with pytest.raises(RuntimeFailure, match="does not fit"):
        b.irecv(big, 0, tag=0)
    assert not a.deferred and a.box(0, 1, 1).ctrl[0] == 0  # nothing written anywhere


def test_a_deferred_send_is_pushed_while_its_sender_waits_for_something_else():
    """Rank 0 sends twice on one tag, then waits for rank 1's reply. Its second message can
    only go out after rank 1 read the first; rank 0's own wait must push it, or both wait
    forever (here: rank 1's second receive would time out)."""
    a, b = _pair()
    a.isend(torch.ones(3), 1, tag=1)
    second = a.isend(torch.full((3,), 2.0), 1, tag=1)
    buf = torch.zeros(3)
    assert b.irecv(buf, 0, tag=1).wait()
    b.isend(torch.tensor([5.0]), 0, tag=2)
    reply = torch.zeros(1)
    assert a.irecv(reply, 1, tag=2).wait()  # this wait pushes the deferred send
    assert second.is_completed()
    assert b.irecv(buf, 0, tag=1).wait(timedelta(seconds=1)) and buf.tolist() == [2.0] * 3


def test_a_full_mailbox_does_not_hold_up_deferred_sends_to_other_mailboxes():
    a, b = _pair()
    for i, tag in enumerate((0, 0, 1, 1)):  # the second of each tag is deferred
        a.isend(torch.full((2,), float(i)), 1, tag)
    buf = torch.zeros(2)
    assert b.irecv(buf, 0, tag=1).wait()
    a.progress()  # tag 0's mailbox is still full; tag 1's deferred send must go anyway
    assert b.irecv(buf, 0, tag=1).wait(timedelta(milliseconds=100))
    assert buf.tolist() == [3.0, 3.0] and len(a.deferred) == 1


def test_bf16_and_byte_sized_payloads_are_copied_bit_for_bit():
    a, b, c = _pair(world=3)
    x = torch.randn(33).to(torch.bfloat16)
    a.isend(x, 2, tag=0)
    got = torch.empty(33, dtype=torch.bfloat16)
    assert c.irecv(got, 0, tag=0).wait()
    assert torch.equal(got.view(torch.int16), x.view(torch.int16))
    assert b.irecv(torch.empty(33, dtype=torch.bfloat16), 0, tag=0).wait(
        timedelta(milliseconds=50)) is False  # addressed to rank 2, not rank 1


def test_a_receive_nobody_sends_times_out_with_the_peer_named():
    _, b = _pair(timeout_s=0.2)
    work = b.irecv(torch.zeros(4), 0, tag=0)
    assert work.wait(timedelta(milliseconds=20)) is False
    with pytest.raises(RankTimeout, match="rank 1: timed out after 0.2s waiting for rank 0"):
        wait_work(work, b.ctx, 0, "receive of a partial")


def test_ranks_that_disagree_on_a_message_size_get_an_error_not_garbage():
    a, b = _pair()
    a.isend(torch.zeros(5), 1, tag=0)
    with pytest.raises(RuntimeFailure, match="rank 1: .*20 bytes for a 16-byte receive"):
        wait_work(b.irecv(torch.zeros(4), 0, tag=0), b.ctx, 0, "receive")


def test_a_receive_into_a_non_contiguous_buffer_is_refused():
    _, b = _pair()
    with pytest.raises(RuntimeFailure, match="contiguous"):
        b.irecv(torch.zeros(4, 2)[:, 0], 0, tag=0)


def test_a_new_send_queues_behind_an_older_deferred_one_to_the_same_mailbox():
    a, b = _pair()
    for value in (1.0, 2.0):  # the second is deferred
        a.isend(torch.full((2,), value), 1, tag=0)
    buf = torch.zeros(2)
    assert b.irecv(buf, 0, tag=0).wait() and buf[0] == 1.0  # the slot is free now...
    a.isend(torch.full((2,), 3.0), 1, tag=0)  # ...but 2.0 must still go first
    got = []
    for _ in range(2):
        a.progress()
        assert b.irecv(buf, 0, tag=0).wait(timedelta(milliseconds=100))
        got.append(buf[0].item())
    assert got == [2.0, 3.0]


def test_groups_of_more_than_eight_ranks_keep_gloo():
    assert shm.segment_bytes(8) <= shm.MAX_SEGMENT_BYTES < shm.segment_bytes(9)
    ctx = RankContext(0, 9, 0, torch.device("cpu"), "gloo", 5.0)
    assert not shm._eligible(ctx)


def test_only_small_messages_with_small_tags_take_shared_memory():
    a, _ = _pair()
    assert a.carries(shm.SLOT_BYTES, 0) and a.carries(4, shm.MAX_TAGS - 1)
    assert not a.carries(shm.SLOT_BYTES + 1, 0)
    assert not a.carries(4, shm.MAX_TAGS)


SIZES = (1, 257, shm.SLOT_BYTES // 4, shm.SLOT_BYTES // 4 + 1, 200_000)  # elements
TAGS = (0, 1, shm.MAX_TAGS + 1)  # the last one always takes gloo


def _payload(size: int, tag: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(size * 31 + tag)
    return torch.randn(size, generator=g).to(dtype)


@dataclass(frozen=True)
class MixedTraffic:
    """Rank 0 sends every (size, tag, dtype) message to rank 1 in one order; rank 1 receives
    them in another (tags reversed), so both paths and out-of-order tags are exercised."""

    def __call__(self, ctx):
        p2p = transport_for(ctx)
        plan = [(s, t, d) for s in SIZES for t in TAGS for d in (torch.float32, torch.bfloat16)]
        if ctx.rank == 0:
            works = [p2p.isend(_payload(s, t, d), 1, t) for s, t, d in plan]
            for work in works:
                wait_work(work, ctx, 1, "send")
            return {"kind": p2p.kind, "files": glob.glob(f"{shm.SHM_DIR}/treeattn-*")}
        ok = []
        for s, t, d in sorted(plan, key=lambda m: -m[1]):
            buf = torch.empty(s, dtype=d)
            wait_work(p2p.irecv(buf, 0, t), ctx, 0, "receive")
            ok.append(torch.equal(buf, _payload(s, t, d)))
        assert all(ok), ok
        return None


@dataclass(frozen=True)
class DeferredThenGloo:
    """Rank 0 sends two small messages on one tag (the second is deferred: rank 1 has not
    read the first yet), then waits for a large (gloo) reply that rank 1 sends only after
    reading both. Rank 0's gloo wait must push the deferred message, or both wait forever."""

    def __call__(self, ctx):
        p2p = transport_for(ctx)
        big = torch.zeros(shm.SLOT_BYTES)  # 4x a slot: gloo
        if ctx.rank == 0:
            for value in (1.0, 2.0):
                p2p.isend(torch.full((4,), value), 1, 0)
            wait_work(p2p.irecv(big, 1, 0), ctx, 1, "large reply")
            return float(big[0])
        got = []
        for _ in range(2):
            buf = torch.zeros(4)
            wait_work(p2p.irecv(buf, 0, 0), ctx, 0, "small message")
            got.append(float(buf[0]))
        wait_work(p2p.isend(big + sum(got), 0, 0), ctx, 0, "large reply")
        return None


@pytest.mark.timeout(60)
def test_a_wait_on_a_gloo_message_pushes_deferred_mailbox_sends():
    assert launch(DeferredThenGloo(), 2, LaunchOptions(timeout_s=10)) == 3.0


@pytest.mark.timeout(120)
def test_a_local_group_uses_shared_memory_for_small_messages_and_leaves_no_file():
    before = set(glob.glob(f"{shm.SHM_DIR}/treeattn-*"))
    out = launch(MixedTraffic(), 2, LaunchOptions(timeout_s=30))
    assert out["kind"] == "shm+gloo"
    assert set(out["files"]) <= before  # unlinked as soon as every rank had mapped it


@dataclass(frozen=True)
class CasesAndTransport(CasesJob):
    """The cases, and which transport the group used."""

    def __call__(self, ctx):
        out = super().__call__(ctx)
        return (transport_for(ctx).kind, out) if ctx.rank == 0 else None


@pytest.mark.timeout(180)
@pytest.mark.parametrize("switch,kind", [("1", "shm+gloo"), ("0", "gloo")])
def test_executor_results_are_exact_with_shared_memory_on_and_off(monkeypatch, switch, kind):
    monkeypatch.setenv(shm.ENV_SWITCH, switch)
    lengths, b, hq, hkv, d = (6, 0, 5), 2, 4, 2, 8
    g = torch.Generator().manual_seed(3)
    q = torch.randn(b, hq, d, generator=g)  # (B, Hq, D)
    k = torch.randn(b, hkv, sum(lengths), d, generator=g)  # (B, Hkv, T, D)
    v = torch.randn(b, hkv, sum(lengths), d, generator=g)
    cases = (Case("tree"), Case("butterfly"), Case("ring"), Case("allgather"),
             Case("oneshot"), Case("helix"), Case("dcp"), Case("allreduce3"), Case("ring-passq"))
    used, out = launch(CasesAndTransport(q, k, v, lengths, cases), 3,
                       LaunchOptions(timeout_s=30))
    assert used == kind
    ref_o, ref_lse = naive_attention(q, k, v)
    for case in cases:
        for o, lse, _ in out[case.label]:
            torch.testing.assert_close(o, ref_o, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)

