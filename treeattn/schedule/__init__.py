"""The schedule IR: what every rank does, in order, for one attention decode step.

This package is the contract the simulator (``treeattn.sim``), the numpy reference
(:mod:`treeattn.schedule.reference`) and the runtime's executor share. It holds the steps
(:mod:`~treeattn.schedule.ir`), the named buffers they move (:mod:`~treeattn.schedule.payloads`),
the decode workload that sizes them (:mod:`~treeattn.schedule.workload`) and the algorithm
generators with their registry (:mod:`~treeattn.schedule.algorithms`). It imports only
``treeattn.topo``: nothing here knows how a step is priced or run.
"""

from treeattn.schedule.algorithms import ALGORITHM_NAMES, build_schedule
from treeattn.schedule.ir import Collective, Compute, Merge, Recv, Schedule, Send
from treeattn.schedule.payloads import ScheduleError, SimError
from treeattn.schedule.workload import DecodeWorkload, ModelConfig

__all__ = [
    "ALGORITHM_NAMES", "Collective", "Compute", "DecodeWorkload", "Merge", "ModelConfig",
    "Recv", "Schedule", "ScheduleError", "Send", "SimError", "build_schedule",
]
