"""The simulator and planner: a simpy engine that prices the IR's schedules, closed forms and
the planner. The IR itself lives in :mod:`treeattn.schedule`; its names are re-exported here.

>>> from treeattn.topo import Topology
>>> from treeattn.sim import ALGORITHM_NAMES, DecodeWorkload, plan_workload
>>> p = plan_workload(Topology.from_spec("mi300x"), DecodeWorkload("llama-3.1-8b", 32768))
>>> p.algorithm in ALGORITHM_NAMES
True
"""

from treeattn.schedule.algorithms import ALGORITHM_NAMES, build_schedule
from treeattn.schedule.ir import Compute, Merge, Recv, Schedule, Send
from treeattn.schedule.payloads import ScheduleError, SimError
from treeattn.schedule.workload import DecodeWorkload, ModelConfig
from treeattn.sim.devices import BackendModel, HardwareModel
from treeattn.sim.engine import simulate
from treeattn.sim.planning.planner import Plan, plan_workload
from treeattn.sim.result import SimResult
from treeattn.sim.tree_search import searched_tree  # registers the ``searched`` shape

__all__ = [
    "ALGORITHM_NAMES", "BackendModel", "Compute", "DecodeWorkload", "HardwareModel", "Merge",
    "ModelConfig", "Plan", "Recv", "Schedule", "ScheduleError", "Send", "SimError",
    "SimResult", "build_schedule", "plan_workload", "searched_tree", "simulate",
]
