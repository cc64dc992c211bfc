"""Sweeps: run the simulator (and optionally the runtime) over a grid, and plot the results.

This is an application layer on top of ``sim`` and ``runtime``; nothing in those packages
imports it.
"""

from treeattn.sweep.grid import SweepPoint, expand_grid, predict_point, run_sweep

__all__ = ["SweepPoint", "expand_grid", "predict_point", "run_sweep"]
