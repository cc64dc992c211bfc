"""The one-sided transports: torch's symm_mem kernels and FlashInfer's MNNVL LL128 all-to-all.

References are worked by hand from the published constants the modules name (NCCL 2.30.7
``sym_kernels.cc``: Hopper LL all-gather base 4.5 µs, plain 7.8 µs, 65 and 44 GB/s per
block, 480 and 320 GB/s ceilings, GB = 2**30 bytes; torch's launch caps; the LL128 line of
120 data bytes in 128), not read back from the code under test. The fixed costs are those
figures at each generation's published graph-replay fraction: on Hopper SGLang PR #2904's
one-shot all-reduce (2 H100s, 512 B, 3.7 µs) over NCCL's plain all-reduce base (7.8 µs), on
Blackwell nccl-tests issue #333's LL symmetric all-reduce (8 B200s, CUDA graphs, 3.0 µs)
over NCCL's LL all-reduce base (11 µs).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from treeattn.cli import main
from treeattn.schedule.payloads import CollectiveOp, SimError
from treeattn.sim import DecodeWorkload, plan_workload
from treeattn.sim.deploy.capacity import Split
from treeattn.sim.deploy.engines import describe, emit
from treeattn.sim.deploy.token import predict_token
from treeattn.sim.files.profiles import plan_overrides
from treeattn.sim.nccl.collectives import GroupShape, collective_cost
from treeattn.sim.network import CostModel
from treeattn.sim.onesided import ONE_SIDED, TRANSPORTS, torch_symm, unoffered_reason
from treeattn.sim.onesided.fixed_costs import GRAPH_REPLAY, barrier_us, exchange_us
from treeattn.sim.parallel import sub_topology
from treeattn.topo import Topology

ONE_BOX = Topology.from_spec("dgx-h100")
B200_BOX = Topology.from_spec("dgx-b200")
TWO_BOXES = Topology.from_spec("dgx-h100:nodes=2")
RACK16 = sub_topology(Topology.from_spec("gb200-nvl72"), list(range(16)))
GB = 2 ** 30 / 1e6  # bytes per µs of NCCL's "GB/s"
SYMM, LL128 = ONE_SIDED["symm_mem"], ONE_SIDED["mnnvl_ll128"]
HOPPER, BLACKWELL = 3.7 / 7.8, 3.0 / 11.0  # graph-replay fractions of NCCL's eager figures
EXCHANGE, BARRIER = HOPPER * 4.5, HOPPER * (7.8 - 4.5) / 2  # Hopper, µs
ROUND_TRIP = 2 * 0.6  # µs: a load over NVLink, twice NCCL's NVLink LL hop latency


def _loads(threads, in_flight):
    """Bytes per µs one block loads: its threads' outstanding 16-byte loads per round trip."""
    return threads * in_flight * 16 / ROUND_TRIP


def _shape(topology, n):
    return GroupShape.of(topology, range(n))


def test_torch_one_shot_and_two_shot_priced_from_their_sources():
    shape = _shape(ONE_BOX, 2)  # two ranks: no multimem (it needs more than two)
    # one-shot of 64 KiB: one block of 512 threads x 16 B = 8 KiB per block, so 8 blocks
    # (of the 24 allowed); it loads the peer's whole buffer, each thread one 16-byte load
    # from its one peer in flight per round trip (below NCCL's 65 GB/s per block; 8 blocks
    # below the 320 GB/s ceiling); two barriers
    nbytes = 65536
    one_shot = EXCHANGE + 2 * BARRIER + nbytes / (8 * _loads(512, 1))
    # two-shot: a 32 KiB shard, 2 blocks of 1024 threads; loads (n-1)/n of it the same way,
    # stores (n-1)/n of it at NCCL's 65 GB/s per block
    two_shot = (EXCHANGE + 2 * BARRIER + nbytes / 2 / (2 * _loads(1024, 1))
                + nbytes / 2 / (2 * 65 * GB))
    kernels = {c.algorithm: c.time_s * 1e6 for c in torch_symm.symm_mem_kernels(
        "all_reduce", nbytes, shape)}
    assert kernels["symm_mem_one_shot"] == pytest.approx(one_shot)
    assert kernels["symm_mem_two_shot"] == pytest.approx(two_shot)
    # vLLM runs two-shot on 2 ranks (multimem only for 4, 6 and 8 on Hopper), even where
    # one-shot would be cheaper
    got = SYMM.cost("all_reduce", nbytes, shape, "sum")
    assert got.algorithm == "symm_mem_two_shot"
    assert got.time_s * 1e6 == pytest.approx(two_shot)


def test_a_one_shot_all_reduce_of_4_kib_on_8_h100s_by_hand():
    # 4 KiB fits one block (512 threads x 16 B = 8 KiB): 7 peers' buffers, each thread
    # with one load per peer in flight per round trip (below NCCL's 65 GB/s per block),
    # after SGLang PR #2904's 3.7 µs
    nbytes = 4096
    assert _loads(512, 7) < 65 * GB
    want = 3.7 + 7 * nbytes / _loads(512, 7)
    kernels = {c.algorithm: c for c in torch_symm.symm_mem_kernels(
        "all_reduce", nbytes, _shape(ONE_BOX, 8))}
    assert kernels["symm_mem_one_shot"].time_s * 1e6 == pytest.approx(want)
    assert kernels["symm_mem_one_shot"].latency_s * 1e6 == pytest.approx(3.7)


def test_blackwell_fixed_costs_are_the_published_graph_replay_fraction():
    row = GRAPH_REPLAY["blackwell"]
    # nccl-tests #333: 8 B200s, symmetric buffers, CUDA graphs, "just over 3 microseconds"
    assert row.published_us == 3.0 and "nccl-tests issue #333" in row.source
    assert row.nccl_eager_us == 11.0  # NCCL's LL all-reduce base on Blackwell (eager)
    b200 = _shape(Topology.from_spec("dgx-b200"), 8)
    assert exchange_us(b200) == pytest.approx(BLACKWELL * 8.5)
    # a one-shot (an exchange and two barriers) below 4 µs, where NCCL's eager figures give 13
    assert exchange_us(b200) + 2 * barrier_us(b200) == pytest.approx(BLACKWELL * 13.0)
    assert "sglang PR #2904" in GRAPH_REPLAY["hopper"].source
    assert exchange_us(_shape(ONE_BOX, 8)) + 2 * barrier_us(_shape(ONE_BOX, 8)) == \
        pytest.approx(3.7)


def test_torch_multimem_all_reduce_on_nvswitch():
    shape = _shape(ONE_BOX, 8)
    nbytes = 8 << 20  # 8 MiB: bandwidth-bound, where multimem wins
    # S loaded through the switch by 8 blocks of 1024 threads, one ld_reduce each in
    # flight, times n = 8 streams reduced; S/n multicast; both at the 480 GB/s ceiling
    assert 8 * _loads(1024, 1) * 8 > 480 * GB
    want = 3.7 + (nbytes + nbytes / 8) / (480 * GB)
    got = SYMM.cost("all_reduce", nbytes, shape, "sum")
    assert got.algorithm == "symm_mem_multimem"
    assert got.time_s * 1e6 == pytest.approx(want)


def test_direct_all_to_all_pays_one_signal():
    shape = _shape(ONE_BOX, 8)
    nbytes = 8192  # a rank's send buffer; 1 KiB to each peer, one block
    want = EXCHANGE + BARRIER + 7 * 1024 / (44 * GB)
    assert SYMM.cost("all_to_all", nbytes, shape, "sum").time_s * 1e6 == pytest.approx(want)


def test_ll128_all_to_all_on_a_gb200_rack():
    shape = _shape(RACK16, 16)
    nbytes = 1 << 20
    # Blackwell's LL all-gather base 8.5 µs at its graph-replay fraction; 15/16 of the
    # 600 GB/s load/store ceiling
    want = BLACKWELL * 8.5 + 15 / 16 * nbytes / (600 * GB * 120 / 128)
    got = LL128.cost("all_to_all", nbytes, shape, "sum")
    assert got.time_s * 1e6 == pytest.approx(want)
    assert got.protocol == "LL128"


@pytest.mark.parametrize("transport,op,topology,match", [
    ("symm_mem", "all_reduce", TWO_BOXES, "one NVLink domain"),
    ("mnnvl_ll128", "all_to_all", ONE_BOX, "multi-node NVLink fabric"),
    ("mnnvl_ll128", "all_reduce", RACK16, "all-to-all"),
    ("nccl-symm", "all_to_all", ONE_BOX, "no symmetric kernel"),
])
def test_what_a_transport_cannot_run_is_named(transport, op, topology, match):
    reason = ONE_SIDED[transport].unavailable(op, _shape(topology, topology.num_gpus), "sum")
    assert reason is not None and match in reason


def test_sums_only_a_max_falls_back_to_nccl():
    cm = CostModel(ONE_BOX, DecodeWorkload("llama-3.1-8b", 32768), transport="symm_mem")
    group, n = tuple(range(8)), 16384
    assert not cm.one_sided(CollectiveOp.ALL_REDUCE_MAX, group)
    assert cm.one_sided(CollectiveOp.ALL_REDUCE_SUM, group)
    want = collective_cost("all_reduce", n, _shape(ONE_BOX, 8)).time_s
    assert cm.collective_time(CollectiveOp.ALL_REDUCE_MAX, group, n) == pytest.approx(want)


@settings(max_examples=60, deadline=None)
@given(op=st.sampled_from(["all_reduce", "all_gather", "reduce_scatter", "all_to_all"]),
       ranks=st.integers(2, 8), small=st.integers(1, 1 << 22), extra=st.integers(0, 1 << 22),
       blackwell=st.booleans())
# a fresh clone's run: 6 ranks, 75,014 B cost 9.12 us and 98,305 B 8.67 us when the second
# block halved each block's share
@example(op="reduce_scatter", ranks=6, small=75_014, extra=98_305 - 75_014, blackwell=False)
def test_symm_mem_costs_grow_with_size_and_never_beat_their_fixed_cost(op, ranks, small,
                                                                      extra, blackwell):
    shape = _shape(B200_BOX if blackwell else ONE_BOX, ranks)
    a = SYMM.cost(op, small, shape, "sum")
    b = SYMM.cost(op, small + extra, shape, "sum")
    if blackwell:  # NCCL's Blackwell LL all-gather base 8.5 µs, plain 13, at 3.0 / 11
        exchange, barrier, ceilings = BLACKWELL * 8.5, BLACKWELL * 2.25, (1000, 600)
    else:
        exchange, barrier, ceilings = EXCHANGE, BARRIER, (480, 320)
    floor = exchange + (1 if op == "all_to_all" else 2) * barrier
    assert a.time_s * 1e6 >= floor - 1e-9
    assert b.time_s >= a.time_s * (1 - 1e-12)  # a price never falls as the op grows
    # and never faster than the data it must move out of or into one GPU at the ceiling
    moved = (ranks - 1) / ranks * small if op != "all_reduce" else small / ranks
    ceiling = ceilings[0] if op == "all_reduce" else ceilings[1]
    assert a.time_s * 1e6 >= floor + moved / (ceiling * GB) * (1 - 1e-9)


def test_messages_on_symm_mem_are_stores_with_a_signal():
    cm = CostModel(ONE_BOX, DecodeWorkload("llama-3.1-8b", 32768), transport="symm_mem")
    regular = CostModel(ONE_BOX, DecodeWorkload("llama-3.1-8b", 32768))
    assert cm.p2p.send_s(4096) == pytest.approx(0.5e-6 * (EXCHANGE + BARRIER))
    assert cm.p2p.summary(0, 1, 4096) == pytest.approx(regular.p2p.summary(0, 1, 4096))
    across = CostModel(TWO_BOXES, DecodeWorkload("llama-3.1-8b", 32768), transport="symm_mem")
    assert across.p2p.one_sided is None  # across InfiniBand: NCCL's send/recv


def test_the_planner_prices_every_offered_transport_and_only_those():
    w = DecodeWorkload("llama-3.1-8b", 32768)
    box = {c.transport for c in plan_workload(ONE_BOX, w).candidates}
    assert box == {"nccl", "nccl-symm", "symm_mem"}
    rack = {c.transport for c in plan_workload(RACK16, w).candidates}
    assert "mnnvl_ll128" in rack and "symm_mem" in rack
    only = plan_workload(RACK16, DecodeWorkload("llama-3.1-8b", 32768), transports=("mnnvl_ll128",))
    assert {c.transport for c in only.candidates} == {"mnnvl_ll128"}
    with pytest.raises(SimError, match="multi-node NVLink fabric"):
        plan_workload(ONE_BOX, DecodeWorkload("llama-3.1-8b", 32768), transports=("mnnvl_ll128",))
    assert set(TRANSPORTS) == {"nccl", *ONE_SIDED}


def test_unoffered_reason_names_why_not():
    assert unoffered_reason("symm_mem", _shape(ONE_BOX, 8)) is None
    assert "one NVLink domain" in unoffered_reason("symm_mem", _shape(TWO_BOXES, 16))
    assert unoffered_reason("nccl", _shape(TWO_BOXES, 16)) is None
    two_racks = Topology.from_spec("gb200-nvl72:racks=2")
    reason = unoffered_reason("mnnvl_ll128", _shape(two_racks, 144))
    assert "one NVLink domain" in reason and "spans 2 hosts" in reason


def test_engines_emit_the_switch_of_the_transport_they_run_on():
    vllm = emit("vllm", ONE_BOX, DecodeWorkload("deepseek-v3", 32768, tp=2))
    a2a = next(r for r in vllm["backends"] if r["backend"] == "a2a")
    # on one box vLLM's direct a2a stores beat NCCL's grouped sends (6.2 against ~15 µs)
    assert a2a["transport"] == "symm_mem" and a2a["env"] == ["VLLM_USE_DIRECT_DCP_A2A=1"]
    assert vllm["best"]["backend"] == "a2a" and vllm["env"] == ["VLLM_USE_DIRECT_DCP_A2A=1"]
    nccl = emit("vllm", ONE_BOX, DecodeWorkload("deepseek-v3", 32768, tp=2),
                transports=("nccl",))
    assert nccl["env"] == [] and {r["transport"] for r in nccl["backends"]} == {"nccl"}
    sglang = emit("sglang", ONE_BOX, DecodeWorkload("deepseek-v3", 32768, tp=2))
    assert {r["backend"] for r in sglang["backends"]} == {"ag_rs", "a2a"}
    assert any("fi_a2a" in why and "fabric" in why for why in sglang["not_offered"])
    rack = emit("sglang", RACK16, DecodeWorkload("deepseek-v3", 32768, tp=4))
    fi = next(r for r in rack["backends"] if r["backend"] == "fi_a2a")
    assert fi["transport"] == "mnnvl_ll128" and fi["algorithm"] == "helix"
    assert "not priced" not in "\n".join(describe(rack))


def test_the_token_runs_its_tp_all_reduce_on_the_transports_allowed():
    split = Split(tp=8)
    nccl = predict_token(ONE_BOX, "llama-3.1-70b", 8192, split, transports=("nccl",))
    symm = predict_token(ONE_BOX, "llama-3.1-70b", 8192, split, transports=("symm_mem",))
    fastest = predict_token(ONE_BOX, "llama-3.1-70b", 8192, split)
    assert nccl.to_json()["tp_all_reduce_transport"] == "nccl"
    assert symm.to_json()["tp_all_reduce_transport"] == "symm_mem"
    calls = 2 * 80 + 1  # two per layer and the embedding's
    hidden = 8192 * 2  # batch 1 x dim 8192 x bf16
    one = collective_cost("all_reduce", hidden, _shape(ONE_BOX, 8)).time_s
    assert nccl.parts_s["tp_all_reduce"] == pytest.approx(calls * one)
    # multimem by hand: one block (a 2 KiB shard) of 1024 threads, one ld_reduce each in
    # flight per round trip, times 8 streams, for S; S/8 multicast at min(65 x 8, 480) GB/s
    multimem = 3.7 + hidden / (8 * _loads(1024, 1)) + hidden / 8 / (480 * GB)
    assert symm.parts_s["tp_all_reduce"] == pytest.approx(calls * multimem * 1e-6)
    assert fastest.parts_s["tp_all_reduce"] <= min(symm.parts_s["tp_all_reduce"],
                                                   nccl.parts_s["tp_all_reduce"]) + 1e-12


@pytest.mark.parametrize("argv,match", [
    (["comm", "--topology", "dgx-h100:nodes=2", "--op", "all_reduce", "--transport",
      "symm_mem"], "one NVLink domain"),
    (["comm", "--topology", "dgx-h100", "--op", "all_to_all", "--transport", "mnnvl_ll128"],
     "fabric"),
    (["predict", "--topology", "dgx-h100:nodes=2", "--model", "llama-3.1-8b", "--seq-len",
      "32k", "--transport", "symm_mem"], "--transport symm_mem on dgx-h100:nodes=2"),
    (["plan", "--topology", "dgx-h100", "--model", "llama-3.1-8b", "--seq-len", "32k",
      "--transport", "mnnvl_ll128"], "fabric"),
    (["predict", "--prefill", "--topology", "dgx-h100", "--model", "llama-3.1-8b",
      "--seq-len", "8k", "--transport", "symm_mem"], "--transport restricts the decode"),
])
def test_a_transport_the_cluster_cannot_offer_is_one_error_line(argv, match, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and match in err[0]


def test_a_calibrated_cluster_says_why_it_has_no_one_sided_transport(tmp_path, capsys):
    profile = tmp_path / "nccl.json"
    fixture = Path(__file__).parent / "fixtures" / "nccl-tests" / (
        "h100-2node-all-reduce-perf-8B-16G-issue309.txt")
    assert main(["calibrate", "--nccl-tests", str(fixture), "--topology", "dgx-h100:nodes=2",
                 "-o", str(profile)]) == 0
    capsys.readouterr()
    assert main(["plan", "--topology", "dgx-h100:nodes=2", "--model", "llama-3.1-8b",
                 "--seq-len", "32k", "--profile", str(profile), "--transport", "nccl"]) == 0
    capsys.readouterr()
    one = Topology.from_spec("dgx-h100")
    backend = plan_overrides(str(profile), Topology.from_spec("dgx-h100:nodes=2"))["backend"]
    with pytest.raises(SimError, match="calibration prices NCCL's regular algorithms only"):
        plan_workload(one, DecodeWorkload("llama-3.1-8b", 32768), backend=backend,
                      transports=("symm_mem",))


def test_a_transport_serves_the_gpus_it_would_run_on(capsys):
    """Two nodes offer symm_mem inside each: a TP group of one node's GPUs can use it."""
    import json

    assert main(["predict", "--token", "--topology", "dgx-h100:nodes=2", "--model",
                 "llama-3.1-70b", "--seq-len", "8k", "--tp", "8", "--transport", "symm_mem",
                 "--transport", "nccl", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)["rows"][0]
    assert row["tp_all_reduce_transport"] == "symm_mem"
    assert main(["plan", "--topology", "dgx-h100:nodes=2", "--model", "llama-3.1-70b",
                 "--seq-len", "8k", "--gpus", "8", "--transport", "symm_mem", "--transport",
                 "nccl", "--json"]) == 0
    best = json.loads(capsys.readouterr().out)["best"]
    assert best["tp_all_reduce_transport"] == "symm_mem"
    # on one-node transports alone, the splits that merge across nodes are refused, each
    # with its reason, and the search goes on
    assert main(["plan", "--topology", "dgx-h100:nodes=2", "--model", "llama-3.1-70b",
                 "--seq-len", "8k", "--gpus", "16", "--transport", "symm_mem", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert any("symm_mem" in (r.get("refused") or "") for r in rows)


def test_transports_of_cpu_ranks():
    """NCCL's regular path needs no check; a one-sided transport on CPU ranks is refused
    with the reason, not a traceback."""
    from argparse import Namespace

    from treeattn.commands.token import transports_of

    cpu = Topology.from_spec("local:ranks=4")
    assert transports_of(Namespace(transport=["nccl"], topology="local:ranks=4"),
                         cpu) == ("nccl",)
    with pytest.raises(SimError, match="--transport symm_mem on local:ranks=4: no NCCL"):
        transports_of(Namespace(transport=["symm_mem"], topology="local:ranks=4"), cpu)


def test_comm_prices_a_chosen_transport(capsys):
    import json

    assert main(["comm", "--topology", "dgx-h100", "--op", "all_reduce", "--transport",
                 "symm_mem", "--min-bytes", "1K", "--max-bytes", "8K", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [r["bytes"] for r in rows] == [1024, 2048, 4096, 8192]
    assert all(r["transport"] == "symm_mem" and r["algorithm"].startswith("symm_mem_")
               for r in rows)
    assert all(r["time_us"] >= 3.7 - 1e-9 for r in rows)
    assert math.isclose(rows[0]["time_us"], 3.7, abs_tol=0.05)
