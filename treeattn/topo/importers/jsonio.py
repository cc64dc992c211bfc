"""JSON round trip of topology graphs (networkx node-link data, ``edges="links"``).

The reader does its own structural checks so that any malformed document ends in a
:class:`TopologyError` naming the problem, never a ``KeyError`` or ``TypeError``.
"""

from __future__ import annotations

import json
import math

import networkx as nx

from treeattn.topo.errors import TopologyError

FORMAT = "treeattn-topology/1"


def graph_to_json(graph: nx.DiGraph, name: str) -> str:
    """Serialise ``graph`` as node-link JSON with ``name`` and a format tag in ``graph``.

    >>> '"directed": true' in graph_to_json(nx.DiGraph(), "x")
    True
    """
    data = nx.node_link_data(graph, edges="links")
    data["graph"] = {**data.get("graph", {}), "name": name, "format": FORMAT}
    return json.dumps(data, indent=1, sort_keys=False, allow_nan=False)


def graph_from_json(text: str) -> tuple[nx.DiGraph, str]:
    """Parse node-link JSON into a DiGraph; return ``(graph, stored name)``.

    >>> g, name = graph_from_json(graph_to_json(nx.DiGraph([("a", "b")]), "t"))
    >>> name, list(g.edges)
    ('t', [('a', 'b')])
    """
    try:
        data = json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:  # ValueError: also over-long integers
        raise TopologyError(f"not valid JSON: {str(exc).splitlines()[0][:200]}") from None
    if not isinstance(data, dict) or not isinstance(data.get("nodes"), list):
        raise TopologyError("JSON is not a topology: expected an object with 'nodes' and 'links'")
    links = data.get("links", data.get("edges"))
    if not isinstance(links, list):
        raise TopologyError("JSON topology has no 'links' list")
    meta = data.get("graph") if isinstance(data.get("graph"), dict) else {}
    g = nx.DiGraph()
    for i, node in enumerate(data["nodes"]):
        _add_node(g, i, node)
    for i, link in enumerate(links):
        _add_link(g, i, link)
    if data.get("directed") is False:  # an undirected document: each link is full duplex
        for u, v, d in list(g.edges(data=True)):
            if not g.has_edge(v, u):
                g.add_edge(v, u, **d)
    name = meta.get("name") if isinstance(meta.get("name"), str) else ""
    return g, name


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


def _check_values(what: str, attrs: dict) -> None:
    """Attribute values must be JSON-writable again: finite floats, integers below 2**63."""
    stack = list(attrs.items())
    while stack:
        key, value = stack.pop()
        if isinstance(value, float) and not math.isfinite(value):
            raise TopologyError(f"{what}: {key} is {value!r} (too large or not finite)")
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 2**63:
            raise TopologyError(f"{what}: {key} is an integer of {len(str(value))} digits")
        if isinstance(value, dict):
            stack += [(f"{key}.{k}", v) for k, v in value.items()]
        elif isinstance(value, list):
            stack += [(f"{key}[{j}]", v) for j, v in enumerate(value)]


def _add_node(g: nx.DiGraph, i: int, node: object) -> None:
    if not isinstance(node, dict) or not isinstance(node.get("id"), str):
        raise TopologyError(f"JSON node #{i} has no string 'id'")
    name = node["id"]
    if name in g:
        raise TopologyError(f"duplicate node name {name!r}")
    attrs = {k: v for k, v in node.items() if k != "id"}
    _check_values(f"node {name}", attrs)
    g.add_node(name, **attrs)


def _add_link(g: nx.DiGraph, i: int, link: object) -> None:
    if not isinstance(link, dict):
        raise TopologyError(f"JSON link #{i} is not an object")
    u, v = link.get("source"), link.get("target")
    for end in (u, v):
        if not isinstance(end, str) or end not in g:
            raise TopologyError(f"JSON link #{i} refers to unknown node {end!r}")
    if g.has_edge(u, v):
        raise TopologyError(f"duplicate link {u} -> {v}")
    attrs = {k: val for k, val in link.items() if k not in ("source", "target")}
    _check_values(f"edge {u} -> {v}", attrs)
    g.add_edge(u, v, **attrs)
