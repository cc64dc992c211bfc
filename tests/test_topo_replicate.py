"""FILE:nodes=N: imported hosts replicated over the rail fabric the built-ins use."""

from __future__ import annotations

from pathlib import Path

import pytest

from treeattn.topo import Topology, TopologyError
from treeattn.topo.importers.detect import expected_gpus

FIX = Path(__file__).parent / "fixtures"
XML = FIX / "nccl-topo-azure-ndv5-8xh100.xml"  # 8 GPUs, 8 NICs
SMI = FIX / "rocmsmi-8xmi300-did74a2-xgmi-msswift.txt"  # 8 GPUs, no NIC


def nodes_of(t: Topology, route) -> list[str]:
    return [route[0][0]] + [v for _, v in route]


def kinds(t: Topology, route) -> list[str]:
    return [t.graph.nodes[n]["kind"] for n in nodes_of(t, route)]


@pytest.mark.parametrize("path", [XML, SMI, FIX / "nvsmi-8xa100-sxm40g-10nic.txt"])
def test_replicated_host_has_n_times_the_gpus_and_rails(path):
    one = Topology.load(path)
    t = Topology.load(f"{path}:nodes=3")
    assert t.num_gpus == 3 * one.num_gpus and t.hosts == ["node0", "node1", "node2"]
    assert [t.gpu_model(g) for g in t.gpus] == [one.gpu_model(g) for g in one.gpus] * 3
    for g in t.gpus:
        nic = t.graph.nodes[g]["nic"]
        assert t.graph.nodes[nic]["host"] == t.host_of(g)
        assert isinstance(t.graph.nodes[nic]["rail"], int)
    leaves = [n for n, d in t.graph.nodes(data=True) if d["kind"] == "net_switch"]
    assert leaves and all(len(list(t.graph.predecessors(n))) == 3 for n in leaves)


def test_nics_listed_by_the_host_become_the_rails_in_order():
    t = Topology.load(f"{XML}:nodes=2")
    for r in range(8):
        assert t.graph.nodes[f"node1/nic{r}"]["rail"] == r
        assert t.edge(f"node1/nic{r}", f"rail{r}/leaf0")["bandwidth"] == 400e9 / 8
    assert {t.graph.nodes[g]["nic"] for g in t.gpus_on("node0")} == {
        f"node0/nic{r}" for r in range(8)}  # every GPU its own (closest) NIC


def test_host_without_nics_gets_one_per_rail_round_robin():
    t = Topology.load(f"{SMI}:nodes=2,rails=2,nic_gbps=200")
    nics = [t.graph.nodes[g]["nic"] for g in t.gpus_on("node1")]
    assert nics == ["node1/railnic0"] * 4 + ["node1/railnic1"] * 4
    assert t.edge("node1/railnic1", "rail1/leaf0")["bandwidth"] == 25e9
    assert {t.graph.nodes[n]["kind"] for n in t.graph.succ["node1/railnic0"]} <= {
        "cpu", "pcie_switch", "net_switch"}


def test_routes_between_hosts_go_nic_leaf_spine_nic():
    t = Topology.load(f"{XML}:nodes=5,leaf=2")  # 3 leaves per rail, so a spine level
    far = t.route(0, 4 * 8 + 3)  # node0 -> node4, rail 3 (PXN over NVLink first)
    k = kinds(t, far)
    assert k[-1] == "gpu" and "nic" in k
    net = [t.graph.nodes[n].get("tier") for n in nodes_of(t, far)
           if t.graph.nodes[n]["kind"] == "net_switch"]
    assert net == ["leaf", "spine", "leaf"]
    i = k.index("nic")
    assert k[i:i + 5] == ["nic", "net_switch", "net_switch", "net_switch", "nic"]
    near = t.route(0, 8)  # node0 -> node1: same leaf
    assert [t.graph.nodes[n].get("tier") for n in nodes_of(t, near)].count("leaf") == 1


def test_json_round_trip_and_import_cli(tmp_path):
    from treeattn.cli import main

    t = Topology.load(f"{SMI}:nodes=2")
    assert Topology.from_json(t.to_json()) == t
    out = tmp_path / "c.json"
    assert main(["topo", "import", str(SMI), "--nodes", "2", "-o", str(out)]) == 0
    assert Topology.load(out) == t


@pytest.mark.parametrize("opts, words", [
    ("nodes=0", "between 1 and"),
    ("nodes=1000000000", "between 1 and"),
    ("nodes=2,colour=red", "unknown option 'colour'"),
    ("rails=2", "need nodes=N"),
    ("nodes=2,rails=9", "has 8 NICs"),
    ("nodes=2,nic_gbps=fast", "not a number"),
    ("nodes=2,nodes=3", "twice"),
    ("nodes=4096,leaf=1", "fabric too large"),
])
def test_bad_options_are_one_line_errors(opts, words):
    with pytest.raises(TopologyError, match=words) as err:
        Topology.load(f"{XML}:{opts}")
    assert "\n" not in str(err.value)


def test_huge_nodes_refused_before_reading_the_file(tmp_path):
    missing = tmp_path / "nope.xml"
    with pytest.raises(TopologyError, match="between 1 and"):
        Topology.load(f"{missing}:nodes=1000000000")
    with pytest.raises(TopologyError, match="between 1 and"):
        expected_gpus(f"{missing}:nodes=1000000000")


def test_files_without_one_host_structure_are_refused(tmp_path):
    cluster = tmp_path / "two.json"
    cluster.write_text(Topology.from_spec("dgx-h100:nodes=2").to_json())
    with pytest.raises(TopologyError, match="one host"):
        Topology.load(f"{cluster}:nodes=2")
    ranks = tmp_path / "local.json"
    ranks.write_text(Topology.from_spec("local:ranks=2").to_json())
    with pytest.raises(TopologyError, match="no PCIe link|no host structure"):
        Topology.load(f"{ranks}:nodes=2")


def test_expected_gpus_of_a_replicated_json(tmp_path):
    box = tmp_path / "box.json"
    box.write_text(Topology.load(SMI).to_json())
    assert expected_gpus(f"{box}:nodes=5") == 40


def test_builtin_specs_still_parse_as_specs():
    assert Topology.load("dgx-h100:nodes=2").num_gpus == 16
    with pytest.raises(TopologyError, match="unknown topology"):
        Topology.load("dgx-h99:nodes=2")
