"""The transports a schedule's collectives and messages can run on: one registry.

``nccl`` is NCCL's (or RCCL's) regular path: its ring, tree and NVLS algorithms, and
send/recv. Each other transport is one-sided, inside one NVLink domain: ranks load from and
store into their peers' registered buffers. Each names the library that runs it, the engines'
paths that use it, the ops it has kernels for, and its prices; an op it has no kernel for (a
max, an all-to-all on NCCL's symmetric kernels, anything but the all-to-all on the LL128
fabric kernel) takes NCCL's regular path, as those libraries and engines do.

=============  ===========================================  ==================================
transport      library and kernels                          engines' paths on it
=============  ===========================================  ==================================
nccl-symm      NCCL >= 2.27 symmetric kernels on registered  vLLM ``VLLM_USE_NCCL_SYMM_MEM=1``;
               windows (:mod:`treeattn.sim.nccl.symmetric`)  SGLang ``--enable-symm-mem``
symm_mem       torch ``symm_mem`` one-shot, two-shot and     vLLM's symm_mem all-reduce,
               ``multimem`` kernels, direct peer stores      ``VLLM_USE_DIRECT_DCP_A2A=1``;
               (:mod:`treeattn.sim.onesided.torch_symm`)     SGLang ``--enable-torch-symm-mem``
mnnvl_ll128    FlashInfer's MNNVL LL128 all-to-all           SGLang ``--dcp-comm-backend
               (:mod:`treeattn.sim.onesided.ll128`)          fi_a2a``; TensorRT-LLM Helix
=============  ===========================================  ==================================

Every one-sided transport is priced as the engines run it, replayed in a CUDA graph: its
fixed costs are NCCL's eager figures at the generation's published graph-replay fraction
(:mod:`treeattn.sim.onesided.fixed_costs`); ``nccl-symm`` ranks NCCL's kernels as NCCL does,
on their replayed times.

A point-to-point message on a one-sided transport is a store into the peer's buffer: the
transport's own fixed cost (``put_base_us``) replaces NCCL's enqueue and proxy cost, while the
per-hop latency and bandwidth stay those of the route (:mod:`treeattn.sim.nccl.p2p`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from treeattn.schedule.payloads import SimError
from treeattn.sim.nccl import symmetric as nccl_symm
from treeattn.sim.nccl.collectives import CollectiveCost
from treeattn.sim.nccl.group_shape import GroupShape
from treeattn.sim.onesided import ll128, torch_symm
from treeattn.sim.onesided.fixed_costs import graph_scale


@dataclass(frozen=True)
class OneSided:
    """One one-sided transport: who runs it, where, and what it costs."""

    name: str
    library: str
    engines: str
    unavailable: Callable[[str, GroupShape, str], str | None]  # why not this op, or None
    domain_unavailable: Callable[[GroupShape], str | None]  # why not this group at all
    cost: Callable[[str, int, GroupShape, str], CollectiveCost]
    put_base_us: Callable[[GroupShape, bool], float]  # one message's fixed cost (LL or not)


def _nccl_domain(shape: GroupShape) -> str | None:
    return nccl_symm.unavailable("all_gather", shape)


def _nccl_symm_replayed(op: str, nbytes: int, shape: GroupShape,
                        reduction: str = "sum") -> CollectiveCost:
    """NCCL's symmetric kernels replayed in a CUDA graph, as the engines run them: each
    candidate's base latency at the generation's graph-replay fraction
    (:func:`treeattn.sim.onesided.fixed_costs.graph_scale`; on Blackwell, the very kernel
    nccl-tests issue #333 timed), and NCCL's ranking (time, plus 2.5% per block) applied
    to those replayed times. Ranked by its eager estimate instead, NCCL would keep an LL
    kernel past the size where a plain one is faster replayed, and the price would drop by
    up to a fifth at the switch."""
    if nccl_symm.unavailable(op, shape, reduction) is None:
        scale = graph_scale(shape)
        options = []
        for eager in nccl_symm.symmetric_candidates(op, nbytes, shape, reduction):
            latency = scale * eager.latency_s
            time_s = eager.time_s - eager.latency_s + latency
            penalty = eager.choice_s / eager.time_s  # 1 + 2.5% per block
            options.append(replace(eager, latency_s=latency, time_s=time_s,
                                   tuner_s=time_s * penalty))
        if options:
            return min(options, key=lambda c: c.choice_s)
    return nccl_symm.symmetric_cost(op, nbytes, shape, reduction)  # raises SimError


def _nccl_symm_put_us(shape: GroupShape, ll: bool) -> float:
    return graph_scale(shape) * nccl_symm.put_base_us(shape, ll)


ONE_SIDED: dict[str, OneSided] = {
    "nccl-symm": OneSided(
        "nccl-symm", "NCCL >= 2.27 symmetric kernels",
        "vLLM (VLLM_USE_NCCL_SYMM_MEM=1), SGLang (--enable-symm-mem)",
        nccl_symm.unavailable, _nccl_domain, _nccl_symm_replayed, _nccl_symm_put_us),
    "symm_mem": OneSided(
        "symm_mem", "torch symm_mem kernels",
        "vLLM (symm_mem all-reduce, VLLM_USE_DIRECT_DCP_A2A=1)",
        torch_symm.unavailable, torch_symm.domain_unavailable, torch_symm.symm_mem_cost,
        torch_symm.put_base_us),
    "mnnvl_ll128": OneSided(
        "mnnvl_ll128", "FlashInfer MNNVL LL128 all-to-all",
        "SGLang (--dcp-comm-backend fi_a2a), TensorRT-LLM Helix",
        ll128.unavailable, ll128.domain_unavailable, ll128.ll128_cost, ll128.put_base_us),
}
TRANSPORTS = ("nccl", *ONE_SIDED)


def one_sided(name: str) -> OneSided | None:
    """The one-sided transport ``name`` (None for ``nccl``); SimError for an unknown name."""
    if name == "nccl":
        return None
    found = ONE_SIDED.get(name)
    if found is None:
        raise SimError(f"unknown transport {name!r} (known: {', '.join(TRANSPORTS)})")
    return found


def unoffered_reason(name: str, shape: GroupShape) -> str | None:
    """Why a group of ``shape`` cannot use transport ``name`` at all (None: it can)."""
    transport = one_sided(name)
    return None if transport is None else transport.domain_unavailable(shape)
