"""The simulator and planner: schedules, a simpy engine, closed forms and the planner.

>>> from treeattn.topo import Topology
>>> from treeattn.sim import ALGORITHM_NAMES, DecodeWorkload, plan
>>> p = plan(Topology.from_spec("mi300x"), DecodeWorkload("llama-3.1-8b", 32768))
>>> p.algorithm in ALGORITHM_NAMES
True
"""

from treeattn.sim.algorithms import ALGORITHM_NAMES, build_schedule
from treeattn.sim.devices import BackendModel, HardwareModel
from treeattn.sim.engine import simulate
from treeattn.sim.payloads import ScheduleError, SimError
from treeattn.sim.planning.planner import Plan, plan
from treeattn.sim.result import SimResult
from treeattn.sim.schedule import Compute, Merge, Recv, Schedule, Send
from treeattn.sim.workload import DecodeWorkload, ModelConfig

__all__ = [
    "ALGORITHM_NAMES", "BackendModel", "Compute", "DecodeWorkload", "HardwareModel", "Merge",
    "ModelConfig", "Plan", "Recv", "Schedule", "ScheduleError", "Send", "SimError",
    "SimResult", "build_schedule", "plan", "simulate",
]
