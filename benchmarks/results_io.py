"""Where every benchmark puts its numbers: ``benchmarks/results/NAME.json`` and ``NAME.md``.

Both are written atomically (:mod:`treeattn.atomic`), so an interrupted benchmark leaves the
previous results whole, and the JSON is strict (no NaN or Infinity).
"""

from __future__ import annotations

import json
from pathlib import Path

from treeattn import atomic

RESULTS = Path(__file__).resolve().parent / "results"


def write_results(name: str, payload: dict, markdown: str) -> Path:
    """Write ``NAME.json`` (``payload``) and ``NAME.md`` (``markdown``); return the folder."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    atomic.write_text(RESULTS / f"{name}.json",
                      json.dumps(payload, indent=2, default=str, allow_nan=False) + "\n")
    atomic.write_text(RESULTS / f"{name}.md", markdown)
    return RESULTS
