"""``hier``: merge inside each host, then across hosts along the rails, in two collectives.

Per rank, with ``P`` its partial and its host's GPUs in rank order::

    Compute("attention")
    node step  all-gather the partials of the host's GPUs (its NVLink domain); merge
               -> every GPU of host h holds P_h, the merge of host h's partials
    rail step  all-gather P_h over the rail: GPU i of every host; merge
               -> every rail member holds the merge of every host's P_h: the output

Output replicated. Only one partial per host crosses the network on each rail, and the rail
collective is a short ring (or tree) of hosts, not a long ring of every GPU: that is where it
beats one flat collective over all ranks on a cluster of several hosts. Each step is one
library collective on a subgroup (the IR's ``Collective.group``), so the simulator prices the
node step as NCCL (or a one-sided transport, when the planner prices one cheaper) runs a
communicator of one host, and the rail step as NCCL runs one of one GPU per host
(:class:`~treeattn.sim.nccl.group_shape.GroupShape`).

Why an all-gather on the rails: the merge needs every host's ``(o, lse)``; one all-gather
moves them in one collective, where the all-reduce form (the paper's, ``allreduce2``) takes
two in sequence (a max, then the rescaled sums), each paying the network's latency. At the
decode sizes here (a partial of tens to hundreds of KiB) latency dominates, and the priced
comparison (``tests/test_schedule_hier.py``) keeps the all-gather.

Layouts:

* **Uneven hosts** (a rail missing a GPU): rails run over the ``m`` GPUs every host has (the
  smallest host's count). A GPU past those on a larger host (local index ``j >= m``) joins
  no rail; after the rail step, GPU ``j mod m`` of its host broadcasts the output to it
  over the host's links (one more collective inside the host, for those GPUs only).
* **One host**: there is no rail step; ``hier`` is ``oneshot`` (one all-gather, one merge),
  and its parameters say so (``degenerate``).
* **One GPU per host** (a context-parallel group of a tensor-parallel layout, one GPU of each
  host): there is no node step; ``hier`` is ``oneshot`` over the rail, and says so.

>>> from treeattn.topo import Topology
>>> from treeattn.schedule.workload import DecodeWorkload
>>> s = build_hier(Topology.from_spec("local:ranks=4,hosts=2"), DecodeWorkload("debug", 64))
>>> [step.group for step in s.steps[0] if hasattr(step, "group")]
[(0, 1), (0, 2)]
"""

from __future__ import annotations

from treeattn.schedule.ir import Collective, Merge, Schedule, Tags
from treeattn.schedule.payloads import CollectiveOp, MergeOp, Payload
from treeattn.schedule.workload import DecodeWorkload

ONE_HOST = "one host: no rail step, hier is oneshot"
ONE_PER_HOST = "one GPU per host: no node step, hier is oneshot over the rail"


def host_layout(topology) -> list[list[int]]:
    """The ranks of each host, hosts in the topology's order, ranks in rank order."""
    index = {host: i for i, host in enumerate(topology.hosts)}
    out: list[list[int]] = [[] for _ in topology.hosts]
    for r in range(topology.num_gpus):
        out[index[topology.host_of(r)]].append(r)
    return out


def degenerate_reason(topology) -> str | None:
    """Why ``hier`` cannot differ from ``oneshot`` on ``topology`` (None: it has two levels)."""
    layout = host_layout(topology)
    if len(layout) == 1:
        return ONE_HOST
    if max(len(ranks) for ranks in layout) == 1:
        return ONE_PER_HOST
    return None


def _gather(steps, group: tuple[int, ...], pb: int, tag: int) -> None:
    """All-gather the partials of ``group`` and merge them on every member."""
    if len(group) < 2:
        return
    gather = Collective(CollectiveOp.ALL_GATHER, group, len(group) * pb, Payload.PARTIAL,
                        tag=tag)
    fold = Merge((len(group) + 1) * pb, MergeOp.PARTIAL, tag)  # read p partials, write one
    for r in group:
        steps[r] += [gather, fold]


def build_hier(topology, workload: DecodeWorkload) -> Schedule:
    world = topology.num_gpus
    shards = workload.shards(world)
    pb = workload.partial_bytes
    layout = host_layout(topology)
    steps = [[workload.attention_step(shards[r])] for r in range(world)]
    tags = Tags()
    node_tag, rail_tag = tags.collective(), tags.collective()
    for ranks in layout:
        _gather(steps, tuple(ranks), pb, node_tag)
    rails = min(len(ranks) for ranks in layout)
    for i in range(rails):
        _gather(steps, tuple(ranks[i] for ranks in layout), pb, rail_tag)
    extras = 0
    for ranks in layout:  # GPUs past the smallest host's count: the output from a rail member
        for i in range(rails):
            group = (ranks[i], *ranks[rails + i::rails])
            if len(group) > 1:
                extras += len(group) - 1
                share = Collective(CollectiveOp.BROADCAST, group, pb, Payload.PARTIAL,
                                   root=ranks[i])
                for r in group:
                    steps[r].append(share)
    params = {"hosts": len(layout), "rails": rails if len(layout) > 1 else 0,
              "gpus_per_host": sorted({len(ranks) for ranks in layout})}
    if extras:
        params["broadcast_to"] = extras
    reason = degenerate_reason(topology)
    if reason is not None:
        params["degenerate"] = reason
    return Schedule("hier", steps, params)
