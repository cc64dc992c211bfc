"""Calibration profiles someone sent: one validating reader, a stated schema, and a profile
of another kind of machine refused (corpus: ``tests/fixtures/hostile/profiles``)."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from treeattn.cli import main
from treeattn.sim import SimError
from treeattn.sim.files.profiles import load_profile, plan_overrides
from treeattn.topo import Topology

pytestmark = pytest.mark.timeout(120)
CORPUS = Path(__file__).parent / "fixtures" / "hostile" / "profiles"
EXPECTED = json.loads((CORPUS / "expected.json").read_text())


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_hostile_profile_corpus(name, capsys):
    expect, topology = EXPECTED[name]
    path = CORPUS / f"{name}.json"
    if expect is None:
        plan_overrides(str(path), Topology.from_spec(topology))
        return
    with pytest.raises(SimError) as info:
        plan_overrides(str(path), Topology.from_spec(topology))
    assert expect in str(info.value) and str(path) in str(info.value), str(info.value)
    code = main(["predict", "--topology", topology, "--model", "debug", "--seq-len", "64",
                 "--profile", str(path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error:"), err
    assert expect in err[0], err


def test_a_fifo_or_dev_zero_as_profile_is_refused_not_waited_on(tmp_path):
    fifo = tmp_path / "profile.json"
    os.mkfifo(fifo)
    done = []
    worker = threading.Thread(target=lambda: done.append(_refusal(fifo)), daemon=True)
    worker.start()
    worker.join(30)
    assert done and "expected a regular file" in done[0]
    assert "expected a regular file" in _refusal(Path("/dev/zero"))
    big = tmp_path / "big.json"
    with open(big, "wb") as f:
        f.truncate(64 << 20)  # sparse: bigger than any profile, nothing read
    assert "expected at most" in _refusal(big)


def _refusal(path: Path) -> str:
    try:
        load_profile(path)
    except SimError as exc:
        return str(exc)
    return "accepted"


def test_numbers_are_numbers_and_the_message_names_the_field():
    good = json.loads((CORPUS / "ok-cpu.json").read_text())
    for value in ("12", True, None, [1], float("inf")):
        bad = json.loads(json.dumps(good))
        bad["attention"]["launch_s"] = value
        with pytest.raises(SimError, match=r"field attention\.launch_s: expected a number"):
            load_profile(bad)
    assert load_profile(good) is good
