"""The simulator and planner: schedules, a simpy engine, closed forms and the planner.

>>> from treeattn.topo import Topology
>>> from treeattn.sim import DecodeWorkload, plan
>>> p = plan(Topology.from_spec("mi300x"), DecodeWorkload("llama-3.1-8b", 32768))
>>> p.algorithm in ("tree", "butterfly", "allgather", "allreduce3", "ring")
True
"""

from treeattn.sim.algorithms import build_schedule
from treeattn.sim.backend import BackendModel
from treeattn.sim.engine import simulate
from treeattn.sim.errors import ScheduleError, SimError
from treeattn.sim.hardware import HardwareModel
from treeattn.sim.models import ModelConfig
from treeattn.sim.planner import Plan, plan
from treeattn.sim.results import SimResult
from treeattn.sim.schedule import Compute, Merge, Recv, Schedule, Send
from treeattn.sim.workload import DecodeWorkload

__all__ = [
    "BackendModel", "Compute", "DecodeWorkload", "HardwareModel", "Merge", "ModelConfig",
    "Plan", "Recv", "Schedule", "ScheduleError", "Send", "SimError", "SimResult",
    "build_schedule", "plan", "simulate",
]
