"""Plan files, traces and format tags: what leaves the tool for other tools to read."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from treeattn.cli import main
from treeattn.schedule.algorithms import ALGORITHM_NAMES
from treeattn.sim import DecodeWorkload, SimError, build_schedule
from treeattn.sim.files.export import check_tag, schedule_from_json, schedule_to_json, trace_json
from treeattn.topo import Topology


@settings(max_examples=30, deadline=None)
@given(algorithm=st.sampled_from(ALGORITHM_NAMES), p=st.integers(2, 9),
       layout=st.sampled_from(["replicated", "head_sharded"]))
def test_every_schedule_survives_a_json_round_trip(algorithm, p, layout):
    w = DecodeWorkload("debug", 64, layout=layout)
    schedule = build_schedule(algorithm, Topology.from_spec(f"local:ranks={p}"), w)
    back = schedule_from_json(json.loads(json.dumps(schedule_to_json(schedule))))
    assert back.steps == schedule.steps and back.output_layout == schedule.output_layout


def test_a_damaged_or_foreign_plan_is_refused():
    s = schedule_to_json(build_schedule("butterfly", Topology.from_spec("local:ranks=3"),
                                        DecodeWorkload("debug", 64)))
    with pytest.raises(SimError, match="not a treeattn schedule"):
        schedule_from_json({"format": "other"})
    with pytest.raises(SimError, match="version"):
        schedule_from_json(dict(s, version=99))
    broken = dict(s, steps=s["steps"][:2])  # a rank missing: world mismatch
    with pytest.raises(SimError, match="malformed"):
        schedule_from_json(broken)
    s["steps"][1] = [step for step in s["steps"][1] if step[0] != "recv"]
    with pytest.raises(SimError):  # validation: a send is never received
        schedule_from_json(s)


def test_trace_has_one_track_per_rank_and_microsecond_events():
    trace = trace_json([("predicted: x", [(0, 0, "attention", 0.0, 2e-6),
                                          (1, 0, "attention", 0.0, 3e-6)])])
    check_tag(trace, "trace", "t")
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["tid"] for e in spans} == {0, 1} and {e["dur"] for e in spans} == {2.0, 3.0}


def test_plan_writes_a_plan_file_and_a_trace(tmp_path, capsys):
    plan_path, trace_path = tmp_path / "plan.json", tmp_path / "trace.json"
    code = main(["plan", "--topology", "dgx-h100:nodes=2", "--model", "llama-3.1-8b",
                 "--seq-len", "64k", "-o", str(plan_path), "--trace", str(trace_path)])
    assert code == 0
    record = check_tag(json.loads(plan_path.read_text()), "plan", "plan")
    schedule = schedule_from_json(record["schedule"])
    assert schedule.world == 16 and record["algorithm"] == schedule.algorithm
    assert sum(record["shard_lengths"]) == 65536
    trace = json.loads(trace_path.read_text())
    ranks = {e["tid"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert ranks == set(range(16))
    capsys.readouterr()


def test_predict_json_is_tagged(capsys):
    assert main(["predict", "--topology", "mi300x", "--model", "debug", "--seq-len", "64",
                 "--json"]) == 0
    data = check_tag(json.loads(capsys.readouterr().out), "predictions", "stdout")
    assert data["rows"]


@pytest.mark.timeout(300)
def test_run_executes_a_plan_file_and_traces_it(tmp_path, capsys):
    """plan -o writes the schedule; run --plan executes exactly it on real ranks; --trace
    puts predicted and measured steps side by side with the same names."""
    plan_path, trace_path = tmp_path / "plan.json", tmp_path / "trace.json"
    assert main(["plan", "--topology", "local:ranks=2", "--model", "debug", "--seq-len", "96",
                 "-o", str(plan_path)]) == 0
    planned = json.loads(plan_path.read_text())["schedule"]
    capsys.readouterr()
    assert main(["run", "--nproc", "2", "--plan", str(plan_path), "--steps", "2", "--warmup",
                 "0", "--min-time", "0", "--check", "--max-error", "1e9", "--json",
                 "--trace", str(trace_path)]) == 0
    (point,) = check_tag(json.loads(capsys.readouterr().out), "run", "stdout")["rows"]
    assert point["requested"] == "plan" and point["algorithm"] == planned["algorithm"]
    assert point["seq_len"] == 96 and point["max_abs_diff"] < 1e-5
    trace = check_tag(json.loads(trace_path.read_text()), "trace", "trace")
    names = {e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name"}
    assert any(n.startswith("predicted:") for n in names)
    assert any(n.startswith("measured:") for n in names)


def test_run_refuses_a_plan_for_another_world(tmp_path, capsys):
    plan_path = tmp_path / "plan.json"
    assert main(["plan", "--topology", "local:ranks=3", "--model", "debug", "--seq-len", "96",
                 "-o", str(plan_path)]) == 0
    capsys.readouterr()
    assert main(["run", "--nproc", "2", "--plan", str(plan_path)]) == 2
    assert "plan is for 3 ranks" in capsys.readouterr().err
    plan_path.write_text('{"format": "treeattn.plan", "version": 7}')
    assert main(["run", "--nproc", "2", "--plan", str(plan_path)]) == 2
    assert "version" in capsys.readouterr().err


@pytest.mark.timeout(300)
def test_generate_runs_a_plan_file(tmp_path, capsys):
    plan_path = tmp_path / "plan.json"
    assert main(["plan", "--topology", "local:ranks=2", "--model", "debug", "--seq-len", "64",
                 "-o", str(plan_path)]) == 0
    capsys.readouterr()
    assert main(["generate", "--nproc", "2", "--model", "debug", "--prompt", "abc",
                 "--max-new-tokens", "3", "--plan", str(plan_path), "--verify", "--json"]) == 0
    record = check_tag(json.loads(capsys.readouterr().out), "generation", "stdout")
    assert record["identical_to_single_process"] is True
    assert record["algorithm"].startswith(json.loads(plan_path.read_text())["algorithm"])
