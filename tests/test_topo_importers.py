"""Importers: the expected GPUs and links on every real sample, and only TopologyError on junk.

Expected figures come from tests/fixtures/SOURCES.md (what each machine is) and the vendors'
per-link bandwidths, not from the importer.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from treeattn.topo import Topology, TopologyError
from treeattn.topo.importers.detect import FORMATS, detect_format, parse_text

FIX = Path(__file__).parent / "fixtures"
GB = 1e9
SAMPLES = sorted(p.name for p in FIX.iterdir() if p.suffix in (".txt", ".xml"))


def load(name: str, gpu: str | None = None) -> Topology:
    return Topology.load(FIX / name, gpu=gpu)


def count(t: Topology, kind: str) -> int:
    return sum(1 for _, d in t.graph.nodes(data=True) if d["kind"] == kind and not d.get("logical"))


def peer_pairs(t: Topology, kind: str) -> set[frozenset[int]]:
    return {frozenset((t.rank(u), t.rank(v))) for u, v, d in t.graph.edges(data=True)
            if d["kind"] == kind and u in t.gpus and v in t.gpus}


@pytest.mark.parametrize("name, fmt", [
    ("nvsmi-8xa100-sxm40g-10nic.txt", "nvidia-smi"),
    ("nvsmi-4xrtx3090-nv4-pairs-aikitoria-pr18.txt", "nvidia-smi"),
    ("rocmsmi-4xmi300a-apu-xgmi.txt", "rocm-smi"),
    ("rocmsmi-4xmi210-archer2.txt", "rocm-smi"),
    ("rocmsmi-8xmi300-did74a2-xgmi-msswift.txt", "rocm-smi"),
    ("nccl-topo-ibmcloud-gx3d-8xh100-vsi.xml", "nccl-xml"),
    ("nccl-topo-azure-ndv5-8xh100.xml", "nccl-xml"),
    ("rccl-topo-8xmi300x-baremetal.xml", "nccl-xml"),
])
def test_detects_format(name, fmt):
    assert detect_format((FIX / name).read_text()) == fmt


def test_nvsmi_a100_nvswitch_and_nics():
    t = load("nvsmi-8xa100-sxm40g-10nic.txt")
    assert t.num_gpus == 8 and t.gpu_model(0) == "A100"  # NV12 -> A100 NVLink3
    assert count(t, "nic") == 10 and count(t, "nvswitch") == 1
    for a in range(8):
        assert t.link_bandwidth_out(a) == pytest.approx(12 * 25 * GB)
        for b in range(8):
            if a != b:
                assert t.path_bandwidth(a, b) == pytest.approx(300 * GB)
    # GPU0/GPU1 and NIC0/NIC1 are PXB: under one PCIe switch, not through a CPU
    import networkx as nx
    path = nx.shortest_path(t.graph, "node0/gpu0", "node0/nic0")
    assert all(t.graph.nodes[n]["kind"] != "cpu" for n in path)
    assert t.graph.nodes["node0/nic9"]["device"] == "mlx5_9"  # from the NIC legend
    assert t.graph.nodes["node0/nic3"]["device"] == "mlx5_3"
    assert t.graph.nodes["node0/gpu4"]["numa"] == "7"


def test_nvsmi_3090_bridges():
    t = load("nvsmi-4xrtx3090-nv4-pairs-aikitoria-pr18.txt")
    assert t.num_gpus == 4 and t.gpu_model(0) == "RTX3090"
    assert peer_pairs(t, "nvlink") == {frozenset((0, 2)), frozenset((1, 3))}
    assert t.edge("node0/gpu0", "node0/gpu2")["count"] == 4
    assert t.path_bandwidth(0, 2) == pytest.approx(112.5 / 2 * GB)  # 112.5 GB/s bidirectional
    assert t.path_bandwidth(0, 1) < t.path_bandwidth(0, 2)
    assert count(t, "cpu") == 1


def test_nvsmi_gpu_override_sets_link_bandwidth():
    t = load("nvsmi-4xrtx3090-nv4-pairs-aikitoria-pr18.txt", gpu="A6000")
    assert t.gpu_model(1) == "A6000"
    with pytest.raises(TopologyError, match="MI300X|has none"):
        load("nvsmi-4xrtx3090-nv4-pairs-aikitoria-pr18.txt", gpu="MI300X")
    with pytest.raises(TopologyError, match="unknown GPU model"):
        load("nvsmi-4xrtx3090-nv4-pairs-aikitoria-pr18.txt", gpu="Voodoo2")


@pytest.mark.parametrize("name, gpu, per_link", [
    ("rocmsmi-4xmi300a-apu-xgmi.txt", "MI300A", 64 * GB),
    ("rocmsmi-4xmi210-archer2.txt", "MI210", 50 * GB),
])
def test_rocmsmi_four_gpu_meshes(name, gpu, per_link):
    t = load(name, gpu=gpu)
    assert t.num_gpus == 4 and t.gpu_model(0) == gpu
    assert len(peer_pairs(t, "xgmi")) == 6  # full mesh of 4
    assert count(t, "cpu") == 4  # GPU n on NUMA node n
    assert t.path_bandwidth(1, 3) == pytest.approx(per_link)


def test_rocmsmi_unknown_model_is_flagged_not_guessed():
    t = load("rocmsmi-4xmi210-archer2.txt")
    assert t.gpu_model(0) == "unknown" and len(peer_pairs(t, "xgmi")) == 6


def test_rocmsmi_eight_gpu_mesh():
    t = load("rocmsmi-8xmi300-did74a2-xgmi-msswift.txt")
    assert t.num_gpus == 8 and t.gpu_model(0) == "MI300X"
    assert len(peer_pairs(t, "xgmi")) == 28
    assert [t.graph.nodes[g]["numa"] for g in t.gpus] == [0, 0, 0, 0, 1, 1, 1, 1]


def test_nccl_xml_ibm_h100_nvswitch_chips():
    t = load("nccl-topo-ibmcloud-gx3d-8xh100-vsi.xml")
    assert t.num_gpus == 8 and t.gpu_model(0) == "H100"
    assert count(t, "nvswitch") == 4 and count(t, "nic") == 8 and count(t, "cpu") == 2
    for a in range(8):
        chips = [d["count"] for _, v, d in t.graph.out_edges(t.gpus[a], data=True)
                 if d["kind"] == "nvlink" and not d.get("logical")]
        assert sorted(chips) == [4, 4, 5, 5]
        assert t.link_bandwidth_out(a) == pytest.approx(450 * GB)
    assert t.path_bandwidth(0, 7) == pytest.approx(450 * GB)
    nic_bw = [d["bandwidth"] for u, _, d in t.graph.edges(data=True)
              if t.graph.nodes[u]["kind"] == "nic"]
    assert max(nic_bw) <= 200e9 / 8  # 200 Gb/s ports


def test_nccl_xml_azure_hand_written_file():
    t = load("nccl-topo-azure-ndv5-8xh100.xml")
    assert t.num_gpus == 8 and count(t, "nic") == 8 and count(t, "cpu") == 2
    assert t.gpu_model(0) == "unknown" and not peer_pairs(t, "nvlink")
    h = load("nccl-topo-azure-ndv5-8xh100.xml", gpu="H100")
    assert h.gpu_model(0) == "H100" and h.path_bandwidth(0, 7) == pytest.approx(450 * GB)


@pytest.mark.parametrize("name", ["rccl-topo-8xmi300x-baremetal.xml", "rccl-topo-8xmi300x-vm.xml"])
def test_rccl_xml_mi300x_mesh(name):
    t = load(name)
    assert t.num_gpus == 8 and t.gpu_model(0) == "MI300X"
    assert len(peer_pairs(t, "xgmi")) == 28 and count(t, "nic") == 8
    assert t.path_bandwidth(2, 6) == pytest.approx(64 * GB)


def test_rccl_vm_keeps_the_files_ranks():
    t = load("rccl-topo-8xmi300x-vm.xml")
    assert t.graph.nodes[t.gpus[0]]["busid"] == "0021:00:00.0"  # <gpu dev="1" rank="0">
    assert t.graph.nodes[t.gpus[1]]["busid"] == "0011:00:00.0"


def test_rccl_mi250_partial_mesh():
    t = load("rccl-topo-8xmi250-gcd.xml")
    assert t.num_gpus == 8 and t.gpu_model(0) == "MI250"
    pairs = peer_pairs(t, "xgmi")
    assert len(pairs) == 12  # 3 peers each
    assert {b for b in range(8) if frozenset((0, b)) in pairs} == {1, 2, 6}  # c6, c9, d9
    assert count(t, "cpu") == 3 and count(t, "nic") == 1
    assert t.path_bandwidth(0, 1) == pytest.approx(50 * GB)


def test_import_json_round_trip_of_every_sample():
    for name in SAMPLES:
        gpu = "MI210" if name.startswith("rocmsmi-4x") else None
        t = load(name, gpu=gpu)
        assert Topology.from_json(t.to_json()) == t, name


def test_xml_entities_and_doctype_refused():
    bomb = ('<?xml version="1.0"?><!DOCTYPE lolz [<!ENTITY lol "lol">]>'
            "<system><cpu>&lol;</cpu></system>")
    with pytest.raises(TopologyError, match="DOCTYPE|ENTITY"):
        parse_text(Topology, bomb, "bomb.xml")


def _check_only_topology_error(text: str, fmt: str) -> None:
    try:
        parse_text(Topology, text, "fuzz", fmt=fmt)
    except TopologyError as exc:
        assert str(exc).strip() and "\n" not in str(exc).strip()


@pytest.mark.parametrize("name", SAMPLES)
def test_every_truncation_raises_only_topology_error(name):
    text = (FIX / name).read_text()
    for cut in range(0, len(text), max(1, len(text) // 60)):
        _check_only_topology_error(text[:cut], "auto")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(SAMPLES), st.data())
def test_mutated_samples_raise_only_topology_error(name, data):
    lines = (FIX / name).read_text().splitlines()
    i = data.draw(st.integers(0, len(lines) - 1))
    action = data.draw(st.sampled_from(["drop", "dup", "garble", "swap"]))
    if action == "drop":
        del lines[i]
    elif action == "dup":
        lines.insert(i, lines[i])
    elif action == "garble":
        junk = data.draw(st.text(max_size=12))
        pos = data.draw(st.integers(0, len(lines[i])))
        lines[i] = lines[i][:pos] + junk + lines[i][pos:]
    else:
        j = data.draw(st.integers(0, len(lines) - 1))
        lines[i], lines[j] = lines[j], lines[i]
    fmt = data.draw(st.sampled_from(FORMATS))
    _check_only_topology_error("\n".join(lines), fmt)


@settings(max_examples=80, deadline=None)
@given(st.text(max_size=400), st.sampled_from(FORMATS))
def test_random_text_raises_only_topology_error(text, fmt):
    _check_only_topology_error(text, fmt)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.sampled_from(["GPU0", "GPU1", "NIC0", " X ", "NV4", "PIX", "SYS", "PHB",
                                 "XGMI", "0", "15", "\t", "\n", "  ", "<system>", "<cpu>",
                                 "<pci busid='1' class='0x0302'>", "<gpu rank='0'/>",
                                 "</pci>", "</cpu>", "</system>", "=== Link Type ==="]),
                max_size=60), st.sampled_from(FORMATS))
def test_token_soup_raises_only_topology_error(tokens, fmt):
    _check_only_topology_error("".join(tokens), fmt)
