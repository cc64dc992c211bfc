"""Helpers shared by the tool-output importers (nvidia-smi, rocm-smi, NCCL/RCCL XML)."""

from __future__ import annotations

from treeattn.topo import hardware as hw
from treeattn.topo.errors import TopologyError
from treeattn.topo.graphbuild import GraphBuilder

HOST = "node0"
UNKNOWN = "unknown"
MAX_DEVICES = 1024  # an 8-GPU box prints 8; anything huge is garbage, refuse it early
MAX_CPUS = 64  # NUMA nodes / sockets of one host; their mesh has MAX_CPUS**2 links


def resolve_model(override: str | None, detected: str | None) -> str:
    """The GPU model: ``override`` (``--gpu``) wins, then what the text showed, else unknown.

    >>> resolve_model("h100", None), resolve_model(None, "A100"), resolve_model(None, None)
    ('H100', 'A100', 'unknown')
    """
    if override is not None:
        model = hw.normalize_model(override)
        if model not in hw.GPU_SPECS:
            known = ", ".join(m for m in hw.GPU_SPECS if m != "cpu")
            raise TopologyError(f"unknown GPU model {override!r} (known: {known})")
        return model
    return detected or UNKNOWN


def links_of(model: str) -> hw.GpuSpec:
    """Link facts for ``model``; an unknown model has no peer links and allows P2P."""
    return hw.GPU_SPECS.get(model, hw.GpuSpec("", 0, 0.0))


# Per-link figures assumed when the model is unknown (documented in hardware.py's table):
# NVLink 2/3/4 all run 25 GB/s per link and direction; xGMI (Infinity Fabric 3) 50 GB/s.
ASSUMED_LINK_BANDWIDTH = {"nvlink": 25 * hw.GB, "xgmi": 50 * hw.GB}


def need_link_bandwidth(model: str, kind: str) -> float:
    """Per-link bandwidth of ``model``'s ``kind`` links.

    An unknown model gets :data:`ASSUMED_LINK_BANDWIDTH` (pass ``--gpu`` to be exact); a known
    model without such links is a contradiction and raises :class:`TopologyError`.

    >>> need_link_bandwidth("unknown", "xgmi") == need_link_bandwidth("MI250", "xgmi")
    True
    """
    if model == UNKNOWN:
        return ASSUMED_LINK_BANDWIDTH[kind]
    spec = links_of(model)
    if spec.link != kind or spec.link_bandwidth <= 0:
        raise TopologyError(
            f"the output shows {kind} links but GPU model {model} has none; pass the right "
            f"--gpu MODEL (e.g. {'H100' if kind == 'nvlink' else 'MI300X'})"
        )
    return spec.link_bandwidth


def pcie_bandwidth(model: str) -> float:
    """Effective x16 PCIe bandwidth for the GPU model's generation (gen4 when unknown)."""
    return hw.PCIE_BANDWIDTH[links_of(model).pcie_gen]


def add_gpu(b: GraphBuilder, index: int, rank: int, model: str, **attrs: object) -> str:
    """Add ``node0/gpu{index}`` with the standard GPU attributes."""
    return b.node(
        f"{HOST}/gpu{index}", "gpu", HOST, model=model, rank=rank, p2p=links_of(model).p2p,
        **attrs,
    )


def add_nvswitch(b: GraphBuilder, gpus: list[str], links: int, link_bw: float) -> str:
    """One NVSwitch node joined to every GPU by ``links`` bonded NVLinks."""
    sw = b.node(f"{HOST}/nvswitch", "nvswitch", HOST)
    for gpu in gpus:
        b.link(gpu, sw, "nvlink", links * link_bw, hw.NVLINK_HOP_LATENCY / 2, count=links)
    return sw


def mesh_cpus(b: GraphBuilder, cpus: list[str], bandwidth: float) -> None:
    """Join every pair of CPU sockets / NUMA nodes with an inter-socket link (at most
    :data:`MAX_CPUS` of them, so the mesh stays small)."""
    check_count(len(cpus), "CPU / NUMA nodes", MAX_CPUS)
    for i, u in enumerate(cpus):
        for v in cpus[i + 1:]:
            b.link(u, v, "upi", bandwidth, hw.UPI_LATENCY)


def check_count(n: int, what: str, most: int = MAX_DEVICES) -> None:
    """Refuse no ``what`` at all, or more than ``most`` (a damaged or hostile input)."""
    if n == 0:
        raise TopologyError(f"no {what} found")
    if n > most:
        raise TopologyError(f"{n} {what} is more than the {most} an importer accepts")
