"""Damaged tool output is an error naming the damage, never a silently smaller topology.

Why: one bad header token used to yield a 1-GPU topology with exit 0, ``NV999`` gave
~25 TB/s per pair, a GPU's NVLink to itself became a fake NVSwitch and duplicate PCI bus IDs
passed. Each case edits a real sample (tests/fixtures) in one place.
"""

from __future__ import annotations

import pytest
from topo_inputs import NVSMI_A100, fixture

from treeattn.topo import Topology, TopologyError
from treeattn.topo.importers.detect import parse_text

NV3090 = "nvsmi-4xrtx3090-nv4-pairs-aikitoria-pr18.txt"
IBM_XML = "nccl-topo-ibmcloud-gx3d-8xh100-vsi.xml"
RCCL_VM = "rccl-topo-8xmi300x-vm.xml"
ROCM = "rocmsmi-4xmi210-archer2.txt"


def refuse(text: str, name: str, gpu: str | None = None) -> str:
    with pytest.raises(TopologyError) as info:
        parse_text(Topology, text, name, gpu=gpu)
    message = str(info.value)
    assert "\n" not in message
    return message


def replace_once(text: str, old: str, new: str, nth: int = 0) -> str:
    at = -1
    for _ in range(nth + 1):
        at = text.index(old, at + 1)
    return text[:at] + new + text[at + len(old):]


@pytest.mark.timeout(20)
@pytest.mark.parametrize("name", [NVSMI_A100, NV3090])
@pytest.mark.parametrize("bad", ["GPUx", "GP U1", "CPU Affinty", "??"])
def test_bad_header_token_names_token_and_line(name, bad):
    text = replace_once(fixture(name), "GPU1", bad)
    message = refuse(text, name)
    assert "line 1" in message or "GPU1" in message, message


@pytest.mark.timeout(20)
@pytest.mark.parametrize("cell", ["NV999", "NV19", "NV0"])
def test_impossible_nvlink_counts(cell):
    text = fixture(NVSMI_A100).replace("NV12", cell)
    assert cell in refuse(text, NVSMI_A100)


@pytest.mark.timeout(20)
def test_nvlink_count_above_the_named_model():
    text = fixture(NVSMI_A100).replace("NV12", "NV18")
    assert "A100 has 12" in refuse(text, NVSMI_A100, gpu="A100")
    assert parse_text(Topology, text, "x.txt").gpu_model(0) == "H100"  # no --gpu: an H100


@pytest.mark.timeout(20)
def test_duplicate_nic_in_the_legend():
    text = fixture(NVSMI_A100).replace("NIC1: mlx5_1", "NIC1: mlx5_0")
    assert "twice" in refuse(text, NVSMI_A100)


@pytest.mark.timeout(20)
def test_duplicate_row_and_column():
    text = fixture(NV3090)
    lines = text.splitlines()
    row = next(i for i, line in enumerate(lines) if line.startswith("GPU1"))
    dup_row = "\n".join(lines[:row + 1] + [lines[row]] + lines[row + 1:])
    assert "duplicate row GPU1" in refuse(dup_row, NV3090)
    assert "duplicate column GPU0" in refuse(replace_once(text, "GPU1", "GPU0"), NV3090)


@pytest.mark.timeout(20)
def test_nccl_xml_self_link():
    text = fixture(IBM_XML)
    assert 'busid="0000:a4:00.0"' in text
    bad = replace_once(text, 'nvlink target="0000:f5:00.0"', 'nvlink target="0000:a4:00.0"')
    assert "self-link" in refuse(bad, IBM_XML)


@pytest.mark.timeout(20)
@pytest.mark.parametrize("name, busid, other", [
    (IBM_XML, "0000:ae:00.0", "0000:a4:00.0"),  # a GPU twice
    (IBM_XML, "0000:ad:00.0", "0000:a3:00.0"),  # a NIC twice
])
def test_nccl_xml_duplicate_busid(name, busid, other):
    text = fixture(name).replace(f'busid="{busid}"', f'busid="{other}"')
    assert other in refuse(text, name)


@pytest.mark.timeout(20)
def test_rccl_xml_self_link_and_absurd_counts():
    text = fixture(RCCL_VM)
    first_gpu = text[text.index('busid="') + 7:].split('"')[0]
    self_link = replace_once(text, 'xgmi target="', f'xgmi target="{first_gpu}" x="')
    assert "self-link" in refuse(self_link, RCCL_VM)
    assert "count" in refuse(text.replace('count="1"', 'count="65"', 1), RCCL_VM)
    many = text.replace('count="1"', 'count="20"')
    assert "more than 64" in refuse(many, RCCL_VM)


@pytest.mark.timeout(20)
def test_rocm_smi_duplicates_and_huge_numbers():
    text = fixture(ROCM)
    row = "GPU1   XGMI         0            XGMI         XGMI"
    assert row in text
    assert "duplicate" in refuse(text.replace(row, row + "\n" + row), ROCM)
    numa = "GPU 1          : (Topology) Numa Node: 1"
    assert "twice" in refuse(text.replace(numa, numa + "\n" + numa), ROCM)
    assert "Numa Node" in refuse(text.replace(numa, numa + "9" * 5000), ROCM)
    assert "Weight" in refuse(replace_once(text, "15", "²"), ROCM)
