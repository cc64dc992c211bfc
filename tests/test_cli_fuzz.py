"""The CLI fuzz campaign in the suite: generated hostile command lines for ``plan``,
``predict``, ``predict --token``, ``predict --prefill``, ``plan --gpus``, ``comm`` and
``generate`` (``benchmarks/cli_fuzz.py``'s generator, on small clusters), run in-process.

Every case must end in exit 0 with output or exit 2 with exactly one ``error:`` line: never
a traceback, a silent exit 0, or another status. The benchmark runs a larger campaign on
larger clusters. ``TREEATTN_FUZZ_SEED`` picks the seed (default fixed, so a failure
reproduces); the seed is in every failure message.
"""

from __future__ import annotations

import os

import pytest
from benchmark_module import load_benchmark

pytestmark = pytest.mark.timeout(300)
SEED = int(os.environ.get("TREEATTN_FUZZ_SEED", "44"))
PER_SURFACE = 12
SURFACES = 7


def test_hostile_command_lines_end_in_output_or_one_error_line():
    fuzz = load_benchmark("cli_fuzz")
    results = fuzz.campaign(PER_SURFACE, SEED)
    assert len(results) == PER_SURFACE * SURFACES
    counts = fuzz.summary(results)
    assert len(counts) == SURFACES
    bad = [(r["surface"], r["outcome"], r["exception"], r["argv"], r["stderr"])
           for r in results if r["outcome"] not in fuzz.GOOD]
    assert not bad, f"seed {SEED}: {bad[:5]}"
    # the campaign reaches both ends of the contract on the planner surfaces
    for surface in ("plan", "predict", "plan --gpus"):
        assert counts[surface]["refused"] > 0, (SEED, surface, counts[surface])
