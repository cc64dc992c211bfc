"""Which CPUs each local rank runs on: pin ranks to cores, and count the group's cores.

Why pin: with more ranks than cores (4 ranks on a 2-core box), Linux places a rank that
wakes from a futex on whichever core looks idle at that instant, and the step times of a
4-rank decode came out bimodal. Measured on this project's 2-core box,
six alternated runs of ``benchmarks/algorithms.py --quick`` at 4 ranks: unpinned, 14 of 20
points met the repeatability targets of issue 17; pinned round-robin, 17 of 20, with the
ring's prediction error down from 20–32% to 10–17%.

Why only then (``bind="auto"``, the default): with no more ranks than cores Linux keeps each
rank on its own core anyway, and pinning made the large loopback exchange that prices a
ring's KV blocks less repeatable: at 2 ranks on 2 cores, 1 GiB took 593–785 ms pinned (two
calibrations) and 712–984 ms with only the main thread pinned (three), against 876–973 ms
unpinned (three), all timed with the exchange of that time, which posted its send before
its receive (see :func:`treeattn.testbed.calibration.calibrate.measure_exchange`). ``"cores"`` pins
always, ``"none"`` never.

How: the launcher (:mod:`treeattn.runtime.launch`) reads the CPUs it may use once and hands
them to each child (:data:`GROUP_CPUS_ENV`), which pins itself before it joins the group.
Rank ``r`` with ``t`` threads gets the ``t`` CPUs starting at ``r·t`` (modulo the count), so
ranks share a core only when there are more threads than cores, and then evenly. The
simulator knows (the profile's ``pinned``): the host's k-th rank computes on core
``k mod cores`` and queues only behind the ranks pinned beside it
(:mod:`treeattn.sim.engine`). torchrun-started ranks are left alone: their placement is
their launcher's business.

The group's core count (:func:`group_cores`) is read from that variable, not from the rank's
own affinity, which pinning has narrowed to one core.
"""

from __future__ import annotations

import os

GROUP_CPUS_ENV = "TREEATTN_GROUP_CPUS"  # "0,1,...": the CPUs the launcher could use
BIND_CHOICES = ("auto", "cores", "none")


def available_cpus() -> list[int]:
    """The CPUs this process may run on, in order."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return list(range(os.cpu_count() or 1))


def cpus_for_rank(local_rank: int, threads: int, cpus: list[int]) -> list[int]:
    """The CPUs of ``local_rank`` when every rank runs ``threads`` threads.

    >>> cpus_for_rank(3, 1, [0, 1])
    [1]
    >>> cpus_for_rank(1, 2, [0, 1, 2, 3])
    [2, 3]
    >>> cpus_for_rank(0, 4, [0, 1])
    [0, 1]
    """
    if not cpus:
        raise ValueError("no CPUs to bind to")
    width = min(max(1, threads), len(cpus))
    first = local_rank * width
    return sorted({cpus[(first + i) % len(cpus)] for i in range(width)})


def group_cpus() -> list[int]:
    """The group's CPUs: what the launcher exported, else this process's own affinity."""
    text = os.environ.get(GROUP_CPUS_ENV, "").strip()
    if text:
        try:
            cpus = sorted({int(c) for c in text.split(",") if c.strip()})
        except ValueError:
            cpus = []
        if cpus:
            return cpus
    return available_cpus()


def group_cores() -> int:
    """How many cores the ranks of this host share (at least 1)."""
    return max(1, len(group_cpus()))


def is_pinned() -> bool:
    """Whether this process runs on fewer CPUs than its group has (the launcher pinned it)."""
    return set(available_cpus()) < set(group_cpus())


def resolve_bind(bind: str, world: int, threads: int | None, cpus: int) -> str:
    """``"cores"`` or ``"none"``: ``"auto"`` pins only when the ranks' threads outnumber the
    CPUs (see the module docstring for why not always).

    >>> resolve_bind("auto", 4, 1, 2), resolve_bind("auto", 2, 1, 2), resolve_bind("none", 8, 1, 2)
    ('cores', 'none', 'none')
    """
    if bind not in BIND_CHOICES:
        raise ValueError(f"bind must be one of {', '.join(BIND_CHOICES)}, got {bind!r}")
    if bind != "auto":
        return bind
    return "cores" if world * (threads or 1) > cpus else "none"


def pin_rank(local_rank: int, world: int, threads: int | None, bind: str) -> list[int] | None:
    """Pin this process as ``local_rank`` of ``world``; return its CPUs (None: not pinned).

    Pinning binds every thread the process starts afterwards too (gloo's, torch's), so the
    launcher calls this before the rank joins the group. A CPU set the kernel refuses (a
    container that changed its cpuset under us) leaves the rank unpinned rather than failing.
    """
    cpus = group_cpus()
    # threads=None leaves torch its own thread count, which one core would starve
    if (resolve_bind(bind, world, threads, len(cpus)) == "none" or threads is None
            or not hasattr(os, "sched_setaffinity")):
        return None
    mine = cpus_for_rank(local_rank, threads, cpus)
    try:
        os.sched_setaffinity(0, mine)
    except OSError:
        return None
    return mine
