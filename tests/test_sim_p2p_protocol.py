"""NCCL's protocol for a send/recv across hosts: Simple unless the network connections have
LL buffers (``NCCL_ALLOC_P2P_NET_LL_BUFFERS=1``), and every path that prices a message
agrees.

Expected times are hand counts from NCCL 2.30.7's tuning constants (``src/graph/tuning.cc``):
ring base latency LL 6.6 µs, Simple 8.4 µs; NVLink hop (LL) 0.6 µs; network hop at the
tree's figure, where a lone message's latency is fully exposed, LL 5.0 µs, Simple 14.0 µs;
the network post overhead 1 µs (Intel hosts), ×3 for a Simple step, and one plain post (1
µs) that a message across hosts pays for the proxy's slot post on NCCL's shared p2p buffers
(``src/transport/net.cc``, default ``NCCL_NET_SHARED_BUFFERS``). Bandwidths: a DGX H100 GPU's
18 NVLinks at NCCL's 20.6 GB/s each, and its own 400 Gb/s rail (50 GB/s), both halved on LL.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from treeattn.cli import main
from treeattn.schedule.ir import Recv, Schedule, Send
from treeattn.sim import DecodeWorkload
from treeattn.sim.devices import backend_for
from treeattn.sim.engine import simulate
from treeattn.sim.nccl.collectives import GroupShape, collective_cost, p2p_cost
from treeattn.sim.nccl.env import parse_nccl_env, with_env
from treeattn.sim.network import CostModel
from treeattn.sim.tree_search import cost_matrix
from treeattn.topo import Topology

KIB = 1024
NVLINK = 18 * 20.6e9  # B/s, one H100's NVLink total as NCCL models it
RAIL = 50e9  # B/s, one 400 Gb/s NIC per GPU
NET_LL = backend_for("nccl").__class__("nccl", 3.3e-6, 3.3e-6,
                                       nccl_env=(("NCCL_ALLOC_P2P_NET_LL_BUFFERS", "1"),))
N = 16 * KIB
# one 16 KiB message, by hand
ACROSS_SIMPLE = (8.4 + 14.0 + 1.0) * 1e-6 + N / RAIL
ACROSS_LL = (6.6 + 5.0 + 1.0) * 1e-6 + N / (RAIL / 2)
INSIDE_LL = (6.6 + 0.6) * 1e-6 + N / (NVLINK / 2)


def _one_message(nbytes: int, dst: int, world: int) -> Schedule:
    steps = [[] for _ in range(world)]
    steps[0], steps[dst] = [Send(dst, nbytes, 0)], [Recv(0, nbytes, 0)]
    return Schedule("one-message", steps, {})


@pytest.mark.parametrize("backend, dst, want", [
    (None, 8, ACROSS_SIMPLE), (NET_LL, 8, ACROSS_LL),
    (None, 1, INSIDE_LL), (NET_LL, 1, INSIDE_LL),
])
def test_a_16k_send_is_simple_across_hosts_unless_net_ll_buffers(backend, dst, want):
    topo = Topology.from_spec("dgx-h100:nodes=2")
    w = DecodeWorkload("debug", 64)
    cm = CostModel(topo, w, backend=backend)
    engine = simulate(_one_message(N, dst, 16), topo, w, costs=cm).makespan_s
    closed = cm.send_cost(N) + cm.wire(0, dst, N) + cm.recv_cost(N)
    searched = cost_matrix(topo, N, cm.backend)[0, dst]
    shape = with_env(GroupShape.of(topo, range(16)), cm.backend.nccl_env)
    library = p2p_cost(N, shape, across_nodes=dst == 8)
    assert engine == pytest.approx(want, rel=1e-9)
    assert closed == pytest.approx(want, rel=1e-9)
    assert searched == pytest.approx(want, rel=1e-9)
    assert library.time_s == pytest.approx(want, rel=1e-9)
    assert library.protocol == ("Simple" if dst == 8 and backend is None else "LL")


def test_the_all_to_all_sends_simple_across_hosts():
    """Helix's and pass-Q's all-to-all: 16 KiB to each of 15 peers, 8 of them remote."""
    shape = GroupShape.of(Topology.from_spec("dgx-h100:nodes=2"), range(16))
    nbytes = 16 * N
    # slowest class: the network (with the slot post), plus one post per further remote
    # peer (7 of them)
    simple = (8.4 + 14.0 + 1.0 + 7 * 3.0) * 1e-6 + 8 * N / RAIL
    ll = (6.6 + 5.0 + 1.0 + 7 * 1.0) * 1e-6 + 8 * N / (RAIL / 2)
    assert collective_cost("all_to_all", nbytes, shape).time_s == pytest.approx(simple)
    on = replace(shape, p2p_net_ll=True)
    assert collective_cost("all_to_all", nbytes, on).time_s == pytest.approx(ll)
    assert collective_cost("all_to_all", nbytes, on).protocol == "LL"


def test_the_slot_post_goes_with_shared_buffers_and_scales_with_the_host_cpu():
    """NCCL_NET_SHARED_BUFFERS=0 gives network send/recv connections their own buffers, one
    per protocol (the sender starts with credits, and LL is mapped): no slot post, and a small
    message runs LL (ring LL base 6.6 µs + the network's LL hop 5.0 µs). AMD hosts post at
    2 µs."""
    two = GroupShape.of(Topology.from_spec("dgx-h100:nodes=2"), range(16))
    own = with_env(two, parse_nccl_env(["NCCL_NET_SHARED_BUFFERS=0"]))
    assert not own.p2p_net_shared and own.p2p_net_ll
    assert p2p_cost(8, own, across_nodes=True).latency_s == pytest.approx((6.6 + 5.0) * 1e-6)
    # own buffers without LL (a shape the variables cannot make, kept to isolate the post)
    simple_own = replace(own, p2p_net_ll=False)
    assert p2p_cost(8, simple_own, across_nodes=True).latency_s == pytest.approx(
        (8.4 + 14.0) * 1e-6)
    assert p2p_cost(8, two, across_nodes=True).latency_s == pytest.approx(
        (8.4 + 14.0 + 1.0) * 1e-6)
    amd = replace(two, cpu_vendor="amd")
    assert p2p_cost(8, amd, across_nodes=True).latency_s == pytest.approx(
        (8.4 + 14.0 + 2.0) * 1e-6)
    # inside a host nothing changes: ring LL base + one NVLink hop
    assert p2p_cost(8, two, across_nodes=False).latency_s == pytest.approx((6.6 + 0.6) * 1e-6)
    # the all-to-all: slot post once, then one post per further remote peer
    nbytes = 16 * 4 * KIB
    lat = collective_cost("all_to_all", nbytes, own).latency_s
    assert lat == pytest.approx((6.6 + 5.0 + 7 * 1.0) * 1e-6)  # LL: one post per peer
    lat = collective_cost("all_to_all", nbytes, simple_own).latency_s
    assert lat == pytest.approx((8.4 + 14.0 + 7 * 3.0) * 1e-6)  # Simple: x3 per peer


def test_prefill_and_planner_read_the_backend_option():
    """The option reaches every pricer through the backend: LL across hosts is cheaper."""
    from treeattn.sim.planning.planner import plan_workload as plan
    from treeattn.sim.prefill.pricing import predict_prefill

    topo = Topology.from_spec("dgx-h100:nodes=2")
    w = DecodeWorkload("llama-3.2-1b", 32 * KIB)  # an 8.3 KB partial: LL-sized
    def best(backend):
        out: dict[str, float] = {}
        for c in plan(topo, w, backend=backend, simulate_each=True).candidates:
            out[c.algorithm] = min(out.get(c.algorithm, float("inf")), c.latency_s)
        return out

    plain, ll = best(None), best(NET_LL)
    assert ll["butterfly"] < plain["butterfly"]
    assert ll["helix"] < plain["helix"]
    prompt = {p.algorithm: p.ttft_s for p in predict_prefill(topo, "llama-3.1-8b", 4096)}
    fast = {p.algorithm: p.ttft_s for p in predict_prefill(topo, "llama-3.1-8b", 4096,
                                                           backend=NET_LL)}
    assert all(fast[a] <= prompt[a] for a in prompt)


def test_parse_nccl_env_refuses_what_the_model_does_not_read():
    assert parse_nccl_env(["NCCL_ALLOC_P2P_NET_LL_BUFFERS=0"]) == (
        ("NCCL_ALLOC_P2P_NET_LL_BUFFERS", "0"),)
    assert parse_nccl_env(["NCCL_NET_SHARED_BUFFERS=0"]) == (("NCCL_NET_SHARED_BUFFERS", "0"),)
    for bad in (["NCCL_PROTO=LL"], ["NCCL_ALLOC_P2P_NET_LL_BUFFERS=2"], ["NOEQUALS"],
                ["NCCL_NET_SHARED_BUFFERS=2"]):
        with pytest.raises(ValueError):
            parse_nccl_env(bad)


@pytest.mark.parametrize("argv", [
    ("comm", "--topology", "dgx-h100:nodes=2", "--op", "sendrecv"),
    ("predict", "--topology", "dgx-h100:nodes=2", "--model", "debug", "--seq-len", "64"),
    ("plan", "--topology", "dgx-h100:nodes=2", "--model", "debug", "--seq-len", "64"),
])
def test_unknown_nccl_env_is_one_error_line(capsys, argv):
    code = main([*argv, "--nccl-env", "NCCL_PROTO=LL"])
    _, err = capsys.readouterr()
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1
    assert "NCCL_PROTO" in err


def test_comm_prints_the_protocol_the_option_picks(capsys):
    argv = ["comm", "--topology", "dgx-h100:nodes=2", "--op", "sendrecv", "--min-bytes", "16K",
            "--max-bytes", "16K", "--json"]
    import json

    assert main(argv) == 0
    plain = json.loads(capsys.readouterr()[0])["rows"][0]
    assert main([*argv, "--nccl-env", "NCCL_ALLOC_P2P_NET_LL_BUFFERS=1"]) == 0
    ll = json.loads(capsys.readouterr()[0])["rows"][0]
    assert (plain["protocol"], ll["protocol"]) == ("Simple", "LL")
    assert plain["time_us"] == pytest.approx(ACROSS_SIMPLE * 1e6, abs=1e-3)
    assert ll["time_us"] == pytest.approx(ACROSS_LL * 1e6, abs=1e-3)


def test_an_nccl_tests_profile_carries_the_variables_its_run_had(tmp_path, capsys):
    import json
    from pathlib import Path

    from treeattn.sim.files.profiles import plan_overrides

    table = (Path(__file__).parent / "fixtures" / "nccl-tests"
             / "h100-2node-all-reduce-perf-8B-16G-issue309.txt")
    path = tmp_path / "p.json"
    assert main(["calibrate", "--nccl-tests", str(table), "--topology", "dgx-h100:nodes=2",
                 "-o", str(path)]) == 0
    capsys.readouterr()
    profile = json.loads(path.read_text())
    topo = Topology.from_spec("dgx-h100:nodes=2")
    assert plan_overrides(profile, topo)["backend"].nccl_env == ()
    profile["nccl_env"] = {"NCCL_ALLOC_P2P_NET_LL_BUFFERS": "1"}
    on = plan_overrides(profile, topo)["backend"]
    assert on.nccl_env == (("NCCL_ALLOC_P2P_NET_LL_BUFFERS", "1"),)
    # the flag wins over the profile
    off = plan_overrides(profile, topo, ["NCCL_ALLOC_P2P_NET_LL_BUFFERS=0"])["backend"]
    assert off.nccl_env == (("NCCL_ALLOC_P2P_NET_LL_BUFFERS", "0"),)
    assert off.calibration is not None
    profile["nccl_env"] = {"NCCL_PROTO": "LL"}
    with pytest.raises(ValueError, match="NCCL_PROTO"):
        plan_overrides(profile, topo)
