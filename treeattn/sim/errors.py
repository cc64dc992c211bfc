"""Errors raised by the simulator and planner for bad input or impossible plans."""


class SimError(ValueError):
    """Bad simulator input: an unknown model, an impossible plan, a bad parameter."""


class ScheduleError(SimError):
    """A schedule that cannot run: an unmatched send, a deadlock. Names the rank and step."""
