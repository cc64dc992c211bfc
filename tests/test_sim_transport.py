"""The transports collectives and messages run on: the planner prices the baselines and
treeattn's own schedules on NCCL's symmetric-memory kernels where a cluster offers them,
and the strongest baseline is the fastest of all of them.

References are worked by hand from NCCL 2.30.7's constants (``sym_kernels.cc``) through
:func:`treeattn.sim.nccl.symmetric.symmetric_cost`, which ``test_sim_comm_cli`` checks
against NCCL's formula, and :func:`treeattn.sim.nccl.collectives.collective_cost`.
"""

from __future__ import annotations

import json

import pytest

from treeattn.cli import main
from treeattn.schedule.algorithms import BASELINES
from treeattn.schedule.payloads import CollectiveOp, SimError
from treeattn.sim import DecodeWorkload, plan_workload
from treeattn.sim.deploy.engines import describe, emit
from treeattn.sim.nccl.collectives import GroupShape, collective_cost
from treeattn.sim.nccl.sendrecv import p2p_parts
from treeattn.sim.nccl.symmetric import symmetric_candidates, symmetric_cost
from treeattn.sim.network import CostModel
from treeattn.topo import Topology

ONE_BOX = Topology.from_spec("dgx-h100")
TWO_BOXES = Topology.from_spec("dgx-h100:nodes=2")


def _costs(topology, transport):
    return CostModel(topology, DecodeWorkload("llama-3.1-8b", 32768), transport=transport)


def test_sums_run_on_symmetric_kernels_and_a_max_falls_back_to_nccl():
    symm, regular = _costs(ONE_BOX, "nccl-symm"), _costs(ONE_BOX, "nccl")
    group, n = tuple(range(8)), 16384
    shape = GroupShape.of(ONE_BOX, group)
    # NCCL's symmetric kernels with their base latency replayed in a graph (on Hopper 3.7 of
    # NCCL's 7.8 µs plain all-reduce base, sgl-project/sglang PR #2904's one-shot), ranked
    # as NCCL ranks them: time plus 2.5% per block
    replay = 3.7 / 7.8
    for op, name in ((CollectiveOp.ALL_REDUCE_SUM, "all_reduce"),
                     (CollectiveOp.ALL_GATHER, "all_gather")):
        ranked = []
        for c in symmetric_candidates(name, n, shape):
            replayed = c.time_s - (1 - replay) * c.latency_s
            ranked.append((replayed * c.choice_s / c.time_s, replayed))
        assert symm.collective_time(op, group, n) == pytest.approx(min(ranked)[1])
        assert symm.collective_time(op, group, n) < symmetric_cost(name, n, shape).time_s
    # NCCL's symmetric all-reduce is a sum only: the max takes the regular path
    want = collective_cost("all_reduce", n, shape).time_s
    assert symm.collective_time(CollectiveOp.ALL_REDUCE_MAX, group, n) == pytest.approx(want)
    assert regular.collective_time(CollectiveOp.ALL_REDUCE_SUM, group, n) == pytest.approx(want)
    # and no symmetric all-to-all exists: NCCL's grouped p2p
    assert not symm.one_sided(CollectiveOp.ALL_TO_ALL, group)


def test_a_message_on_symmetric_memory_pays_the_kernel_base_latency_not_the_enqueue():
    symm, regular = _costs(ONE_BOX, "nccl-symm"), _costs(ONE_BOX, "nccl")
    shape = GroupShape.of(ONE_BOX, range(8))
    _, ring_base, _, _ = p2p_parts(4096, shape, False)
    assert regular.p2p.send_s(4096) == pytest.approx(0.5e-6 * ring_base)
    # Hopper's LL base at its graph-replay fraction, halved
    assert symm.p2p.send_s(4096) == pytest.approx(0.5e-6 * 4.5 * 3.7 / 7.8)
    assert symm.p2p.summary(0, 1, 4096) == pytest.approx(regular.p2p.summary(0, 1, 4096))
    with pytest.raises(SimError, match="unknown transport"):
        _costs(ONE_BOX, "carrier-pigeon")


def test_one_box_plans_on_every_offered_transport_and_the_best_baseline_is_the_fastest():
    chosen = plan_workload(ONE_BOX, DecodeWorkload("llama-3.1-8b", 32768))
    by_transport = {c.transport for c in chosen.candidates}
    assert by_transport == {"nccl", "nccl-symm", "symm_mem"}  # no MNNVL fabric in one DGX
    names = {c.name for c in chosen.candidates}
    assert {"oneshot@nccl-symm", "butterfly@nccl-symm", "allgather@nccl-symm"} <= names
    baselines = [c for c in chosen.candidates if c.algorithm in BASELINES]
    assert chosen.best_baseline().latency_s == min(c.latency_s for c in baselines)
    for name in ("oneshot", "dcp"):  # their all-gathers are faster on symmetric kernels
        regular = next(c for c in chosen.candidates if c.name == name)
        symm = next(c for c in chosen.candidates if c.name == f"{name}@nccl-symm")
        assert symm.bound_s < regular.bound_s
    assert chosen.to_json()["transport"] == chosen.winner.transport


def test_across_infiniband_there_is_no_symmetric_variant():
    """Only hier's node step stays inside one NVLink domain; every other plan crosses
    InfiniBand, where no one-sided transport runs."""
    chosen = plan_workload(TWO_BOXES, DecodeWorkload("llama-3.1-8b", 32768))
    assert {c.transport for c in chosen.candidates if c.algorithm != "hier"} == {"nccl"}
    assert {c.transport for c in chosen.candidates if c.algorithm == "hier"} >= {"nccl"}


def test_predict_rows_name_their_transport(capsys):
    assert main(["predict", "--topology", "dgx-h100", "--model", "llama-3.1-8b",
                 "--seq-len", "32k", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert all(r["transport"] in ("nccl", "nccl-symm", "symm_mem") for r in rows)
    pick = next(r for r in rows if r["algorithm"] == "pick")
    assert pick["transport"] != "nccl" and pick["name"].endswith("@" + pick["transport"])
    assert main(["predict", "--topology", "dgx-h100", "--model", "llama-3.1-8b",
                 "--seq-len", "32k", "--wide"]) == 0
    assert "nccl-symm" in capsys.readouterr().out


@pytest.mark.parametrize("engine,switch", [("vllm", "VLLM_USE_NCCL_SYMM_MEM=1"),
                                           ("sglang", "--enable-symm-mem")])
def test_the_engines_switch_for_symmetric_memory_is_emitted_with_a_symmetric_backend(
        engine, switch):
    record = emit(engine, ONE_BOX, DecodeWorkload("deepseek-v3", 32768, tp=2))
    best = record["best"]
    text = "\n".join(describe(record))
    assert (switch in text) == (best["transport"] == "nccl-symm")
    symm = [r for r in record["backends"] if r["transport"] == "nccl-symm"]
    assert symm, "the ag_rs backend's all-gathers run on symmetric kernels on one box"
    record = emit(engine, TWO_BOXES, DecodeWorkload("deepseek-v3", 32768, tp=4))
    assert switch not in "\n".join(describe(record))  # no symmetric kernels across nodes


def test_a_plan_file_holds_what_the_runtime_runs(tmp_path, capsys, monkeypatch):
    """treeattn's runtime sends on regular collectives: the file is the best plan there."""
    monkeypatch.setenv("COLUMNS", "300")  # one line per sentence
    path = tmp_path / "plan.json"
    assert main(["plan", "--topology", "dgx-h100", "--model", "llama-3.1-8b", "--seq-len",
                 "32k", "-o", str(path)]) == 0
    out = capsys.readouterr().out
    record = json.loads(path.read_text())
    assert record["transport"] == "nccl" and "@" not in record["name"]
    assert "holds the best plan treeattn's runtime executes" in out
    want = plan_workload(ONE_BOX, DecodeWorkload("llama-3.1-8b", 32768), transports=("nccl",))
    assert record["name"] == want.name
    assert record["latency_s"] == pytest.approx(want.latency_s)
