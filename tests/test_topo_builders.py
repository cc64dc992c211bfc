"""Builders: counts, per-GPU bandwidth and routing rules, checked against hardware facts."""

from __future__ import annotations

import math

import networkx as nx
import numpy as np
import pytest

from treeattn.topo import LINK_KINDS, NODE_KINDS, GraphBuilder, Topology, TopologyError

GB = 1e9


def kinds_on(t: Topology, host: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for _, d in t.graph.nodes(data=True):
        if d["host"] == host and not d.get("logical"):
            out[d["kind"]] = out.get(d["kind"], 0) + 1
    return out


def route_nodes(route: list[tuple[str, str]]) -> list[str]:
    return [route[0][0]] + [v for _, v in route]


def test_every_node_and_edge_has_the_schema():
    t = Topology.from_spec("dgx-h100:nodes=2")
    for _, d in t.graph.nodes(data=True):
        assert d["kind"] in NODE_KINDS and isinstance(d["host"], str)
    for _, _, d in t.graph.edges(data=True):
        assert d["kind"] in LINK_KINDS and d["bandwidth"] > 0 and d["latency"] >= 0
        assert isinstance(d["count"], int) and d["count"] >= 1
    for u, v in t.graph.edges:  # full duplex: both directions, same figures
        assert t.edge(v, u)["bandwidth"] == t.edge(u, v)["bandwidth"]


def test_dgx_h100_counts_and_nvlink_sum():
    t = Topology.from_spec("dgx-h100:nodes=2")
    assert t.num_gpus == 16 and t.hosts == ["node0", "node1"]
    per_host = kinds_on(t, "node0")
    assert per_host["gpu"] == 8 and per_host["nvswitch"] == 4 and per_host["nic"] == 8
    assert per_host["cpu"] == 2 and per_host["pcie_switch"] >= 1
    for gpu in t.gpus:
        physical = [d for _, _, d in t.graph.out_edges(gpu, data=True)
                    if d["kind"] == "nvlink" and not d.get("logical")]
        assert sorted(d["count"] for d in physical) == [4, 4, 5, 5]  # 18 links, 5/4/4/5
        assert sum(d["bandwidth"] for d in physical) == pytest.approx(450 * GB)
        assert t.link_bandwidth_out(gpu) == pytest.approx(450 * GB)
    assert t.gpu_model(3) == "H100" and t.host_of(9) == "node1"
    assert all(t.edge(f"node0/nic{i}", f"rail{i}/leaf0")["bandwidth"] == 50 * GB for i in range(8))


def test_dgx_h100_intra_node_route_gets_full_gpu_bandwidth():
    t = Topology.from_spec("dgx-h100")
    for dst in range(1, 8):
        route = t.route(0, dst)
        assert [t.edge(*e)["kind"] for e in route] == ["nvlink", "nvlink"]
        assert t.graph.nodes[route[0][1]]["kind"] == "nvswitch"
        assert t.path_bandwidth(0, dst) == pytest.approx(450 * GB)
        assert t.path_latency(0, dst) == pytest.approx(0.6e-6)
        assert min(t.edge(*e)["bandwidth"] for e in route) == t.path_bandwidth(0, dst)


def test_dgx_cross_node_uses_rail_of_destination_via_pxn():
    t = Topology.from_spec("dgx-h100:nodes=2")
    same_rail = route_nodes(t.route(3, 8 + 3))
    assert "node0/nic3" in same_rail and "node1/nic3" in same_rail
    assert not any(t.graph.nodes[n]["kind"] == "cpu" for n in same_rail)
    cross = t.route(0, 8 + 5)  # rail 5: NVLink to GPU 5 first, then NIC 5
    nodes = route_nodes(cross)
    assert nodes[:3] == ["node0/gpu0", "node0/nvswitch", "node0/gpu5"]
    assert "node0/nic5" in nodes and "rail5/leaf0" in nodes and nodes[-1] == "node1/gpu5"
    assert t.path_bandwidth(0, 13) == pytest.approx(50 * GB)
    assert 2.7e-6 <= t.path_latency(0, 13) <= 5e-6


def test_dgx_large_cluster_has_spines_and_routes_through_them():
    t = Topology.from_spec("dgx-h100:nodes=65")  # more hosts than one 64-port leaf
    spines = [n for n, d in t.graph.nodes(data=True) if d.get("tier") == "spine"]
    assert spines
    far = t.route(0, 64 * 8)  # host 0 and host 64 sit on different leaves of rail 0
    tiers = [t.graph.nodes[n].get("tier") for n in route_nodes(far)]
    assert tiers.count("leaf") == 2 and tiers.count("spine") == 1
    assert t.path_latency(0, 64 * 8) <= 5e-6


def test_mi300x_full_mesh():
    t = Topology.from_spec("mi300x:nodes=2")
    assert t.num_gpus == 16
    assert t.links()["xgmi"] == 2 * 28  # 8 choose 2 per host
    for a in range(8):
        for b in range(8):
            if a != b:
                assert t.route(a, b) == [(t.gpus[a], t.gpus[b])]
                assert t.path_bandwidth(a, b) == pytest.approx(64 * GB)
    assert t.path_bandwidth(0, 9) == pytest.approx(50 * GB)


@pytest.mark.parametrize("gpus", [2, 4, 8])
def test_pcie_4090_goes_through_host_memory(gpus):
    t = Topology.from_spec(f"pcie-4090:gpus={gpus}")
    assert t.num_gpus == gpus and t.gpu_model(0) == "RTX4090"
    assert not any(d["kind"] in ("nvlink", "xgmi") for _, _, d in t.graph.edges(data=True))
    for a in range(gpus):
        for b in range(gpus):
            if a == b:
                continue
            nodes = route_nodes(t.route(a, b))
            assert any(t.graph.nodes[n]["kind"] == "cpu" for n in nodes[1:-1])
            assert t.path_bandwidth(a, b) <= 25 * GB + 1
    half = gpus // 2
    cross = route_nodes(t.route(0, half))  # other socket: crosses UPI, slower
    assert [t.graph.nodes[n]["kind"] for n in cross].count("cpu") == 2
    assert t.path_bandwidth(0, half) < 25 * GB
    if half > 1:
        assert t.path_bandwidth(0, 1) == pytest.approx(25 * GB)


def test_pcie_4090_multi_node_stages_through_host_memory_on_both_ends():
    t = Topology.from_spec("pcie-4090:gpus=4,nodes=2")
    kinds = [t.graph.nodes[n]["kind"] for n in route_nodes(t.route(0, 4))]
    assert kinds.count("cpu") >= 2 and "net_switch" in kinds


def test_local_builder():
    t = Topology.from_spec("local:ranks=4,latency=1e-5,bandwidth=2e9")
    assert t.num_gpus == 4 and t.hosts == ["localhost"] and t.gpu_model(2) == "cpu"
    for a in range(4):
        for b in range(4):
            if a != b:
                assert t.path_latency(a, b) == pytest.approx(1e-5)
                assert t.path_bandwidth(a, b) == pytest.approx(2e9)
                assert {t.edge(*e)["kind"] for e in t.route(a, b)} == {"loopback"}
    d = Topology.from_spec("local:ranks=2")
    assert d.path_latency(0, 1) == pytest.approx(20e-6) and d.path_bandwidth(0, 1) == 5e9


@pytest.mark.parametrize("spec", [
    "nope", "dgx-h100:nodes=0", "pcie-4090:gpus=3", "dgx-h100:nodes=x", "dgx-h100:foo=1",
    "dgx-h100:", "dgx-h100:nodes", "local:ranks=0", "local:latency=-1", "local:bandwidth=0",
    "local:bandwidth=inf", "", "mi300x:nodes=1,nodes=2", "dgx h100", "mi300x:nodes=-3",
])
def test_bad_specs_raise_topology_error(spec):
    with pytest.raises(TopologyError):
        Topology.from_spec(spec)


def test_unknown_gpu_refs():
    t = Topology.from_spec("mi300x")
    for ref in (8, -1, "node0/cpu0", "x"):
        with pytest.raises(TopologyError):
            t.route(0, ref)


def _two_gpus() -> GraphBuilder:
    b = GraphBuilder()
    b.node("h/gpu0", "gpu", "h", rank=0, model="H100")
    b.node("h/gpu1", "gpu", "h", rank=1, model="H100")
    return b


@pytest.mark.parametrize("mutate, needle", [
    (lambda g: g.remove_nodes_from(["h/gpu0", "h/gpu1"]), "no GPU"),
    (lambda g: g.remove_edge("h/gpu1", "h/gpu0"), "h/gpu"),
    (lambda g: g.edges["h/gpu0", "h/gpu1"].update(bandwidth=0.0), "h/gpu0 -> h/gpu1"),
    (lambda g: g.edges["h/gpu0", "h/gpu1"].update(bandwidth=-5.0), "bandwidth"),
    (lambda g: g.edges["h/gpu0", "h/gpu1"].update(latency=-1e-6), "latency"),
    (lambda g: g.edges["h/gpu0", "h/gpu1"].update(latency=math.nan), "latency"),
    (lambda g: g.edges["h/gpu0", "h/gpu1"].update(latency=math.inf), "latency"),
    (lambda g: g.edges["h/gpu0", "h/gpu1"].update(kind="carrier-pigeon"), "carrier-pigeon"),
    (lambda g: g.nodes["h/gpu1"].update(kind="tpu"), "h/gpu1"),
    (lambda g: g.nodes["h/gpu1"].update(rank=0), "h/gpu1"),
])
def test_validation_names_the_offender(mutate, needle):
    b = _two_gpus()
    b.link("h/gpu0", "h/gpu1", "nvlink", 25e9, 1e-6)
    mutate(b.graph)
    with pytest.raises(TopologyError, match=needle.replace("+", r"\+")):
        Topology(b.graph)


def test_disconnected_and_duplicate_names():
    b = _two_gpus()
    with pytest.raises(TopologyError, match="h/gpu1"):
        Topology(b.graph)
    with pytest.raises(TopologyError, match="duplicate"):
        b.node("h/gpu0", "gpu", "h", rank=2)
    b.link("h/gpu0", "h/gpu1", "pcie", 1e9, 0)
    with pytest.raises(TopologyError, match="duplicate"):
        b.link("h/gpu1", "h/gpu0", "pcie", 1e9, 0)


def test_matrices_match_routes_and_are_symmetric_here():
    t = Topology.from_spec("dgx-h100:nodes=3")
    lat, bw = t.latency_matrix(), t.bandwidth_matrix()
    p = t.num_gpus
    assert lat.shape == bw.shape == (p, p)
    assert np.all(np.diag(lat) == 0) and np.all(np.diag(bw) == 0)
    rng = np.random.default_rng(0)
    for a, b in rng.integers(0, p, size=(200, 2)):
        if a != b:
            assert lat[a, b] == pytest.approx(t.path_latency(int(a), int(b)), rel=1e-12)
            assert bw[a, b] == t.path_bandwidth(int(a), int(b))
    np.testing.assert_allclose(lat, lat.T)  # every route here mirrors its reverse
    host_lat, host_bw = t.intra_host_matrix("node1")
    np.testing.assert_array_equal(host_bw, bw[8:16, 8:16])
    pair_lat, _ = t.host_pair_matrix("node0", "node2")
    np.testing.assert_allclose(pair_lat, lat[0:8, 16:24])


def test_routes_are_cached_and_not_aliased():
    t = Topology.from_spec("dgx-h100:nodes=2")
    r = t.route(0, 12)
    r.clear()
    assert t.route(0, 12) and t.route(0, 12) == t.route("node0/gpu0", "node1/gpu4")


def test_graph_is_a_networkx_digraph():
    assert isinstance(Topology.from_spec("mi300x").graph, nx.DiGraph)


def test_forwarding_through_a_gpu_only_when_nothing_else_connects():
    b = GraphBuilder()
    for i in range(3):
        b.node(f"h/gpu{i}", "gpu", "h", rank=i, model="X")
    b.link("h/gpu0", "h/gpu1", "nvlink", 25e9, 1e-6)
    b.link("h/gpu1", "h/gpu2", "nvlink", 25e9, 1e-6)
    t = Topology(b.graph)
    assert route_nodes(t.route(0, 2)) == ["h/gpu0", "h/gpu1", "h/gpu2"]


def test_no_p2p_without_host_memory_is_refused_at_load():
    b = GraphBuilder()
    for i in range(2):
        b.node(f"h/gpu{i}", "gpu", "h", rank=i, model="RTX4090", p2p=False)
    b.node("h/pcie0", "pcie_switch", "h")
    b.link("h/gpu0", "h/pcie0", "pcie", 25e9, 1e-6)
    b.link("h/gpu1", "h/pcie0", "pcie", 25e9, 1e-6)
    with pytest.raises(TopologyError, match="cpu"):
        Topology(b.graph)


def test_undirected_json_and_wrong_graph_types():
    import json

    t = Topology.from_spec("local:ranks=3")
    data = json.loads(t.to_json())
    data["directed"] = False
    data["links"] = [link for link in data["links"] if link["source"] < link["target"]]
    assert Topology.from_json(json.dumps(data)) == t
    with pytest.raises(TopologyError, match="DiGraph"):
        Topology(nx.Graph(t.graph))
