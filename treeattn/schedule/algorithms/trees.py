"""Reduction tree shapes over the ranks of a topology.

A :class:`Tree` is a root plus a parent array (``parent[root] == -1``). The shape builders
lay ranks out in an ``order`` whose first element is the root (by default the ranks rotated
to start at the root: ``root, root+1, …, root-1``) and connect positions:

* ``chain``: position i's parent is i − 1 (depth p − 1);
* ``flat``: every rank is a child of the root (a star, depth 1);
* ``kary`` (``binary`` is k = 2): heap layout, parent of i is (i − 1) // k;
* ``binomial``: parent of i is i with its lowest set bit cleared (depth ≤ ⌈log2 p⌉);
* ``double_binary``: NCCL's pair of in-order binary trees, the second mirrored (even p) or
  shifted by one (odd p), so most inner nodes of one tree are leaves of the other. Each tree
  carries half of the payload (see :mod:`treeattn.schedule.algorithms.tree`);
* ``hierarchical``: a tree inside each host rooted at a host leader (the root on its own
  host, the lowest rank elsewhere), and a tree across the leaders;
* ``searched``: the greedy Fastest-Node-First tree, below.

Children are visited in a fixed order: a reduce receives from the shallowest subtree first,
a broadcast sends to the deepest subtree first (both ties by rank).

The ``searched`` tree: a greedy Fastest-Node-First construction from the topology matrices.

Cost of one partial message from ``u`` to ``v``: ``C[u, v] = send_s + latency[u, v] +
partial_bytes / bandwidth[u, v] + recv_s`` (topology all-pairs matrices plus the backend's
overheads), plus the merge the receiver does.

We build the *broadcast* tree greedily and run the reduce on its mirror image: a reduction
up a tree, played backwards in time, is a broadcast down the same tree with the same costs
(the links are full duplex and symmetric), so a tree that broadcasts fast also reduces fast.

Fastest Node First (after Banikazemi, Moorthy & Panda, ICPP 1998): every rank that already
has the result is *informed* and becomes free to send at ``ready[u]``. Repeatedly pick the
(informed ``u``, uninformed ``v``) pair whose delivery ``ready[u] + C[u, v]`` is earliest,
make ``u`` the parent of ``v``, charge ``u`` the time one more child costs it and set
``ready[v]`` to the delivery time. A child costs its parent a send overhead on the way down
and, on the way up, a receive overhead plus one merge, both serial at the parent; charging
only the send would make a flat star look free on fabrics with cheap sends. On a flat fabric
this grows a binomial-like tree; on a hierarchical one it first covers a host over its fast
links, then reaches across the slow links from many informed ranks in parallel.
Best-candidate times are kept in a vector and refreshed lazily when the chosen sender's
``ready`` has moved (``ready`` only grows, so a stale entry is too low, never too high), so
a step costs O(p) and the
whole construction O(p²) with numpy; the planner only searches up to a few hundred ranks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from treeattn.schedule.payloads import SimError

SHAPES = ("chain", "flat", "binary", "kary", "binomial", "double_binary", "hierarchical",
          "searched")


@dataclass(frozen=True)
class Tree:
    """A rooted spanning tree over ranks ``0 … p−1``.

    Examples
    --------
    >>> t = binomial(4)
    >>> t.parent
    (-1, 0, 0, 2)
    >>> t.depth
    2
    >>> print(t.ascii())
    0
    ├── 2
    │   └── 3
    └── 1
    """

    root: int
    parent: tuple[int, ...]
    shape: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "parent", tuple(int(x) for x in self.parent))
        p = len(self.parent)
        if not 0 <= self.root < p:
            raise SimError(f"tree root {self.root} is not one of the tree's {p} ranks")
        if self.parent[self.root] != -1:
            roots = [v for v, u in enumerate(self.parent) if u == -1][:4]
            raise SimError(f"tree root {self.root} has parent {self.parent[self.root]}: the "
                           f"root's parent must be -1 (ranks with parent -1: "
                           f"{roots or 'none'})")
        for v, u in enumerate(self.parent):
            if v != self.root and not 0 <= u < p:
                raise SimError(f"tree: rank {v} has invalid parent {u}")
        if len(self.pre_order) != p:
            raise SimError("tree: parent array has a cycle or more than one root")

    @property
    def world(self) -> int:
        return len(self.parent)

    @cached_property
    def children(self) -> tuple[tuple[int, ...], ...]:
        kids: list[list[int]] = [[] for _ in self.parent]
        for v, u in enumerate(self.parent):
            if u >= 0:
                kids[u].append(v)
        return tuple(tuple(k) for k in kids)

    @cached_property
    def pre_order(self) -> tuple[int, ...]:
        """Root first, every parent before its children (iterative, no recursion limit)."""
        order, stack, seen = [], [self.root], set()
        while stack:
            v = stack.pop()
            if v in seen:
                break
            seen.add(v)
            order.append(v)
            stack.extend(reversed(self.children[v]))
        return tuple(order)

    @cached_property
    def heights(self) -> tuple[int, ...]:
        """Height of each rank's subtree (a leaf has height 0)."""
        h = [0] * self.world
        for v in reversed(self.pre_order):
            if self.parent[v] >= 0:
                h[self.parent[v]] = max(h[self.parent[v]], h[v] + 1)
        return tuple(h)

    @property
    def depth(self) -> int:
        return self.heights[self.root]

    def reduce_order(self, v: int) -> list[int]:
        """The order in which ``v`` receives its children's partials."""
        return sorted(self.children[v], key=lambda c: (self.heights[c], c))

    def bcast_order(self, v: int) -> list[int]:
        """The order in which ``v`` sends the result to its children."""
        return sorted(self.children[v], key=lambda c: (-self.heights[c], c))

    def to_dict(self) -> dict:
        return {"root": self.root, "parent": list(self.parent)}

    def ascii(self, max_lines: int = 40) -> str:
        """ASCII art, children in broadcast order; long trees are cut after ``max_lines``."""
        lines: list[str] = []
        stack: list[tuple[int, str, str]] = [(self.root, "", "")]
        while stack and len(lines) < max_lines:
            v, lead, child_lead = stack.pop()
            lines.append(f"{lead}{v}")
            kids = self.bcast_order(v)
            for i, c in reversed(list(enumerate(kids))):
                last = i == len(kids) - 1
                stack.append((c, child_lead + ("└── " if last else "├── "),
                              child_lead + ("    " if last else "│   ")))
        if len(lines) < self.world:
            lines.append(f"… ({self.world - len(lines)} more ranks)")
        return "\n".join(lines)


def rotated(world: int, root: int) -> list[int]:
    """Ranks starting at ``root``: ``root, root+1, …, root−1``."""
    return [(root + i) % world for i in range(world)]


def _from_positions(order: list[int], parent_pos, shape: str) -> Tree:
    parent = [-1] * len(order)
    for i in range(1, len(order)):
        parent[order[i]] = order[parent_pos(i)]
    return Tree(order[0], tuple(parent), shape)


def chain(world: int, root: int = 0, order: list[int] | None = None) -> Tree:
    return _from_positions(order or rotated(world, root), lambda i: i - 1, "chain")


def flat(world: int, root: int = 0, order: list[int] | None = None) -> Tree:
    return _from_positions(order or rotated(world, root), lambda i: 0, "flat")


def kary(world: int, root: int = 0, k: int = 2, order: list[int] | None = None) -> Tree:
    if k < 1:
        raise SimError(f"k-ary tree needs k >= 1, got {k}")
    shape = "binary" if k == 2 else f"kary{k}"
    return _from_positions(order or rotated(world, root), lambda i: (i - 1) // k, shape)


def binomial(world: int, root: int = 0, order: list[int] | None = None) -> Tree:
    return _from_positions(order or rotated(world, root), lambda i: i & (i - 1), "binomial")


def _btree_parent(i: int, n: int) -> int:
    """Parent of position ``i`` in the in-order binary tree by lowest set bit (root 0).

    Position ``i`` with lowest set bit ``b`` hangs under ``(i ^ b) | 2b`` when that exists,
    else under ``i ^ b``; odd positions are the leaves, even ones the inner nodes.
    """
    bit = i & -i
    up = (i ^ bit) | (bit << 1)
    return up if up < n else i ^ bit


def double_binary(world: int, root: int = 0) -> tuple[Tree, Tree]:
    """NCCL-style pair of complementary in-order binary trees; the first is rooted at ``root``.

    Tree A places position ``i`` on rank ``(i + root) % p``; tree B mirrors the positions
    (``p − 1 − i``) when p is even and shifts them by one when p is odd, so the inner nodes
    (even positions) of one tree are leaves of the other.

    >>> a, b = double_binary(8)
    >>> a.root, b.root
    (0, 7)
    """
    if world % 2 == 0:
        second = [world - 1 - i for i in range(world)]  # mirror
    else:
        second = [(i + 1) % world for i in range(world)]  # shift by one
    trees = []
    for place in (list(range(world)), second):
        parent = [-1] * world
        for i in range(1, world):
            parent[(place[i] + root) % world] = (place[_btree_parent(i, world)] + root) % world
        trees.append(Tree((place[0] + root) % world, tuple(parent), "double_binary"))
    return trees[0], trees[1]


def hierarchical(topology, root: int = 0, inner: str = "binomial", outer: str = "binomial",
                 k: int = 4) -> Tree:
    """Reduce inside each host to a leader, then across the leaders; ``root`` is the top.

    ``inner`` and ``outer`` are any of chain, flat, binary, kary, binomial.
    """
    world = topology.num_gpus
    groups: dict[object, list[int]] = {}
    for r in range(world):
        groups.setdefault(topology.host_of(r), []).append(r)
    parent = [-1] * world
    leaders = []
    for members in groups.values():
        leader = root if root in members else members[0]
        leaders.append(leader)
        order = [leader] + [r for r in members if r != leader]
        _graft(parent, simple_shape(inner, len(order), k=k), order)
    top = [root] + sorted(x for x in leaders if x != root)
    _graft(parent, simple_shape(outer, len(top), k=k), top)
    return Tree(root, tuple(parent), "hierarchical")


def _graft(parent: list[int], positional: Tree, order: list[int]) -> None:
    for i, up in enumerate(positional.parent):
        if up >= 0:
            parent[order[i]] = order[up]


def simple_shape(shape: str, world: int, root: int = 0, k: int = 2,
                 order: list[int] | None = None) -> Tree:
    """One of the topology-free shapes by name."""
    if shape == "chain":
        return chain(world, root, order)
    if shape == "flat":
        return flat(world, root, order)
    if shape == "binary":
        return kary(world, root, 2, order)
    if shape == "kary":
        return kary(world, root, k, order)
    if shape == "binomial":
        return binomial(world, root, order)
    raise SimError(f"unknown tree shape {shape!r} (known: {', '.join(SHAPES)})")


# -- the searched tree -------------------------------------------------------------------

# Cost-based tree searches by shape name. The IR has no cost model, so the layer that prices
# messages registers its search here (:mod:`treeattn.sim.tree_search` adds ``searched``).
TREE_SEARCHES: dict[str, Callable[..., Tree]] = {}


def fnf_tree(cost: np.ndarray, root: int, per_child_s: float) -> Tree:
    """Greedy Fastest-Node-First broadcast tree over the cost matrix (see module docstring).

    ``per_child_s`` is how long each extra child keeps its parent busy.

    >>> cost = np.full((4, 4), 1.0); np.fill_diagonal(cost, np.inf)
    >>> fnf_tree(cost, 0, per_child_s=1.0).parent   # uniform fabric: binomial-like
    (-1, 0, 0, 1)
    >>> fnf_tree(cost, 0, per_child_s=0.0).parent   # children free for the parent: a star
    (-1, 0, 0, 0)
    """
    p = cost.shape[0]
    parent = np.full(p, -1)
    ready = np.full(p, np.inf)
    ready[root] = 0.0
    informed = np.zeros(p, dtype=bool)
    informed[root] = True
    best = cost[root].copy()
    best[root] = np.inf
    source = np.full(p, root)
    for _ in range(p - 1):
        while True:
            v = int(np.argmin(np.where(informed, np.inf, best)))
            u = int(source[v])
            if best[v] >= ready[u] + cost[u, v] - 1e-15:  # up to date: stale ones are low
                break
            times = np.where(informed, ready + cost[:, v], np.inf)
            source[v] = int(np.argmin(times))
            best[v] = times[source[v]]
        parent[v] = u
        informed[v] = True
        ready[v] = best[v]
        ready[u] += per_child_s
        improved = ready[v] + cost[v] < best
        best = np.where(improved, ready[v] + cost[v], best)
        source = np.where(improved, v, source)
    return Tree(root, tuple(int(x) for x in parent), "searched")
