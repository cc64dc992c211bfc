"""Ranks agree on what they run before they run it: a digest of the plan, shapes and dtype.

Spawned ranks all receive one pickled job, but ranks started by torchrun (or by a user's own
code through the library) each read their own arguments and files: a plan file that differs
between two hosts, a ``--dtype`` given to one rank only, a model with other head counts.
Such ranks would exchange messages of different sizes or run different collectives, and hang
or answer wrong. So at setup every rank hashes what must be the same everywhere and the
digests are gathered (one small collective, bounded by the group's timeout); any difference
ends the run on every rank with one line naming the ranks that differ from rank 0 and what
differs. :class:`RanksDisagree` is a :class:`~treeattn.runtime.errors.RankLost`: the input
may have been fine, the group was not one run (exit status 1).
"""

from __future__ import annotations

import hashlib
import json

from treeattn.runtime.errors import RankLost
from treeattn.runtime.group import RankContext, all_gather_objects


class RanksDisagree(RankLost):
    """Ranks of one group were given different plans, shapes or dtypes."""


def digest(value) -> str:
    """A short stable hash of ``value`` (plain data; anything else by its ``repr``).

    >>> digest({"b": 1, "a": [2, 3]}) == digest({"a": [2, 3], "b": 1})
    True
    """
    text = json.dumps(value, sort_keys=True, default=repr, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def agree_at_setup(ctx: RankContext, **parts) -> None:
    """Raise :class:`RanksDisagree` on every rank unless all ranks passed equal ``parts``."""
    mine = {name: digest(value) for name, value in parts.items()}
    everyone = all_gather_objects(ctx, mine)
    reference = everyone[0]
    differ: dict[str, list[int]] = {}
    for rank, theirs in enumerate(everyone):
        for name in sorted(set(reference) | set(theirs)):
            if theirs.get(name) != reference.get(name):
                differ.setdefault(name, []).append(rank)
    if differ:
        ranks = sorted({r for rs in differ.values() for r in rs})
        what = "; ".join(f"{name} (rank {', '.join(map(str, rs))})"
                         for name, rs in differ.items())
        raise RanksDisagree(f"rank(s) {', '.join(map(str, ranks))} disagree with rank 0 at "
                            f"setup on {what}: every rank must be given the same plan, "
                            "shapes and dtype")
