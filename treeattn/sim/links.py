"""Directed links as reservable resources: first-fit calendars of busy intervals.

A chunk whose head can reach a link at ``ready`` is granted the earliest idle interval
starting no earlier than ``ready`` that is long enough for it (see :meth:`reserve`).
Reservations are made in the order messages are injected (posted): simulated time order.
"""

from __future__ import annotations

from bisect import bisect_right

PRUNE_AT = 64


class LinkCalendar:
    """Busy intervals of every directed link; links are created on first use."""

    def __init__(self) -> None:
        self._starts: dict = {}
        self._ends: dict = {}

    def reserve(self, edge, ready: float, hold: float, tail: float, now: float) -> tuple:
        """Book ``edge`` at the earliest fit ≥ ``ready``; return ``(begin, end)``.

        The chunk holds the link for ``hold`` seconds and at least until ``tail`` (when its
        last byte has come in from the previous link). ``now`` is the current simulated
        time: intervals ending before it can never matter again and are dropped.
        """
        starts = self._starts.get(edge)
        begin = ready
        end = max(begin + hold, tail)
        if starts is None:
            self._starts[edge] = [begin]
            self._ends[edge] = [end]
            return begin, end
        ends = self._ends[edge]
        if len(ends) > PRUNE_AT:
            old = bisect_right(ends, now)
            del starts[:old], ends[:old]
        idx = bisect_right(ends, ready)
        while idx < len(starts) and end > starts[idx]:
            begin = max(begin, ends[idx])
            end = max(begin + hold, tail)
            idx += 1
        starts.insert(idx, begin)
        ends.insert(idx, end)
        return begin, end
