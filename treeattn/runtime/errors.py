"""Errors raised by the distributed runtime.

:class:`RuntimeFailure` covers everything the user should see as one line: bad input (a world
size out of range, a sequence shorter than the world, an unreadable profile, a port in use), a
rank that died, and a timeout while waiting on a peer. Messages name the rank(s) involved.
"""

from __future__ import annotations

from treeattn.errors import TreeattnError


class RuntimeFailure(TreeattnError):
    """A distributed run could not start or did not finish; the message names the cause."""


class RankTimeout(RuntimeFailure):
    """A rank waited longer than its timeout on a peer (which has probably died)."""


class RankLost(RuntimeFailure):
    """A rank died, or lost its connection to a peer, during a run."""
