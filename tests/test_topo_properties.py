"""hypothesis properties of topologies: JSON round trip and route sanity on generated graphs."""

from __future__ import annotations

import json

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from treeattn.topo import GraphBuilder, Topology

bandwidths = st.floats(min_value=1e6, max_value=1e12, allow_nan=False)
latencies = st.floats(min_value=0.0, max_value=1e-3, allow_nan=False)


@st.composite
def clusters(draw) -> Topology:
    """Random small clusters: hosts of GPUs behind a CPU, random peer links and P2P flags,
    and one NIC per host on a shared leaf when there are several hosts."""
    b = GraphBuilder()
    n_hosts = draw(st.integers(1, 3))
    rank = 0
    for h in range(n_hosts):
        host = f"h{h}"
        b.node(f"{host}/cpu0", "cpu", host)
        nic = None
        if n_hosts > 1:
            nic = b.node(f"{host}/nic0", "nic", host, rail=0)
            b.link(nic, f"{host}/cpu0", "pcie", draw(bandwidths), draw(latencies))
        gpus = []
        for i in range(draw(st.integers(1, 4))):
            attrs = {"nic": nic} if nic else {}
            gpus.append(b.node(f"{host}/gpu{i}", "gpu", host, rank=rank, model="X",
                               p2p=draw(st.booleans()), **attrs))
            rank += 1
            b.link(gpus[-1], f"{host}/cpu0", "pcie", draw(bandwidths), draw(latencies))
        for i in range(len(gpus)):
            for j in range(i + 1, len(gpus)):
                if draw(st.booleans()):
                    kind = draw(st.sampled_from(["nvlink", "xgmi"]))
                    b.link(gpus[i], gpus[j], kind, draw(bandwidths), draw(latencies),
                           count=draw(st.integers(1, 18)))
    if n_hosts > 1:
        b.node("fabric/leaf0", "net_switch", "fabric")
        for h in range(n_hosts):
            b.link(f"h{h}/nic0", "fabric/leaf0", "ib", draw(bandwidths), draw(latencies))
    return Topology(b.graph, name="generated")


specs = st.one_of(
    st.builds(lambda n: f"dgx-h100:nodes={n}", st.integers(1, 3)),
    st.builds(lambda n: f"mi300x:nodes={n}", st.integers(1, 2)),
    st.builds(lambda g, n: f"pcie-4090:gpus={g},nodes={n}", st.sampled_from([2, 4, 8]),
              st.integers(1, 2)),
    st.builds(lambda r, lat, bw: f"local:ranks={r},latency={lat!r},bandwidth={bw!r}",
              st.integers(1, 6), latencies, bandwidths),
)


@settings(max_examples=40, deadline=None)
@given(clusters())
def test_json_round_trip_generated(t):
    back = Topology.from_json(t.to_json())
    assert back == t and back.name == t.name and back.gpus == t.gpus
    json.loads(t.to_json())  # plain JSON, no NaN/Infinity tokens
    np.testing.assert_array_equal(back.latency_matrix(), t.latency_matrix())


@settings(max_examples=15, deadline=None)
@given(specs)
def test_json_round_trip_builders(spec):
    t = Topology.from_spec(spec)
    back = Topology.from_json(t.to_json())
    assert back == t
    assert back.route(0, t.num_gpus - 1) == t.route(0, t.num_gpus - 1)


@settings(max_examples=40, deadline=None)
@given(clusters(), st.data())
def test_route_is_a_path_and_latency_dominates_each_edge(t, data):
    a = data.draw(st.integers(0, t.num_gpus - 1))
    b = data.draw(st.integers(0, t.num_gpus - 1))
    route = t.route(a, b)
    if a == b:
        assert route == [] and t.path_latency(a, b) == 0 and t.path_bandwidth(a, b) == 0
        return
    assert route[0][0] == t.gpus[a] and route[-1][1] == t.gpus[b]
    assert all(u2 == v1 for (_, v1), (u2, _) in zip(route, route[1:], strict=False))
    for u, v in route:
        assert t.path_latency(a, b) >= t.edge(u, v)["latency"]
        assert t.path_bandwidth(a, b) <= t.edge(u, v)["bandwidth"]
    inner = [t.graph.nodes[n]["kind"] for _, n in route[:-1]]
    assert "gpu" not in inner or t.host_of(a) != t.host_of(b)  # same host: no GPU in between
    if not (t.graph.nodes[t.gpus[a]]["p2p"] and t.graph.nodes[t.gpus[b]]["p2p"]):
        direct = t.graph.has_edge(t.gpus[a], t.gpus[b])
        assert direct or "cpu" in inner  # no P2P: through host memory


@settings(max_examples=25, deadline=None)
@given(clusters())
def test_matrices_agree_with_routes(t):
    lat, bw = t.latency_matrix(), t.bandwidth_matrix()
    for a in range(t.num_gpus):
        for b in range(t.num_gpus):
            assert abs(lat[a, b] - t.path_latency(a, b)) <= 1e-12 * max(lat[a, b], 1e-9)
            assert bw[a, b] == t.path_bandwidth(a, b)


@settings(max_examples=10, deadline=None)
@given(specs)
def test_route_latency_dominates_each_edge_on_builders(spec):
    t = Topology.from_spec(spec)
    for b in range(t.num_gpus):
        route = t.route(0, b)
        assert all(t.path_latency(0, b) >= t.edge(*e)["latency"] for e in route)
