"""Compute and message copies taking turns on hosts whose cores copy every message byte.

On gloo, a message's bytes go through the kernel's sockets, copied by the host's cores; a
measured ring step on CPU ranks took the exchange's time *plus* the attention's, not the
larger of the two. The engine models it (``CpuHost.copies_messages``): a rank's
attention books its own links, so it and its messages' chunks fit around each other.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from treeattn.schedule.ir import Compute, Recv
from treeattn.sim import DecodeWorkload, HardwareModel, build_schedule, simulate
from treeattn.sim.devices import BackendModel
from treeattn.sim.network import LinkCalendar
from treeattn.testbed.host.model import CpuHost
from treeattn.testbed.host.profiles import hardware_from_profile
from treeattn.topo import Topology

SEND_S = 3e-5
BACKEND = BackendModel("gloo", SEND_S, SEND_S)
BANDWIDTH = 1e9  # the links: a KV block takes longer on the wire than its attention


def _hardware(copies: bool) -> HardwareModel:
    return HardwareModel("cpu", 1e10, 1e15, 1e-5,
                         host=CpuHost(cores=2, copies_messages=copies))


def _ring(world: int, seq_len: int, copies: bool):
    topo = Topology.from_spec(f"local:ranks={world},latency=0,bandwidth={BANDWIDTH}")
    w = DecodeWorkload("llama-3.1-8b", seq_len)
    schedule = build_schedule("ring", topo, w)
    return schedule, simulate(schedule, topo, w, _hardware(copies), BACKEND)


def _compute_s(hw: HardwareModel, step) -> float:
    flops = step.flops if isinstance(step, Compute) else 0
    return hw.compute_time(step.nbytes, flops)


@pytest.mark.parametrize("copies", [False, True])
def test_two_rank_ring_takes_turns_only_when_the_host_copies(copies):
    schedule, result = _ring(2, 65536, copies)
    hw = _hardware(copies)
    steps = schedule.steps[0]  # send, attention, recv, attention_block, merge
    attention, block, merge = (_compute_s(hw, s) for s in (steps[1], steps[3], steps[4]))
    wire = steps[0].nbytes / BANDWIDTH
    assert wire > attention  # otherwise the two cases would not differ
    if copies:  # the block's copies hold the rank's links first; the attention waits for them
        first = SEND_S + wire + attention
    else:  # the block moves while the attention runs
        first = SEND_S + max(attention, wire)
    assert result.makespan_s == pytest.approx(first + SEND_S + block + merge, rel=1e-9)


@settings(max_examples=25, deadline=None)
@given(world=st.integers(2, 5), seq_len=st.integers(4096, 200_000))
def test_copies_never_overlap_a_ranks_attention_and_cost_at_least_the_serial_sum(world,
                                                                                  seq_len):
    schedule, result = _ring(world, seq_len, True)
    _, overlapped = _ring(world, seq_len, False)
    hw = _hardware(True)
    for steps in schedule.steps:
        busy = sum(_compute_s(hw, s) for s in steps if isinstance(s, Compute))
        wire_in = sum(s.nbytes / BANDWIDTH for s in steps if isinstance(s, Recv))
        # a rank's links carry its incoming blocks and its attention, one at a time
        assert result.makespan_s >= busy + wire_in - 1e-12
    assert result.makespan_s >= overlapped.makespan_s - 1e-12


@pytest.mark.parametrize("world", [2, 3, 4, 5, 6])
def test_a_core_per_rank_books_the_turns_as_no_core_model_does(world):
    """Ranks that never queue for a core must take their turns at the same times whether or
    not the hardware models cores: both book an attention when it starts."""
    topo = Topology.from_spec(f"local:ranks={world},latency=0,bandwidth={BANDWIDTH}")
    w = DecodeWorkload("llama-3.1-8b", 65536)
    schedule = build_schedule("ring", topo, w)
    makespans = [simulate(schedule, topo, w, HardwareModel(
        "cpu", 1e10, 1e15, 1e-5, host=CpuHost(cores=cores, copies_messages=True)),
        BACKEND).makespan_s
        for cores in (None, world)]
    assert makespans[0] == pytest.approx(makespans[1], rel=1e-12)


def test_the_wait_for_copies_is_wire_time_on_the_critical_path():
    schedule, result = _ring(2, 65536, True)
    hw, steps = _hardware(True), schedule.steps[0]
    path = result.critical_path
    assert path["compute_s"] + path["overhead_s"] + path["wire_s"] == pytest.approx(
        result.makespan_s, rel=1e-12)
    # the path runs through the rank's own attention, which waited out the block's copy:
    # compute is the three computes' own time, and the wait is on the wire
    own = sum(_compute_s(hw, s) for s in (steps[1], steps[3], steps[4]))
    assert path["compute_s"] == pytest.approx(own, rel=1e-9)
    assert path["wire_s"] >= steps[0].nbytes / BANDWIDTH * (1 - 1e-9)


def test_links_that_are_no_ranks_own_take_no_turns():
    """On a mesh (MI300X's xGMI: a link per peer) no link is a rank's own, so copies
    change nothing there."""
    topo = Topology.from_spec("mi300x")
    w = DecodeWorkload("llama-3.1-8b", 65536)
    schedule = build_schedule("ring", topo, w)
    alone, copied = (simulate(schedule, topo, w, _hardware(c), BACKEND).makespan_s
                     for c in (False, True))
    assert copied == alone


def test_small_messages_barely_move_a_tree():
    topo = Topology.from_spec(f"local:ranks=4,latency=0,bandwidth={BANDWIDTH}")
    w = DecodeWorkload("llama-3.1-8b", 65536)
    schedule = build_schedule("tree", topo, w, shape="binomial")
    alone, copied = (simulate(schedule, topo, w, _hardware(c), BACKEND).makespan_s
                     for c in (False, True))
    # a partial is kilobytes: at most every message's wire time more
    assert alone <= copied <= alone + 6 * w.partial_bytes / BANDWIDTH + 1e-12


def test_gloo_profiles_copy_messages_and_others_do_not():
    profile = {"version": 1, "backend": "gloo", "world": 2, "cores": 2,
               "p2p": {"latency_s": 4e-5, "bandwidth_Bps": 1e9},
               "attention": {"bandwidth_Bps": 1e10, "launch_s": 1e-5}}
    assert hardware_from_profile(profile).host.copies_messages
    assert not hardware_from_profile({**profile, "backend": "nccl"}).host.copies_messages
    assert HardwareModel("h100", 3e12, 1e15, 4e-6).host is None  # a GPU's host adds nothing


# -- the calendar's joint booking ----------------------------------------------------------

BUSY = st.lists(st.tuples(st.floats(0, 10), st.floats(0.01, 2)), max_size=6)


@settings(max_examples=200, deadline=None)
@given(a=BUSY, b=BUSY, ready=st.floats(0, 12), hold=st.floats(0.01, 3))
def test_reserve_together_takes_the_earliest_slot_free_on_every_edge(a, b, ready, hold):
    calendar = LinkCalendar()
    taken: dict[str, list[tuple[float, float]]] = {"a": [], "b": []}
    for edge, intervals in (("a", a), ("b", b)):
        for start, length in intervals:
            begin, end = calendar.reserve(edge, start, length, start, 0.0)
            taken[edge].append((begin, end))

    def free(t: float) -> bool:
        return all(t + hold <= s or t >= e for spans in taken.values() for s, e in spans)

    begin = calendar.reserve_together(["a", "b"], ready, hold, 0.0)
    assert begin >= ready and free(begin)
    # earliest: no candidate start (ready, or the end of a busy interval) before it is free
    candidates = [ready] + [e for spans in taken.values() for _, e in spans]
    assert not any(ready <= t < begin - 1e-12 and free(t) for t in candidates)
    # and it is booked: the same slot is no longer free on either edge
    assert calendar.fit("a", begin, hold) >= begin + hold - 1e-12
    assert calendar.fit("b", begin, hold) >= begin + hold - 1e-12


# -- calibration posts the exchange's receive first, as the executor does ---------------------

class _Done:
    def wait(self, timeout=None):
        return True


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def irecv(self, buf, src, tag):
        self.calls.append(("irecv", src))
        return _Done()

    def isend(self, tensor, dst, tag):
        self.calls.append(("isend", dst))
        return _Done()


def test_the_exchange_posts_its_receive_before_its_send():
    import torch

    from treeattn.runtime.group import RankContext
    from treeattn.testbed.calibration.calibrate import exchange_once

    ctx = RankContext(rank=1, world=3, local_rank=1, device=torch.device("cpu"),
                      backend="gloo", timeout_s=1.0)
    assert ctx.timeout == timedelta(seconds=1)
    p2p = _Recorder()
    exchange_once(ctx, p2p, torch.zeros(4), torch.zeros(4))
    assert p2p.calls == [("irecv", 0), ("isend", 2)]
