"""Plain reductions of partials (treeattn/testbed/host/partial_reduction.py): which ranks run
as the runtime's C program, and what the simulator charges them, against hand-derived costs."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_sim_engine import bound, predict
from test_sim_profile import PROFILE  # a valid world-2 profile

from treeattn.schedule.ir import Compute, Merge, Recv, Schedule, Send
from treeattn.schedule.payloads import ComputeLabel
from treeattn.sim import DecodeWorkload, HardwareModel, SimError, build_schedule, simulate
from treeattn.sim.devices import BackendModel, hardware_for
from treeattn.testbed.host.cold import ColdSteps
from treeattn.testbed.host.model import CpuHost
from treeattn.testbed.host.partial_reduction import (
    RECV_MERGE,
    RECV_REPLACE,
    SEND,
    ProgramCosts,
    reduction_ops,
)
from treeattn.testbed.host.profiles import (
    backend_from_profile,
    hardware_from_profile,
    program_costs,
)
from treeattn.topo import Topology

SEND_S, RECV_S = 20e-6, 30e-6  # the Python steps' costs
PROGRAM = ProgramCosts(send_s=1e-6, recv_s=2e-6, max_bytes=65536, tags=8)
COLD = ColdSteps(merge_s=50e-6, message_s=80e-6, world=2, collective_s=(),
                 after_bytes=4 << 20)
W = DecodeWorkload("debug", 64)
BACKEND = BackendModel("toy", SEND_S, RECV_S)
BIG = 64 << 20
VARIANTS = [("tree", {"shape": s}) for s in ("chain", "flat", "binomial", "kary")] + [
    ("butterfly", {}), ("allgather", {})]


def local(ranks: int) -> Topology:
    return Topology.from_spec(f"local:ranks={ranks},latency=0,bandwidth=1e12")


def cpu(**kw) -> HardwareModel:
    return HardwareModel("cpu", 1e10, 1e30, 1e-6, host=CpuHost(**kw))


def makespan(steps, program=None, hardware=None, ranks=2) -> float:
    hardware = hardware or cpu()
    hardware = replace(hardware, host=replace(hardware.host, program=program))
    schedule = Schedule("hand", steps).validate()
    return simulate(schedule, local(ranks), W, hardware, BACKEND).makespan_s


def exchange(nbytes=2340, tag=0):
    """Butterfly at 2 ranks: each attends, sends its partial, receives and merges the
    other's."""
    return [[Compute(ComputeLabel.ATTENTION, BIG), Send(1 - r, nbytes, tag),
             Recv(1 - r, nbytes, tag), Merge(3 * nbytes, tag=tag)] for r in range(2)]


@settings(max_examples=40, deadline=None)
@given(world=st.integers(2, 9), algorithm=st.sampled_from(
    ["tree", "butterfly", "allgather", "ring", "helix", "dcp", "oneshot", "allreduce3"]))
def test_the_rule_takes_exactly_the_whole_partial_reductions(world, algorithm):
    schedule = build_schedule(algorithm, local(world), DecodeWorkload("debug", 4096))
    power_of_two = world & (world - 1) == 0
    expected = algorithm in ("tree", "allgather") or (algorithm == "butterfly" and power_of_two)
    for steps in schedule.steps:
        ops = reduction_ops(steps)
        assert (ops is not None) == expected
        if ops is not None:  # one op per message, in step order, each naming its step
            messages = [i for i, s in enumerate(steps) if isinstance(s, Send | Recv)]
            assert [index for _, index, _, _, _ in ops] == messages
            for kind, index, peer, tag, nbytes in ops:
                step = steps[index]
                assert (kind == SEND) == isinstance(step, Send)
                assert (peer, tag, nbytes) == (
                    step.dst if kind == SEND else step.src, step.tag, step.nbytes)
                if kind != SEND:
                    assert (kind == RECV_MERGE) == step.reduce


def test_a_merge_that_does_not_follow_its_receive_is_not_a_plain_reduction():
    steps = [Compute(ComputeLabel.ATTENTION, 8), Recv(1, 8, 0), Send(1, 8, 1), Merge(8, tag=0)]
    assert reduction_ops(steps) is None
    broadcast = [Compute(ComputeLabel.ATTENTION, 8), Recv(1, 8, 0, reduce=False)]
    assert reduction_ops(broadcast) == [(RECV_REPLACE, 1, 1, 0, 8)]


def test_a_program_rank_pays_the_programs_message_costs():
    python = makespan(exchange())
    program = makespan(exchange(), PROGRAM)
    # one send and one receive on the critical path of each rank
    assert python - program == pytest.approx(SEND_S + RECV_S - PROGRAM.send_s - PROGRAM.recv_s,
                                             rel=1e-9)


def test_a_program_rank_runs_nothing_cold():
    cold = cpu(cold=COLD)
    assert makespan(exchange(), PROGRAM, cold) == pytest.approx(makespan(exchange(), PROGRAM),
                                                                rel=1e-12)
    assert makespan(exchange(), None, cold) > makespan(exchange(), None)  # Python steps do


@pytest.mark.parametrize("steps", [exchange(nbytes=65537), exchange(tag=8)])
def test_messages_past_the_mailboxes_keep_the_python_costs(steps):
    assert makespan(steps, PROGRAM) == pytest.approx(makespan(steps), rel=1e-12)


def test_groups_without_mailboxes_keep_the_python_costs():
    """More ranks than get a segment, or ranks on two hosts: no program runs there."""
    small = ProgramCosts(1e-6, 2e-6, 65536, 8, max_world=1)
    assert makespan(exchange(), small) == pytest.approx(makespan(exchange()), rel=1e-12)
    two_hosts = Topology.from_spec("dgx-h100:nodes=2")
    schedule = build_schedule("tree", two_hosts, W)
    roomy = ProgramCosts(1e-6, 2e-6, 65536, 8, max_world=64)  # only the hosts rule it out
    gpu = hardware_for(two_hosts.gpu_model(0))
    with_program = replace(gpu, host=CpuHost(program=roomy))
    assert (simulate(schedule, two_hosts, W, with_program, BACKEND).makespan_s
            == pytest.approx(simulate(schedule, two_hosts, W, gpu, BACKEND).makespan_s,
                             rel=1e-12))


def test_the_profile_gives_the_program_alpha_half_plus_its_step_never_below_zero():
    base = copy.deepcopy(PROFILE)
    base["p2p"]["latency_s"] = 10e-6
    base["executor"] = {"step_overhead_s": 4e-6, "program_message_bytes": 65536,
                        "program_tags": 8, "program_max_world": 8}
    assert hardware_from_profile(base).host.program is None  # no program ran there
    base["executor"]["program_step_s"] = -2e-6
    assert backend_from_profile(base).send_s == pytest.approx(9e-6)  # α/2 + Python steps'
    assert hardware_from_profile(base).host.program.send_s == pytest.approx(3e-6)
    assert program_costs({"executor": {"program_step_s": -9e-6, "program_message_bytes": 1,
                                       "program_tags": 1, "program_max_world": 2}},
                         10e-6).recv_s == 0.0


@pytest.mark.parametrize("section", [
    {"program_step_s": "x", "program_message_bytes": 1, "program_tags": 1,
     "program_max_world": 8},
    {"program_step_s": 1e-6, "program_tags": 1, "program_max_world": 8},
    {"program_step_s": float("nan"), "program_message_bytes": 1, "program_tags": 1,
     "program_max_world": 8},
    {"program_step_s": 1e-6, "program_message_bytes": 0, "program_tags": 1,
     "program_max_world": 8},
    {"program_step_s": 1e-6, "program_message_bytes": 1, "program_tags": 1},
    {"program_step_s": 1e-6, "program_message_bytes": 1, "program_tags": 1,
     "program_max_world": 1},
])
def test_malformed_program_entries_are_a_clear_error(section):
    with pytest.raises(SimError, match="program entries"):
        program_costs({"executor": section}, 1e-6)


@settings(max_examples=40, deadline=None)
@given(variant=st.sampled_from(VARIANTS), world=st.integers(2, 6), seq=st.integers(16, 200_000),
       program_s=st.tuples(st.floats(0, 1e-4), st.floats(0, 1e-4)))
def test_the_closed_form_stays_a_lower_bound_with_a_program(variant, world, seq, program_s):
    """Cheaper or dearer than the Python steps, the program's costs never lift the planner's
    closed form above the simulation."""
    algorithm, params = variant
    topo = Topology.from_spec(f"local:ranks={world},latency=2e-6,bandwidth=5e9")
    w = DecodeWorkload("llama-3.2-1b", seq)
    hw = cpu(program=ProgramCosts(*program_s, 1 << 20, 8))
    sim = predict(algorithm, params, topo, w, hardware=hw, backend=BACKEND).makespan_s
    assert sim >= bound(algorithm, params, topo, w, hardware=hw,
                        backend=BACKEND) * (1 - 1e-12)
