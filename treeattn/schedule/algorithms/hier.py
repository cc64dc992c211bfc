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

The rail step (``rail``): ``"all_gather"`` (default) gathers every host's ``(o, lse)`` in
one collective and merges locally; ``"all_reduce"`` runs ``allreduce2``'s form on the rail
instead (a max of the LSEs, then one sum of the rescaled outputs and denominators packed:
two collectives in sequence). The all-gather pays the network's latency once, but NCCL runs
it as a ring of hosts and it moves every host's partial; the all-reduces can take NCCL's tree
and move one partial's worth. On a few hosts at decode sizes the all-gather is cheaper
(``tests/test_schedule_hier.py`` prices both); on many hosts with a large batch the
all-reduces can be, so the planner scores both.

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

from treeattn.schedule.ir import Collective, Compute, Merge, Schedule, Tags
from treeattn.schedule.payloads import CollectiveOp, ComputeLabel, MergeOp, Payload, SimError
from treeattn.schedule.workload import DecodeWorkload

ONE_HOST = "one host: no rail step, hier is oneshot"
ONE_PER_HOST = "one GPU per host: no node step, hier is oneshot over the rail"
RAILS = ("all_gather", "all_reduce")


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


def _reduce(steps, group: tuple[int, ...], workload: DecodeWorkload) -> None:
    """``allreduce2`` on ``group``: all-reduce the max of the LSEs, then the rescaled
    outputs and denominators packed, and finish the merge on every member."""
    if len(group) < 2:
        return
    pb, mx = workload.partial_bytes, workload.max_bytes
    maximum = Collective(CollectiveOp.ALL_REDUCE_MAX, group, mx, Payload.MAX)
    sums = Collective(CollectiveOp.ALL_REDUCE_SUM, group, workload.buffer_bytes(Payload.NUMDEN),
                      Payload.NUMDEN)
    for r in group:
        steps[r] += [Compute(ComputeLabel.INIT_MAX, pb + mx), maximum,
                     Compute(ComputeLabel.RESCALE_PACKED, 2 * pb + mx), sums,
                     Compute(ComputeLabel.FINALIZE_PACKED, 2 * pb + mx)]


def build_hier(topology, workload: DecodeWorkload, rail: str = "all_gather") -> Schedule:
    if rail not in RAILS:
        raise SimError(f"hier rail must be one of {', '.join(RAILS)}, got {rail!r}")
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
        group = tuple(ranks[i] for ranks in layout)
        if rail == "all_gather":
            _gather(steps, group, pb, rail_tag)
        else:
            _reduce(steps, group, workload)
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
    if rail != "all_gather":
        params["rail"] = rail
    if extras:
        params["broadcast_to"] = extras
    reason = degenerate_reason(topology)
    if reason is not None:
        params["degenerate"] = reason
    return Schedule("hier", steps, params)
