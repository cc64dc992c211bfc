"""A low-latency all-to-all over a multi-node NVLink fabric: FlashInfer's MNNVL LL128 kernel.

FlashInfer's MNNVL all-to-all (the kernel TensorRT-LLM's Helix and MoE all-to-alls run, and
SGLang's ``--dcp-comm-backend fi_a2a``) maps a workspace into every rank of an NVLink fabric
through fabric memory handles (IMEX), and each rank writes its pieces into its peers' FIFOs
in the LL128 format: every 128-byte line carries 120 bytes of data and an 8-byte flag, so the
receiver polls the flags and no barrier is needed. Sources: SGLang issue #33355 and PR
#33364 ("fi_a2a ... requires SM90+ and MNNVL fabric memory (e.g. GB200 NVL72), unavailable
on the common single-node NVLink/NVSwitch clusters"), vLLM PR #48248 (the same kernel as a
DCP backend; it falls back to NCCL where the MNNVL workspace cannot initialise), and the
LL128 line format of NVIDIA/nccl ``src/device/prims_ll128.h`` (``NCCL_LL128_LINEELEMS`` 16
eight-byte words per line, one of them the flag).

What it runs: the all-to-all, and, for treeattn's own schedules priced like for like on
the same fabric, messages written into a peer's FIFO. Every other collective of a schedule
priced on this transport takes NCCL's regular path, as the engines do (they use the kernel
for the DCP exchange).

**Price** (:mod:`treeattn.sim.onesided.fixed_costs`: our analogy with NCCL's symmetric
kernels, at the generation's published graph-replay fraction): an exchange with flags in
the data and no barrier; a rank's ``(n−1)·S/n`` bytes at
120/128 of the load/store ceiling NCCL gives its symmetric kernels on that NVLink
generation.
"""

from __future__ import annotations

from treeattn.schedule.payloads import SimError
from treeattn.sim.nccl.collectives import CollectiveCost
from treeattn.sim.nccl.group_shape import GroupShape
from treeattn.sim.nccl.symmetric import ARCH
from treeattn.sim.onesided.fixed_costs import arch_costs, bytes_per_s, exchange_us

NAME = "mnnvl_ll128"
OPS = ("all_to_all",)
LL128_PAYLOAD = 120 / 128  # data bytes per line (prims_ll128.h: 15 of 16 words)


def domain_unavailable(shape: GroupShape) -> str | None:
    """Why this group has no MNNVL fabric workspace (None: it has)."""
    if not shape.mnnvl:
        return ("FlashInfer's MNNVL all-to-all needs a multi-node NVLink fabric (fabric "
                "memory, e.g. GB200 NVL72); this group has none")
    if shape.nnodes != 1:
        return ("FlashInfer's MNNVL all-to-all needs one NVLink domain; this group spans "
                f"{shape.nnodes} hosts (racks)")
    if shape.intra != "nvlink" or shape.arch not in ARCH:
        return "FlashInfer's MNNVL all-to-all needs Blackwell or Hopper GPUs on NVLink"
    return None


def unavailable(op: str, shape: GroupShape, reduction: str = "sum") -> str | None:
    """Why the LL128 kernel would not run ``op`` for this group, or None."""
    if op not in OPS:
        return f"FlashInfer's MNNVL kernel is an all-to-all; {op} takes NCCL's regular path"
    return domain_unavailable(shape)


def ll128_cost(op: str, nbytes: int, shape: GroupShape,
               reduction: str = "sum") -> CollectiveCost:
    """The LL128 all-to-all of ``nbytes`` (nccl-tests' size: a rank's whole send buffer).

    >>> from treeattn.topo import Topology
    >>> shape = GroupShape.of(Topology.from_spec("gb200-nvl72"), range(8))
    >>> round(ll128_cost("all_to_all", 8192, shape).time_s * 1e6, 2)
    2.33
    """
    reason = unavailable(op, shape, reduction)
    if reason is not None:
        raise SimError(reason)
    n = shape.nranks
    ceiling = bytes_per_s(arch_costs(shape).peak) * LL128_PAYLOAD  # B/s of data
    latency = exchange_us(shape) * 1e-6
    time_s = latency + (n - 1) * nbytes / n / ceiling
    return CollectiveCost(op, int(nbytes), "mnnvl_ll128_a2a", "LL128", latency,
                          nbytes / max(time_s - latency, 1e-12), time_s)


def put_base_us(shape: GroupShape, ll: bool) -> float:
    """One message into a peer's FIFO: an exchange whose flags ride in its lines."""
    return exchange_us(shape)
