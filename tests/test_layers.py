"""The package layers and the import graph of ``treeattn``, read from the source with ``ast``.

Imports flow one way: ``topo -> schedule -> sim -> runtime -> llm -> commands`` (``kernels`` beside,
used by ``runtime`` and ``llm``; ``sweep`` on top of the planner). The CPU test bed
(``testbed``) builds on the layers it plugs into, and only the commands and the CLI import it.
Every import counts, at the top of a file or inside a function, and no two modules may import
each other, directly or round a longer loop.
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
import pytest

PACKAGE_ROOT = Path(__file__).resolve().parents[1] / "treeattn"
SHARED = {"errors", "treeattn"}  # treeattn.errors and treeattn/__init__: leaves anyone may use
# treeattn.atomic (atomic outputs) builds on errors; every layer but topo may write through it
# (topo imports nothing of ours: the commands hand it a temporary path instead).
WRITERS_LEAF = "atomic"
# treeattn.inputs (bounded reads, checked JSON fields of received files) is its reading twin.
READERS_LEAF = "inputs"
ANYTHING = {"topo", "schedule", "sim", "kernels", "runtime", "llm", "hf", "sweep", "commands",
            "cli", "testbed"}

# The packages a package may import (besides itself and SHARED). topo is the bottom layer.
ALLOWED = {
    "topo": set(),
    "schedule": {"topo"},  # the IR: steps, payloads, workload, generators
    "sim": {"topo", "schedule"},
    "kernels": set(),
    "runtime": {"topo", "schedule", "sim", "kernels"},
    "llm": {"topo", "schedule", "sim", "kernels", "runtime"},
    "hf": {"topo", "schedule", "sim", "kernels", "runtime"},  # transformers integration, beside llm
    "sweep": {"topo", "schedule", "sim"},
    # the CPU test bed: plugged in by the commands; nothing else imports it
    "testbed": {"topo", "schedule", "sim", "kernels", "runtime"},
    "commands": ANYTHING,
    "cli": ANYTHING,
    "__main__": {"cli"},  # `python -m treeattn`: the entry point, nothing but the CLI
    "errors": set(),
    "treeattn": set(),
    "atomic": set(),
    "inputs": set(),
}
# Allowed only inside a function, so importing the package does not pull them in.
ALLOWED_LAZILY = {"sweep": {"runtime"}}

def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE_ROOT.rglob("*.py"))}


def layer(module: str) -> str:
    """``treeattn.sim.engine`` -> ``sim``; ``treeattn.cli`` -> ``cli``; ``treeattn`` itself."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "treeattn"


def imports_of(module: str, path: Path, known: set[str]) -> list[tuple[str, bool, int]]:
    """Every ``treeattn`` module ``module`` imports: (target, at top level, line).

    ``from treeattn.kernels import triton_merge`` names a module, ``from treeattn.sim import
    plan`` names the package ``treeattn.sim``; relative imports are resolved against
    ``module``.
    """
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    top_level = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                       for a in node.names]
        else:
            continue
        for target in targets:
            if target == "treeattn" or target.startswith("treeattn."):
                while target not in known and "." in target:
                    target = target.rsplit(".", 1)[0]  # `import treeattn.x.y` of a name
                found.append((target, id(node) in top_level, node.lineno))
    return found


def import_graph() -> tuple[nx.DiGraph, list[tuple[str, str, bool, int]]]:
    """The module import graph, and every edge as (importer, imported, top level, line)."""
    modules = all_modules()
    graph, edges = nx.DiGraph(), []
    graph.add_nodes_from(modules)
    for module, path in modules.items():
        for target, top, line in imports_of(module, path, set(modules)):
            if target != module:
                graph.add_edge(module, target)
                edges.append((module, target, top, line))
    return graph, edges


def find_cycles(graph: nx.DiGraph) -> set[tuple[str, ...]]:
    """Every simple cycle, each rotated to start at its alphabetically first module.

    >>> find_cycles(nx.DiGraph([("b", "a"), ("a", "b"), ("a", "c")]))
    {('a', 'b')}
    """
    cycles = set()
    for cycle in nx.simple_cycles(graph):
        start = cycle.index(min(cycle))
        cycles.add(tuple(cycle[start:] + cycle[:start]))
    return cycles


def layer_violations(edges) -> list[str]:
    """The imports that break :data:`ALLOWED`, one readable line each."""
    bad = []
    for importer, imported, top, line in edges:
        src, dst = layer(importer), layer(imported)
        if src == dst or dst in SHARED or (
                dst in (WRITERS_LEAF, READERS_LEAF) and src != "topo"):
            continue
        if dst in ALLOWED[src] or (not top and dst in ALLOWED_LAZILY.get(src, set())):
            continue
        where = "at top level" if top else "in a function"
        bad.append(f"{importer}:{line} imports {imported} {where} ({src} may not use {dst})")
    return bad


def test_every_module_is_in_a_known_layer():
    assert {layer(m) for m in all_modules()} <= set(ALLOWED)


def test_imports_follow_the_layers():
    _, edges = import_graph()
    assert layer_violations(edges) == []


def test_shared_leaves_import_nothing_of_ours():
    _, edges = import_graph()
    assert [e for e in edges if layer(e[0]) in SHARED] == []


def test_no_import_cycles():
    graph, _ = import_graph()
    cycles = find_cycles(graph)
    assert sorted(cycles) == []


@pytest.mark.parametrize("start", ["treeattn.sim.engine", "treeattn.sim.planning.planner",
                                   "treeattn.runtime.executor", "treeattn.kernels"])
def test_the_gpu_path_reaches_no_test_bed_module(start):
    graph, _ = import_graph()
    assert sorted(m for m in nx.descendants(graph, start) if layer(m) == "testbed") == []


def test_the_executor_imports_no_simulator_module():
    graph, _ = import_graph()
    assert sorted(m for m in graph.successors("treeattn.runtime.executor")
                  if layer(m) == "sim") == []


def test_a_cycle_and_a_layer_break_are_caught():
    """The checks can fail: a fake graph with a loop, and runtime importing llm."""
    fake = nx.DiGraph([("treeattn.runtime.a", "treeattn.llm.b"),
                       ("treeattn.llm.b", "treeattn.llm.c"),
                       ("treeattn.llm.c", "treeattn.runtime.a")])
    assert find_cycles(fake) == {("treeattn.llm.b", "treeattn.llm.c", "treeattn.runtime.a")}
    bad = layer_violations([("treeattn.runtime.plans", "treeattn.llm.cache", False, 3),
                            ("treeattn.sweep.grid", "treeattn.runtime.measure.check", True, 9),
                            ("treeattn.sweep.grid", "treeattn.runtime.measure.check", False, 9)])
    assert len(bad) == 2
    assert "runtime may not use llm" in bad[0] and "at top level" in bad[1]


@pytest.mark.parametrize("source, expected", [
    ("from treeattn.kernels import triton_merge", "treeattn.kernels.triton_merge"),
    ("from treeattn.sim import plan", "treeattn.sim"),
    ("import treeattn.topo.routing", "treeattn.topo.routing"),
    ("from . import routing", "treeattn.topo.routing"),
])
def test_imports_are_resolved_to_modules(tmp_path, source, expected):
    path = tmp_path / "x.py"
    path.write_text(f"def f():\n    {source}\n")
    known = set(all_modules())
    assert imports_of("treeattn.topo.x", path, known) == [(expected, False, 2)]
