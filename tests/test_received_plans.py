"""Plan files someone sent: checked in full (fields, sizes, deadlock, memory) before any rank.

The corpus in ``tests/fixtures/hostile/plans`` (made by ``make_plans.py`` there) holds crafted
plans that once ran, crashed or priced nonsense; ``expected.json`` names what each refusal
must say. Generated plans of every algorithm must all still be accepted.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from treeattn.cli import main
from treeattn.errors import UserError
from treeattn.schedule.algorithms import ALGORITHM_NAMES
from treeattn.sim import DecodeWorkload, SimError, build_schedule
from treeattn.sim.files.export import schedule_to_json, tagged
from treeattn.sim.files.plan_file import plan_from_json, read_plan
from treeattn.topo import Topology

CORPUS = Path(__file__).parent / "fixtures" / "hostile" / "plans"
EXPECTED = json.loads((CORPUS / "expected.json").read_text())


def _record(schedule, workload, world: int) -> dict:
    return tagged("plan", {"algorithm": schedule.algorithm, "layout": workload.layout,
                           "batch": workload.batch, "model": workload.model.name,
                           "seq_len": workload.seq_len, "shard_lengths": workload.shards(world),
                           "schedule": schedule_to_json(schedule)})


@settings(max_examples=40, deadline=None)
@given(algorithm=st.sampled_from(ALGORITHM_NAMES), p=st.integers(2, 9), batch=st.integers(1, 5),
       model=st.sampled_from(["debug", "smollm2-135m", "llama-3.1-8b"]),
       layout=st.sampled_from(["replicated", "head_sharded"]), seq=st.integers(9, 300))
def test_every_generated_plan_is_accepted(algorithm, p, batch, model, layout, seq):
    w = DecodeWorkload(model, seq, batch=batch, layout=layout)
    try:
        schedule = build_schedule(algorithm, Topology.from_spec(f"local:ranks={p}"), w)
    except SimError:
        return  # a generator that does not apply here (say, a head count p does not divide)
    checked = plan_from_json(json.loads(json.dumps(_record(schedule, w, p))), "plan")
    assert checked.schedule.steps == schedule.steps
    assert checked.shard_lengths == tuple(w.shards(p))


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_hostile_plan_corpus(name, capsys):
    path = CORPUS / f"{name}.json"
    expect = EXPECTED[name]
    if expect is None or expect == "needs about":
        read_plan(path)  # well-formed: accepted as data
    else:
        with pytest.raises((UserError, SimError)) as info:
            read_plan(path)
        assert expect in str(info.value) and str(path) in str(info.value), str(info.value)
    if expect is None:
        return
    code = main(["run", "--nproc", "2", "--plan", str(path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err
    assert len(err) == 1 and err[0].startswith("error:") and expect in err[0], err


def test_deadlock_names_the_ranks_and_steps():
    with pytest.raises(SimError, match=r"deadlock: rank \d step \d waits forever"):
        read_plan(CORPUS / "deadlock.json")


def test_generate_refuses_a_plan_for_another_model_shape(tmp_path, capsys):
    from treeattn.commands.generate import planned_schedule
    from treeattn.schedule.workload import ModelConfig

    w = DecodeWorkload("smollm2-135m", 64)
    schedule = build_schedule("tree", Topology.from_spec("local:ranks=2"), w)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(_record(schedule, w, 2)))
    debug = ModelConfig.debug()
    with pytest.raises(UserError, match="field model: expected a model of this run's shape"):
        planned_schedule(str(path), 2, debug)
    assert planned_schedule(str(path), 2).world == 2
