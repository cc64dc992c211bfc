"""What serving systems run today: one-shot gathers and the head-scatter merges.

Every generator here is built from library collectives (see the ``Collective`` step in
:mod:`treeattn.schedule.ir`) over all ranks, in the order the systems issue them:

``oneshot``  Star Attention's decode phase and the symmetric-memory one-shot kernels
             (arXiv 2411.17116, NVIDIA/Star-Attention): all-gather every rank's
             ``(o, lse)`` and merge them locally. Output replicated.

``helix``    NVIDIA's Helix parallelism (arXiv 2507.07120) and the ``a2a`` backend of vLLM
             and SGLang's decode context parallelism: with Q replicated, one all-to-all
             along the query heads sends head chunk ``j`` of every partial to rank ``j``,
             which merges the ``p`` pieces. Output head-sharded.

``dcp``      vLLM's and SGLang's decode context parallelism, default backend
             (``cp_lse_ag_out_rs``): all-gather the LSEs, rescale the local output by
             ``exp(lse_local − lse_global)``, then reduce-scatter the outputs along the
             heads. Output head-sharded. vLLM first all-gathers the queries when the TP
             ranks hold different heads; treeattn's ranks hold the whole query (replicated
             non-attention layers), so that gather is priced only with ``query_gather=True``.

When the workload asks for a replicated output (``DecodeWorkload.layout``, the default,
because treeattn runs the rest of the layer replicated), a head-sharded schedule ends with
the all-gather of the head shards that a practitioner would add; with ``layout=
"head_sharded"`` (a tensor-parallel output projection follows) it stops at the scatter.
"""

from __future__ import annotations

from treeattn.schedule.ir import Collective, Compute, Merge, Schedule, Tags
from treeattn.schedule.payloads import CollectiveOp, ComputeLabel, MergeOp, Payload, SimError
from treeattn.schedule.workload import DecodeWorkload


class LayoutRefused(SimError):
    """An algorithm that cannot run this layout (the planner leaves it out, with the reason)."""


HEAD_SPLIT = ("helix", "dcp")  # the baselines whose engines need an even split of the heads


def check_head_split(algorithm: str, workload: DecodeWorkload, world: int) -> None:
    """Refuse a head-scatter baseline whose ranks do not split the query heads evenly.

    vLLM's DCP reduce-scatters the outputs along the heads (``reduce_scatter_tensor`` needs
    equal shards) and the Helix all-to-all sends head chunk ``j`` to rank ``j``: with more
    ranks than heads, or a count that does not divide them, some ranks would hold no heads
    or uneven ones, which neither engine runs. (treeattn's own executor runs these schedules
    on uneven chunks, so the generators build them; the planner, which prices them as the
    engines run them, refuses the point.)
    """
    if algorithm not in HEAD_SPLIT:
        return
    heads = workload.model.n_heads
    if heads % world:
        op = "reduce-scatter" if algorithm == "dcp" else "all-to-all"
        raise LayoutRefused(f"{algorithm}: {world} ranks do not divide the {heads} query heads "
                            f"of {workload.model.name}; its {op} along the heads needs an "
                            "even split, so it cannot run this layout")


def _start(topology, workload: DecodeWorkload) -> tuple[tuple[int, ...], list[list]]:
    world = topology.num_gpus
    shards = workload.shards(world)
    return tuple(range(world)), [[workload.attention_step(shards[r])] for r in range(world)]


def finish_layout(steps, workload: DecodeWorkload, group: tuple[int, ...], algorithm: str,
                  params: dict) -> Schedule:
    """Wrap a head-sharded schedule, appending the gather of head shards when the workload
    wants the output replicated."""
    if workload.layout == "replicated":
        gather = Collective(CollectiveOp.ALL_GATHER, group, workload.partial_bytes,
                            Payload.PARTIAL, sharded=True)
        for rank_steps in steps:
            rank_steps.append(gather)
        return Schedule(algorithm, steps, {**params, "gathered_heads": True}, "replicated")
    return Schedule(algorithm, steps, params, "head_sharded")


def build_oneshot(topology, workload: DecodeWorkload) -> Schedule:
    """All-gather every partial, then merge the ``p − 1`` others locally."""
    group, steps = _start(topology, workload)
    tags, pb = Tags(), workload.partial_bytes
    tag = tags.collective()
    gather = Collective(CollectiveOp.ALL_GATHER, group, len(group) * pb, Payload.PARTIAL, tag=tag)
    # one pass over the p gathered partials, writing one: (p + 1) partials of traffic
    fold = Merge((len(group) + 1) * pb, MergeOp.PARTIAL, tag)
    for rank_steps in steps:
        rank_steps += [gather, fold]
    return Schedule("oneshot", steps, {})


def build_helix(topology, workload: DecodeWorkload) -> Schedule:
    """One all-to-all of ``(o, lse)`` along the heads, then a local merge of the pieces."""
    group, steps = _start(topology, workload)
    tags, pb = Tags(), workload.partial_bytes
    tag = tags.collective()
    exchange = Collective(CollectiveOp.ALL_TO_ALL, group, pb, Payload.PARTIAL, tag=tag)
    fold = Merge(3 * pb, MergeOp.PARTIAL, tag)
    for rank_steps in steps:
        rank_steps += [exchange, fold]
    return finish_layout(steps, workload, group, "helix", {})


def build_dcp(topology, workload: DecodeWorkload, query_gather: bool = False) -> Schedule:
    """All-gather the LSEs, rescale locally, reduce-scatter the outputs along the heads."""
    group, steps = _start(topology, workload)
    tags, pb, mx = Tags(), workload.partial_bytes, workload.max_bytes
    p = len(group)
    tag = tags.collective()
    num = workload.num_bytes
    # vLLM reduce-scatters the rescaled output in the attention dtype (cp_lse_ag_out_rs:
    # correct_attn_out rescales the attention output in place, then reduce_scatter(out)),
    # not the fp32 numerator treeattn's runtime keeps
    out = num // 4 * workload.model.dtype_bytes
    tail = [
        Compute(ComputeLabel.INIT_MAX, pb + mx),  # max ← the local lse
        Collective(CollectiveOp.ALL_GATHER, group, p * mx, Payload.MAX, tag=tag),
        Merge((p + 1) * mx, MergeOp.LSE, tag),  # max ← the global lse: p read, one written
        Compute(ComputeLabel.RESCALE, pb + 3 * mx + num),
        Collective(CollectiveOp.REDUCE_SCATTER, group, out, Payload.NUM),
        Compute(ComputeLabel.FINALIZE_GLOBAL, num + mx + pb),
    ]
    query = Collective(CollectiveOp.ALL_GATHER, group, workload.query_bytes(), Payload.QUERY,
                       sharded=True)
    for rank_steps in steps:
        if query_gather:  # vLLM's Q all-gather (priced; the query is already everywhere)
            rank_steps.insert(0, query)
        rank_steps += tail
    return finish_layout(steps, workload, group, "dcp", {"query_gather": query_gather})
