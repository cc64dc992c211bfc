"""Hostile topology inputs: huge, special or non-finite ones end fast in a TopologyError.

Why: a topology file comes from another machine or a user; a 10**6-column header, a FIFO,
a 1e308 latency or a 10**400 integer used to hang, block, print invalid JSON or crash.
Each test has a hard timeout, and nothing asserts on wall-clock values.
"""

from __future__ import annotations

import json
import os

import pytest
from topo_inputs import nccl_xml, nvsmi_header, nvsmi_matrix

from treeattn.cli import main
from treeattn.topo import Topology, TopologyError
from treeattn.topo.importers.detect import parse_text


def one_line_error(fn, *args, **kwargs) -> str:
    with pytest.raises(TopologyError) as info:
        fn(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message and len(message) < 400, message
    return message


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.timeout(20)
@pytest.mark.parametrize("columns", [40_000, 1_000_000])
def test_huge_header_is_refused_fast(columns):
    message = one_line_error(parse_text, Topology, nvsmi_header(columns), "x.txt")
    assert "1024" in message


@pytest.mark.timeout(60)
@pytest.mark.parametrize("relation", ["NODE", "NV18"])
def test_1024_gpu_nvidia_smi_imports(relation):
    t = parse_text(Topology, nvsmi_matrix(1024, relation), "big.txt")
    assert t.num_gpus == 1024
    assert t.path_bandwidth(1023, 0) > 0


@pytest.mark.timeout(60)
def test_1024_gpu_nccl_xml_imports():
    t = parse_text(Topology, nccl_xml(1024), "big.xml")
    assert t.num_gpus == 1024 and t.gpu_model(0) == "H100"
    assert t.path_bandwidth(0, 1023) == pytest.approx(18 * 25e9)


@pytest.mark.timeout(60)
def test_all_sys_matrix_is_refused_fast(tmp_path, capsys):
    path = tmp_path / "sys.txt"
    path.write_text(nvsmi_matrix(300, "SYS", numa="i"))
    code, out, err = cli(capsys, "topo", "show", str(path), "--json")
    assert code == 2 and out == "" and "NUMA nodes" in err


@pytest.mark.timeout(60)
def test_show_json_of_300_gpus_is_valid_json(tmp_path, capsys):
    path = tmp_path / "node.txt"
    path.write_text(nvsmi_matrix(300, "NODE"))
    code, out, _ = cli(capsys, "topo", "show", str(path), "--json")
    assert code == 0 and json.loads(out)["gpus"] == 300


@pytest.mark.timeout(20)
def test_show_json_refuses_a_huge_spec_before_building(capsys, monkeypatch):
    def no_build(*args, **kwargs):
        raise AssertionError("the graph was built")

    monkeypatch.setattr(Topology, "load", no_build)
    code, out, err = cli(capsys, "topo", "show", "dgx-h100:nodes=625", "--json")
    assert code == 2 and "5000 GPUs" in err


@pytest.mark.timeout(20)
def test_show_json_refuses_a_huge_json_file_before_building(tmp_path, capsys, monkeypatch):
    import treeattn.commands.topo as topo_cmd

    path = tmp_path / "t.json"
    path.write_text(Topology.from_spec("dgx-h100:nodes=2").to_json())
    monkeypatch.setattr(topo_cmd, "MAX_JSON_GPUS", 8)
    monkeypatch.setattr(Topology, "load", lambda *a, **k: pytest.fail("graph built"))
    code, _, err = cli(capsys, "topo", "show", str(path), "--json")
    assert code == 2 and "16 GPUs" in err


@pytest.mark.timeout(10)
@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "topo.txt"
    os.mkfifo(fifo)
    assert "not a regular file" in one_line_error(Topology.load, fifo)
    assert "not a regular file" in one_line_error(Topology.load, str(fifo), fmt="json")


@pytest.mark.timeout(10)
@pytest.mark.parametrize("device", ["/dev/zero", "/dev/urandom", "/dev/null"])
def test_device_file_is_refused(device):
    if not os.path.exists(device):
        pytest.skip(f"no {device}")
    assert "not a regular file" in one_line_error(Topology.load, device)


def _edited_json(**edge_attrs) -> str:
    data = json.loads(Topology.from_spec("local:ranks=2").to_json())
    data["links"][0].update(edge_attrs)
    return json.dumps(data)


@pytest.mark.timeout(20)
@pytest.mark.parametrize("attrs, needle", [
    ({"latency": 1e308}, "latency"),
    ({"latency": -1e-9}, "latency"),
    ({"bandwidth": 5e-324}, "bandwidth"),
    ({"bandwidth": 1e300}, "bandwidth"),
    ({"bandwidth": 10**400}, "bandwidth"),
    ({"latency": 10**400}, "latency"),
    ({"count": 10**400}, "count"),
    ({"weight": 10**400}, "weight"),
])
def test_out_of_range_edges_name_the_edge(attrs, needle):
    message = one_line_error(Topology.from_json, _edited_json(**attrs))
    assert needle in message and "->" in message


@pytest.mark.timeout(20)
@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e400", "1" * 5000])
def test_non_finite_or_overlong_json_numbers(literal):
    text = _edited_json(latency=0.5).replace('"latency": 0.5', f'"latency": {literal}')
    one_line_error(Topology.from_json, text)


@pytest.mark.timeout(20)
def test_json_output_is_strict(capsys):
    t = Topology.from_spec("local:ranks=2")
    t.graph.nodes["localhost/cpu0"]["note"] = float("inf")  # set behind validation's back
    with pytest.raises(ValueError):
        t.to_json()
    code, out, _ = cli(capsys, "topo", "show", "local:ranks=3", "--json")
    assert code == 0 and "Infinity" not in out and "NaN" not in out
    json.loads(out, parse_constant=lambda name: pytest.fail(name))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("source", [
    "dgx-h100", "mi300x", "pcie-4090:gpus=8", "nvsmi-8xa100-sxm40g-10nic.txt",
    "nvsmi-4xrtx3090-nv4-pairs-aikitoria-pr18.txt", "nccl-topo-ibmcloud-gx3d-8xh100-vsi.xml",
    "rccl-topo-8xmi250-gcd.xml", "rocmsmi-4xmi300a-apu-xgmi.txt", "NODE", "SYS", "PXB",
])
def test_fast_host_search_equals_networkx(source):
    """The fan-out-free search returns networkx's own paths (the router's old method)."""
    import networkx as nx
    from topo_inputs import FIX

    if source.isupper():  # a generated star: 24 GPUs, each pair `source` (dead-end bridges)
        t = parse_text(Topology, nvsmi_matrix(24, source, numa="0"), "star.txt")
    else:
        t = Topology.load(FIX / source if source.endswith((".txt", ".xml")) else source)
    router, host = t._router, t.hosts[0]
    ends = [n for n, d in t.graph.nodes(data=True)
            if d["host"] == host and d["kind"] in ("gpu", "cpu", "nic")]
    for x in ends:
        for y in ends:
            if x != y:
                try:
                    want = nx.dijkstra_path(t.graph, x, y, weight=router._weight(x, y))
                except nx.NetworkXNoPath:
                    want = None
                assert router._fast_search(x, y, host)[1] == want, (x, y)
