"""The distributed runtime: run a plan's schedule for real and measure it.

- :mod:`treeattn.runtime.group`: process groups from the torchrun environment, waits with
  timeouts that name the peer.
- :mod:`treeattn.runtime.launch`: a local launcher that spawns ``N`` ranks, watches them and
  stops the whole group when one fails.
- :mod:`treeattn.runtime.cache`: the KV cache split along the sequence across ranks.
- :mod:`treeattn.runtime.executor`: executes a :class:`treeattn.sim.schedule.Schedule`.
- :mod:`treeattn.runtime.timing`, :mod:`treeattn.runtime.calibrate`,
  :mod:`treeattn.runtime.check`: measurement, calibration and predicted-vs-measured runs.
"""

from treeattn.runtime.errors import RankLost, RankTimeout, RuntimeFailure

__all__ = ["RankLost", "RankTimeout", "RuntimeFailure"]

try:  # owned by the model engineer; optional until it exists
    from treeattn.runtime.model_errors import ModelError  # noqa: F401

    __all__.append("ModelError")
except ImportError:  # pragma: no cover - only while that module is missing
    pass
