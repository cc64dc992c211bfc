"""The schedule generators by name: ``build_schedule(algorithm, topology, workload, **params)``.

=============  ==========================================================================
``tree``       ``shape`` (chain, flat, binary, kary, binomial, double_binary, hierarchical,
               searched), ``root``, ``k`` (kary, hierarchical), ``inner``/``outer``
               (hierarchical), ``tree`` (an explicit
               :class:`~treeattn.schedule.algorithms.trees.Tree`)
``butterfly``  no parameters
``allreduce3`` ``inner`` ("tree" or "ring"), and for the tree ``shape``, ``root``, ``k``
``allgather``  no parameters
``hier``       ``rail`` ("all_gather" or "all_reduce"); the host layout is the topology's
``ring``       no parameters (Ring Attention's pass-KV; ``ring-passkv`` is its label)
``ring-passq`` no parameters (Meta's CP pass-Q decode: queries travel, KV stays)
``allreduce2`` no parameters
``oneshot``    no parameters
``helix``      no parameters
``dcp``        ``query_gather`` (price vLLM's Q all-gather too)
=============  ==========================================================================

Each schedule says where its output lands (``Schedule.output_layout``); the head-scatter
algorithms append the gather of head shards when the workload wants a replicated output.
:data:`SOURCES` names the system each algorithm comes from, for every report.

Each schedule also says how its partials travel (``Schedule.partial_dtype``): the workload's
``partial_dtype`` when it sets one, otherwise the algorithm's own (:data:`ENGINE_PARTIAL_DTYPE`):
treeattn's schedules fp32, and a baseline the format its engine moves, o in the attention
dtype with lse in fp32 when the model computes in 16 bits:

* ``helix``: vLLM's DCP all-to-all (``vllm/v1/attention/ops/dcp_alltoall.py``,
  ``dcp_a2a_lse_reduce``) sends the attention output as the kernel wrote it and the LSE in
  fp32;
* ``dcp``: vLLM's ``cp_lse_ag_out_rs`` reduce-scatters the rescaled output in the attention
  dtype (priced in :func:`~treeattn.schedule.algorithms.serving.build_dcp`); the gather of
  head shards moves the same;
* ``oneshot``: Star Attention's decode (``star_flash_attn.py``) all-gathers FlashAttention's
  output (the query's dtype) and its fp32 LSE;
* ``ring-passq``: no public engine to read; its outbox holds the attention kernel's output,
  priced like the engines above.

An algorithm that moves no partial (the all-reduce forms, ``ring``) cannot take a bf16 wire
format: asking for one raises :class:`WireFormatRefused`.
"""

from __future__ import annotations

import dataclasses
import inspect

from treeattn.schedule.algorithms.allgather import build_allgather
from treeattn.schedule.algorithms.allreduce3 import build_allreduce2, build_allreduce3
from treeattn.schedule.algorithms.butterfly import build_butterfly
from treeattn.schedule.algorithms.hier import build_hier
from treeattn.schedule.algorithms.passq import build_ring_passq
from treeattn.schedule.algorithms.ring import build_ring
from treeattn.schedule.algorithms.serving import (
    LayoutRefused,
    build_dcp,
    build_helix,
    build_oneshot,
)
from treeattn.schedule.algorithms.tree import build_tree
from treeattn.schedule.ir import Schedule
from treeattn.schedule.payloads import SimError
from treeattn.schedule.workload import DecodeWorkload

# THE algorithm registry, in the order reports list them: every algorithm list in the code
# base (prediction rows, golden file, sweeps, runtime, CLI choices) derives from it.
REGISTRY = {
    "tree": build_tree,
    "butterfly": build_butterfly,
    "allgather": build_allgather,
    "hier": build_hier,
    "allreduce3": build_allreduce3,
    "allreduce2": build_allreduce2,
    "oneshot": build_oneshot,
    "helix": build_helix,
    "dcp": build_dcp,
    "ring": build_ring,
    "ring-passq": build_ring_passq,
}
ALGORITHM_NAMES: tuple[str, ...] = tuple(REGISTRY)
# Other spellings accepted on input: Ring Attention's pass-KV ring under its explicit name.
ALIASES = {"ring-passkv": "ring"}
# What a command line accepts: the planner's own choice, every algorithm, every alias.
CLI_CHOICES: tuple[str, ...] = ("auto", *ALGORITHM_NAMES, *ALIASES)
# Who runs each algorithm today: the label every report prints next to its name.
SOURCES = {
    "tree": "treeattn: topology-aware tree",
    "butterfly": "treeattn: recursive doubling",
    "allgather": "treeattn: p2p all-to-all gather",
    "hier": "treeattn: node then rail all-gathers",
    "allreduce3": "Tree Attention paper: 3 all-reduces",
    "allreduce2": "2 all-reduces (max, packed sums)",
    "oneshot": "Star Attention / one-shot all-gather",
    "helix": "Helix / vLLM+SGLang DCP a2a",
    "dcp": "vLLM/SGLang DCP (AG+RS)",
    "ring": "Ring Attention pass-KV",
    "ring-passq": "Meta CP pass-Q ring",
}
# treeattn's own algorithms; every other one is a baseline a practitioner runs today.
OWN = ("tree", "butterfly", "allgather", "hier")
BASELINES = tuple(a for a in ALGORITHM_NAMES if a not in OWN)
TREE_PARAMS = {"shape", "root", "k", "inner", "outer", "tree", "backend"}
# The partial wire format each engine moves when the model computes in 16 bits (module
# docstring); an algorithm not listed moves fp32 partials unless the workload says otherwise.
ENGINE_PARTIAL_DTYPE = {"oneshot": "bf16", "helix": "bf16", "dcp": "bf16",
                        "ring-passq": "bf16"}
# Algorithms whose messages carry no partial (o, lse): a wire format does not apply to them.
NO_PARTIAL_ON_WIRE = ("allreduce3", "allreduce2", "ring")


class WireFormatRefused(LayoutRefused):
    """A partial wire format an algorithm cannot use (the planner leaves it out)."""


def partial_dtype_for(algorithm: str, workload: DecodeWorkload) -> str:
    """How ``algorithm``'s partials travel for ``workload`` (see the module docstring).

    >>> w = DecodeWorkload("llama-3.1-8b", 1024)
    >>> partial_dtype_for("helix", w), partial_dtype_for("tree", w)
    ('bf16', 'fp32')
    """
    algorithm = ALIASES.get(algorithm, algorithm)
    if workload.partial_dtype is not None:
        if workload.partial_dtype != "fp32" and algorithm in NO_PARTIAL_ON_WIRE:
            raise WireFormatRefused(
                f"{algorithm} moves no partial (o, lse): a {workload.partial_dtype} partial "
                "wire format does not apply to it (its messages are fp32 sums, maxima or KV "
                "blocks)")
        return workload.partial_dtype
    engine = ENGINE_PARTIAL_DTYPE.get(algorithm, "fp32")
    return engine if workload.model.dtype_bytes == 2 else "fp32"


def build_schedule(algorithm: str, topology, workload: DecodeWorkload, **params) -> Schedule:
    """Build the schedule of one decode step of attention.

    Examples
    --------
    >>> from treeattn.topo import Topology
    >>> topo = Topology.from_spec("local:ranks=4,latency=1e-6,bandwidth=1e9")
    >>> s = build_schedule("tree", topo, DecodeWorkload("debug", 64), shape="chain")
    >>> s.world, s.params["parent"]
    (4, [-1, 0, 1, 2])
    """
    algorithm = ALIASES.get(algorithm, algorithm)
    if algorithm not in REGISTRY:
        raise SimError(f"unknown algorithm {algorithm!r} (known: {', '.join(REGISTRY)})")
    if not isinstance(workload, DecodeWorkload):
        raise SimError("workload must be a DecodeWorkload")
    generator = REGISTRY[algorithm]
    accepted = set(inspect.signature(generator).parameters) - {"topology", "workload"}
    if algorithm == "tree":
        accepted = TREE_PARAMS
    unknown = set(params) - accepted
    if unknown:
        raise SimError(f"{algorithm}: unknown parameter(s) {', '.join(sorted(unknown))}")
    workload.shards(topology.num_gpus)  # raises for one GPU or seq_len < p
    wire = partial_dtype_for(algorithm, workload)
    if wire != workload.wire_dtype:
        workload = dataclasses.replace(workload, partial_dtype=wire)
    schedule = generator(topology, workload, **params)
    schedule.partial_dtype = wire
    return schedule
