"""Tensor parallelism beside sequence sharding: which ranks form each context-parallel group.

Real deployments combine the two. With ``tp = T`` the attention heads are split over ``T``
GPUs, consecutive ranks of a host first (Meta runs TP8 inside a node; vLLM's TP groups are
consecutive ranks), and the sequence is sharded over the ``p / T`` *context-parallel* (CP)
groups: CP group ``i`` is the ``i``-th GPU of every TP group, so with TP8 on 8-GPU hosts it
is GPU ``i`` of every node (one rail each on a rail-optimised fabric). Each CP group runs the
sequence-parallel algorithm on its own heads: ``Hq / T`` query heads and ``Hkv / T`` KV
heads, or one KV head replicated when ``T > Hkv`` (as vLLM replicates KV heads).

The groups work on disjoint heads and never talk to each other during the attention merge,
so the planner plans CP group 0 on its own sub-topology (its GPUs and all the switches and
NICs between them) with the per-group head counts. What this leaves out, and the report says
so: traffic of the other CP groups on links they share with group 0 (none on a
rail-optimised fabric with one rail per GPU index; some on PCIe or shared NICs).

>>> from treeattn.topo import Topology
>>> from treeattn.schedule.workload import DecodeWorkload
>>> topo, w = cp_view(Topology.from_spec("dgx-h100:nodes=4"), DecodeWorkload("llama-3.1-8b",
...                                                                          65536, tp=8))
>>> topo.num_gpus, w.model.n_heads, w.model.n_kv_heads, w.tp
(4, 4, 1, 1)
"""

from __future__ import annotations

from dataclasses import replace

from treeattn.schedule.payloads import SimError
from treeattn.schedule.workload import DecodeWorkload


def cp_group(world: int, tp: int, index: int = 0) -> list[int]:
    """Ranks of CP group ``index``: the ``index``-th rank of every TP group of ``tp``.

    >>> cp_group(16, 8, 0), cp_group(16, 4, 1)
    ([0, 8], [1, 5, 9, 13])
    """
    if tp < 1 or world % tp:
        raise SimError(f"--tp {tp} must divide the {world} GPUs")
    return list(range(index, world, tp))


def group_workload(workload: DecodeWorkload) -> DecodeWorkload:
    """The workload one CP group sees: its share of the heads, and no further TP."""
    model, tp = workload.model, workload.tp
    if model.n_heads % tp:
        raise SimError(f"--tp {tp} does not divide {model.name}'s {model.n_heads} query heads")
    kv = model.n_kv_heads // tp if model.n_kv_heads >= tp else 1  # replicated KV heads
    if model.n_kv_heads >= tp and model.n_kv_heads % tp:
        raise SimError(f"--tp {tp} does not divide {model.name}'s {model.n_kv_heads} KV heads")
    # Each GPU holds its heads' columns of Q/K/V and rows of O at the full hidden size
    # (dim × head_dim × its heads: 1/tp of the projections, not 1/tp²), 1/tp of the MLP's
    # intermediate size and of the vocabulary (Megatron-style row/column splits).
    shard = replace(model, name=f"{model.name}/tp{tp}", n_heads=model.n_heads // tp,
                    n_kv_heads=kv, ffn_dim=-(-model.ffn_dim // tp),
                    vocab_size=-(-model.vocab_size // tp))
    return replace(workload, model=shard, tp=1)


def cp_view(topology, workload: DecodeWorkload):
    """``(sub-topology of CP group 0, its workload)``; the identity when ``tp == 1``."""
    if workload.tp == 1:
        return topology, workload
    ranks = cp_group(topology.num_gpus, workload.tp)
    if len(ranks) < 2:
        raise SimError(f"--tp {workload.tp} on {topology.num_gpus} GPUs leaves one GPU per "
                       "context-parallel group: there is no sequence to shard")
    return sub_topology(topology, ranks), group_workload(workload)


def sub_topology(topology, ranks: list[int]):
    """The topology with only ``ranks``' GPUs (renumbered 0..), every other node kept."""
    from treeattn.topo import Topology

    keep = {topology.gpu(r) for r in ranks}
    graph = topology.graph.copy()
    graph.remove_nodes_from([g for g in topology.gpus if g not in keep])
    for new, r in enumerate(ranks):
        graph.nodes[topology.gpu(r)]["rank"] = new
    return Topology(graph, f"{topology.name}[cp group of {len(ranks)}]")
