"""Predictions for the standard configurations must match the reviewed golden file.

If this fails after an intended model change, regenerate with
``.venv/bin/python tests/golden/update.py --update`` and review the diff.
"""

from __future__ import annotations

import json

import pytest
from golden.update import GOLDEN, predictions

from treeattn.schedule.algorithms import ALGORITHM_NAMES


def test_predictions_match_golden_file():
    want = json.loads(GOLDEN.read_text())
    got = predictions()
    key = ("topology", "model", "seq_len", "algorithm")
    want_by = {tuple(r[k] for k in key): r for r in want}
    got_by = {tuple(r[k] for k in key): r for r in got}
    assert sorted(got_by) == sorted(want_by), "configurations changed: regenerate the golden file"
    moved = [(k, want_by[k].get("latency_s"), got_by[k].get("latency_s")) for k in want_by
             if got_by[k].get("refused") != want_by[k].get("refused")
             or ("refused" not in want_by[k]
                 and (got_by[k]["latency_s"] != pytest.approx(want_by[k]["latency_s"], rel=1e-9)
                      or got_by[k]["plan"] != want_by[k]["plan"]))]
    assert not moved, f"{len(moved)} predictions moved, first: {moved[0]}"
    assert len(want) == 6 * 2 * len(ALGORITHM_NAMES)
