"""The CPU test bed behind its interfaces: without it plugged in, the simulator, the kernels,
the runtime's transport and the planner's profile reading take their plain paths; with it,
its own."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from treeattn.kernels import (
    KernelError,
    dispatch,
    partial_attention,
    partial_attention_path,
    reference,
)
from treeattn.runtime import transport
from treeattn.runtime.collective_ops import CollectiveOps
from treeattn.schedule.workload import DecodeWorkload
from treeattn.sim import SimError, build_schedule, simulate
from treeattn.sim.devices import hardware_for
from treeattn.sim.files import profiles
from treeattn.testbed.host.model import CpuHost
from treeattn.testbed.kernels.chain import CpuChain
from treeattn.testbed.transport.plugin import SharedMemory
from treeattn.testbed.transport.shm_collectives import MailboxCollectives
from treeattn.topo import Topology

CPU_PROFILE = {"version": 1, "backend": "gloo", "world": 2, "cores": 2,
               "p2p": {"latency_s": 4e-5, "bandwidth_Bps": 2e9},
               "attention": {"bandwidth_Bps": 8e9, "launch_s": 1e-5}}


@pytest.fixture
def unplugged(monkeypatch):
    """No test bed in this process for one test (the suite plugs it in: conftest.py)."""
    monkeypatch.setattr(dispatch, "_cpu_kernels", None)
    monkeypatch.setattr(transport, "_plugin", None)
    monkeypatch.setattr(profiles, "_host_profiles", None)


@pytest.mark.parametrize("spec", ["dgx-h100:nodes=2", "local:ranks=3,latency=1e-6"])
def test_a_host_that_adds_nothing_prices_as_the_plain_host(spec):
    topo = Topology.from_spec(spec)
    w = DecodeWorkload("llama-3.1-8b", 65536)
    gpu = hardware_for(topo.gpu_model(0))
    assert gpu.host is None
    for algorithm in ("tree", "ring", "allgather"):
        schedule = build_schedule(algorithm, topo, w)
        plain = simulate(schedule, topo, w, gpu).makespan_s
        cpu_host = simulate(schedule, topo, w, replace(gpu, host=CpuHost())).makespan_s
        assert cpu_host == plain  # the same float: no term added anywhere


def test_without_the_chain_cpu_calls_take_the_exact_path(unplugged, monkeypatch):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(*s, generator=g) for s in ((1, 4, 8), (1, 2, 6, 8), (1, 2, 6, 8)))
    assert partial_attention_path(q, k, v) == "exact"
    got, want = partial_attention(q, k, v), reference.partial_attention(q, k, v)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    monkeypatch.setenv(dispatch.ENV_BACKEND, "native")
    with pytest.raises(KernelError, match="plugged in"):
        partial_attention(q, k, v)


def test_the_chain_takes_small_cpu_calls(monkeypatch):
    monkeypatch.setattr(dispatch, "_cpu_kernels", CpuChain())
    q, k = torch.randn(1, 4, 8), torch.randn(1, 2, 6, 8)
    assert partial_attention_path(q, k, k) in ("native", "small")


def test_without_a_local_transport_the_process_group_runs_everything(unplugged):
    ctx = SimpleNamespace(rank=0, group=None)
    ops = transport.collective_ops(ctx, (0, 1), None, object())
    assert type(ops) is CollectiveOps
    assert transport.compile_program([], [], 0, object(), None) is None


def test_the_local_transport_takes_the_groups_with_a_channel(monkeypatch):
    monkeypatch.setattr(transport, "_plugin", SharedMemory())
    ctx = SimpleNamespace(rank=1, group=None)
    assert isinstance(transport.collective_ops(ctx, (0, 1), None, object()),
                      MailboxCollectives)
    assert type(transport.collective_ops(ctx, (0, 1), None, None)) is CollectiveOps


def test_a_cpu_profile_needs_the_test_beds_reader(unplugged):
    topo = Topology.from_spec("local:ranks=2")
    with pytest.raises(SimError, match="test bed"):
        profiles.plan_overrides(CPU_PROFILE, topo)
    from treeattn import testbed

    testbed.plug_in_profiles()
    hardware = profiles.plan_overrides(CPU_PROFILE, topo)["hardware"]
    assert hardware.host == CpuHost(cores=2, copies_messages=True)
