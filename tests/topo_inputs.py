"""Generators of large or damaged topology inputs, shared by the hostile and fuzz tests.

Why: the importers must stay linear and refuse garbage, and that is only testable with inputs
far bigger than any published sample, so they are generated here, never stored.
"""

from __future__ import annotations

from pathlib import Path

FIX = Path(__file__).parent / "fixtures"
NVSMI_A100 = "nvsmi-8xa100-sxm40g-10nic.txt"


def fixture(name: str) -> str:
    return (FIX / name).read_text()


def nvsmi_matrix(n: int, relation: str = "NODE", numa: str = "0") -> str:
    """``nvidia-smi topo -m`` of ``n`` GPUs, every pair ``relation`` (NV18, NODE, SYS...)."""
    names = [f"GPU{i}" for i in range(n)]
    lines = ["\t" + "\t".join(names) + "\tCPU Affinity\tNUMA Affinity"]
    for i in range(n):
        cells = "\t".join(" X " if i == j else relation for j in range(n))
        lines.append(f"GPU{i}\t{cells}\t0-7\t{numa if numa != 'i' else i}")
    return "\n".join(lines) + "\n"


def nvsmi_header(columns: int) -> str:
    """A header of ``columns`` GPU columns and one row: a hostile, huge first line."""
    return "\t" + "\t".join(f"GPU{i}" for i in range(columns)) + "\nGPU0\t X \n"


def nccl_xml(n: int, sockets: int = 2) -> str:
    """An NCCL topology dump of ``n`` H100s, each with 18 NVLinks to 4 NVSwitch chips."""
    out = ['<system version="1">']
    per = n // sockets
    for c in range(sockets):
        out.append(f'<cpu numaid="{c}" arch="x86_64" vendor="GenuineIntel" modelid="143">')
        out.append(f'<pci busid="0000:{c:02x}:00.0" class="0x060400" '
                   'link_speed="32.0 GT/s PCIe" link_width="16">')
        for k in range(per):
            i = c * per + k
            out.append(f'<pci busid="{i // 256 + 1:04x}:{i % 256:02x}:00.0" class="0x030200" '
                       'device="0x2330" link_speed="32.0 GT/s PCIe" link_width="16">')
            out.append(f'<gpu dev="{i}" sm="90" rank="{i}">')
            for s, count in enumerate((5, 4, 4, 5)):
                out.append(f'<nvlink target="ffff:00:0{s}.0" count="{count}"/>')
            out.append("</gpu></pci>")
        out.append("</pci></cpu>")
    out.append("</system>")
    return "\n".join(out)
