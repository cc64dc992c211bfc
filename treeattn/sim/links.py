"""Directed links as reservable resources: first-fit calendars of busy intervals.

A chunk that can reach a link at ``ready`` and needs it for ``duration`` is granted the
earliest idle interval of that length starting no earlier than ``ready``. Reservations are
made in the order messages are injected (posted), which is simulated time order.
"""

from __future__ import annotations

from bisect import bisect_right

PRUNE_AT = 64


class LinkCalendar:
    """Busy intervals of every directed link; links are created on first use."""

    def __init__(self) -> None:
        self._starts: dict = {}
        self._ends: dict = {}

    def reserve(self, edge, ready: float, duration: float, now: float) -> float:
        """Book ``edge`` for ``duration`` at the earliest fit ≥ ``ready``; return the start.

        ``now`` is the current simulated time: intervals ending before it can never be
        used again (every future request is ready at or after ``now``) and are dropped.
        """
        starts = self._starts.get(edge)
        if starts is None:
            self._starts[edge] = [ready]
            self._ends[edge] = [ready + duration]
            return ready
        ends = self._ends[edge]
        if len(ends) > PRUNE_AT:
            old = bisect_right(ends, now)
            del starts[:old], ends[:old]
        idx = bisect_right(ends, ready)
        begin = ready
        while idx < len(starts) and begin + duration > starts[idx]:
            begin = max(begin, ends[idx])
            idx += 1
        starts.insert(idx, begin)
        ends.insert(idx, begin + duration)
        return begin
