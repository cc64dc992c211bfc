"""Plan files, traces and format tags: what leaves the tool for other tools to read."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from treeattn.cli import main
from treeattn.sim import DecodeWorkload, SimError, build_schedule
from treeattn.sim.algorithms import ALGORITHM_NAMES
from treeattn.sim.export import check_tag, schedule_from_json, schedule_to_json, trace_json
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
