"""Cold host steps and pinned cores in the simulator, against hand-derived costs."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from treeattn.schedule.ir import Collective, Compute, Merge, Recv, Schedule, Send
from treeattn.schedule.payloads import CollectiveOp, ComputeLabel, Payload
from treeattn.sim import DecodeWorkload, HardwareModel, SimError, build_schedule, simulate
from treeattn.sim.devices import BackendModel
from treeattn.testbed.host.cold import ColdSteps, cold_from_profile
from treeattn.testbed.host.model import CpuHost
from treeattn.testbed.host.profiles import hardware_from_profile
from treeattn.topo import Topology

BW, LAUNCH, SEND, RECV = 1e10, 1e-6, 2e-6, 3e-6
BIG = 64 << 20  # an attention that streams far more than after_bytes
COLD = ColdSteps(merge_s=50e-6, message_s=80e-6, world=2,
                 collective_s=(("all_reduce", 900e-6),), after_bytes=4 << 20)
BACKEND = BackendModel("toy", SEND, RECV)
W = DecodeWorkload("debug", 64)


def cpu(**kw) -> HardwareModel:
    return HardwareModel("cpu", BW, 1e30, LAUNCH, host=CpuHost(**kw))


def local(ranks: int) -> Topology:
    return Topology.from_spec(f"local:ranks={ranks},latency=0,bandwidth=1e12")


def run(steps, hardware, ranks=2):
    schedule = Schedule("hand", steps).validate()
    return simulate(schedule, local(ranks), W, hardware, BACKEND).makespan_s


def attention(nbytes=BIG):
    return Compute(ComputeLabel.ATTENTION, nbytes)


def message_pair():
    """Rank 1 attends and sends twice; rank 0 attends, receives and merges twice."""
    return [[attention(), Recv(1, 100, 1), Merge(300, tag=1), Recv(1, 100, 2),
             Merge(300, tag=2)],
            [attention(), Send(0, 100, 1), Send(0, 100, 2)]]


def test_first_steps_after_the_kernel_pay_the_cold_costs_once():
    warm = run(message_pair(), cpu())
    cold = run(message_pair(), cpu(cold=COLD))
    # the first send's half, the first receive's half and the first merge; the rest is warm
    assert cold - warm == pytest.approx(COLD.message_s + COLD.merge_s, rel=1e-9)


def test_a_small_attention_leaves_the_caches_warm():
    steps = [[attention(1 << 20), Recv(1, 100, 1), Merge(300, tag=1)],
             [attention(1 << 20), Send(0, 100, 1)]]
    assert run(steps, cpu(cold=COLD)) == pytest.approx(run(steps, cpu()), rel=1e-12)


def test_every_attention_makes_its_rank_cold_again():
    one = [[attention(), Recv(1, 100, 1), Merge(300, tag=1)], [attention(), Send(0, 100, 1)]]
    two = [one[0] + [attention(), Recv(1, 100, 2), Merge(300, tag=2)],
           one[1] + [attention(), Send(0, 100, 2)]]
    extra = lambda s: run(s, cpu(cold=COLD)) - run(s, cpu())  # noqa: E731
    # Round two pays rank 0's cold receive and merge again. Rank 1's second cold send is off
    # the critical path: rank 1 started its second attention while rank 0 still merged.
    assert extra(two) == pytest.approx(extra(one) + COLD.recv_s + COLD.merge_s, rel=1e-9)


def all_reduce(group, nbytes=4096):
    return Collective(CollectiveOp.ALL_REDUCE_SUM, group, nbytes, Payload.NUM)


def test_a_cold_collective_costs_what_calibration_measured_after_the_kernel():
    group = (0, 1)
    steps = [[attention(), all_reduce(group), all_reduce(group)] for _ in group]
    warm = run(steps, cpu())
    cold = run(steps, cpu(cold=COLD))
    single = [[attention(), all_reduce(group)] for _ in group]
    warm_price = run(single, cpu()) - run([[attention()], [attention()]], cpu())
    # the first collective costs the calibrated 900 µs in all; the second is warm
    assert cold - warm == pytest.approx(900e-6 - warm_price, rel=1e-9)


def test_a_collective_over_other_than_the_calibrated_world_is_priced_warm():
    group = (0, 1)
    steps = [[attention(), all_reduce(group)] for _ in group]
    other = ColdSteps(collective_s=COLD.collective_s, world=4)
    assert run(steps, cpu(cold=other)) == pytest.approx(run(steps, cpu()), rel=1e-12)


def test_pinned_ranks_queue_only_behind_their_own_core():
    d = BIG / BW + LAUNCH
    steps = [[attention()], [], [attention()], []]  # ranks 0 and 2 share core 0 when pinned
    assert run(steps, cpu(cores=2), ranks=4) == pytest.approx(d, rel=1e-9)
    assert run(steps, cpu(cores=2, pinned=True), ranks=4) == pytest.approx(2 * d, rel=1e-9)


def test_a_rank_sharing_its_core_cannot_post_while_its_neighbour_computes():
    d = BIG / BW + LAUNCH
    # rank 1 computes from time 0; rank 3, pinned to the same core, sends to rank 0 at once
    steps = [[Recv(3, 100, 1), Merge(300, tag=1)], [attention()], [], [Send(0, 100, 1)]]
    schedule = Schedule("hand", steps).validate()

    def rank0_done(hardware) -> float:
        timeline = simulate(schedule, local(4), W, hardware, BACKEND).timeline
        return max(end for r, *_, end in timeline if r == 0)

    assert rank0_done(cpu(cores=2)) < d
    assert rank0_done(cpu(cores=2, pinned=True)) >= d + SEND  # the send waited for the core


@settings(max_examples=25, deadline=None)
@given(algorithm=st.sampled_from(["tree", "butterfly", "allgather", "oneshot", "helix", "dcp",
                                  "allreduce3", "ring-passq"]),
       tokens=st.integers(1_000, 400_000))
def test_cold_costs_only_ever_add_time(algorithm, tokens):
    topo = local(4)
    w = DecodeWorkload("llama-3.1-8b", tokens)
    schedule = build_schedule(algorithm, topo, w)
    cold = ColdSteps(merge_s=5e-5, message_s=8e-5, world=4,
                     collective_s=tuple((op, 1e-3) for op in
                                        ("all_reduce", "all_gather", "reduce_scatter",
                                         "all_to_all", "broadcast")))
    base = simulate(schedule, topo, w, cpu(cores=2, pinned=True), BACKEND).makespan_s
    slow = simulate(schedule, topo, w, cpu(cores=2, pinned=True, cold=cold),
                    BACKEND).makespan_s
    assert slow >= base * (1 - 1e-12)
    assert slow <= base + 4 * (5e-5 + 8e-5 + 1e-3) * len(schedule.steps[0])


def test_profiles_carry_pinning_and_cold_costs():
    profile = {"version": 1, "backend": "gloo", "world": 2, "cores": 2, "pinned": True,
               "p2p": {"latency_s": 4e-5, "bandwidth_Bps": 2e9},
               "attention": {"bandwidth_Bps": 8e9, "launch_s": 1e-5},
               "cold": {"merge_s": 5e-5, "message_s": 7e-5, "world": 2, "after_bytes": 4e6,
                        "collectives_s": {"all_to_all": 6e-4}}}
    host = hardware_from_profile(profile).host
    assert host.pinned and host.cold == ColdSteps(5e-5, 7e-5, (("all_to_all", 6e-4),), 2, 4e6)
    assert not hardware_from_profile(dict(profile, pinned=False)).host.pinned
    no_cold = {k: v for k, v in profile.items() if k != "cold"}
    assert hardware_from_profile(no_cold).host.cold is None


@pytest.mark.parametrize("bad", [{"merge_s": "fast"}, {"merge_s": -1.0},
                                 {"collectives_s": {"all_gather": -2e-4}},
                                 {"after_bytes": 0}, {"collectives_s": [1, 2]}])
def test_malformed_cold_sections_are_sim_errors(bad):
    with pytest.raises(SimError, match="cold"):
        cold_from_profile(bad)
