"""How the fidelity reports score a prediction against a published figure."""

from __future__ import annotations

import math


def geo_error(ratios: list[float]) -> float | None:
    """Geometric mean of max(r, 1/r), minus one: 0.2 means "off by 20% on average"."""
    if not ratios:
        return None
    return math.exp(sum(abs(math.log(r)) for r in ratios) / len(ratios)) - 1


def pct(x: float | None) -> str:
    """A score as a whole percentage, or "-" where nothing was scored."""
    return "-" if x is None else f"{100 * x:.0f}%"
