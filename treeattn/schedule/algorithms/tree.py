"""``tree``: local partial, one pass of merges up a tree, then a broadcast down it.

Per rank ``v`` (children in the tree's reduce/broadcast order)::

    Compute("attention")
    for c in children: Recv(c, reduce=True); Merge(tag)        # up
    Send(parent)                                               # unless root
    Recv(parent, reduce=False)                                 # unless root: the result
    for c in children: Send(c)                                 # down

The same phase, with another payload and merge op, is the tree all-reduce inside
``allreduce3``. ``double_binary`` runs the phase on both trees of the pair, each carrying one
half of the payload (``chunk=(0, 2)`` and ``(1, 2)``): up A, up B, down A, down B.
"""

from __future__ import annotations

from treeattn.schedule.algorithms.trees import (
    TREE_SEARCHES,
    Tree,
    double_binary,
    hierarchical,
    simple_shape,
)
from treeattn.schedule.ir import Merge, Recv, Schedule, Send, Step, Tags
from treeattn.schedule.payloads import MergeOp, Payload, SimError
from treeattn.schedule.workload import DecodeWorkload


def reduce_phase(steps: list[list[Step]], tree: Tree, nbytes: int, tags: Tags,
                 payload: str = Payload.PARTIAL, op: str = MergeOp.PARTIAL,
                 chunk: tuple[int, int] | None = None) -> None:
    """Append the up pass (merge every subtree into the root) to each rank's steps."""
    up_tag = [tags(v, u) if u >= 0 else -1 for v, u in enumerate(tree.parent)]
    for v in range(tree.world):
        for c in tree.reduce_order(v):
            steps[v].append(Recv(c, nbytes, up_tag[c], payload, chunk, reduce=True))
            steps[v].append(Merge(3 * nbytes, op, up_tag[c]))
        if tree.parent[v] >= 0:
            steps[v].append(Send(tree.parent[v], nbytes, up_tag[v], payload, chunk))


def bcast_phase(steps: list[list[Step]], tree: Tree, nbytes: int, tags: Tags,
                payload: str = Payload.PARTIAL, chunk: tuple[int, int] | None = None) -> None:
    """Append the down pass (the root's buffer replaces everyone's) to each rank's steps."""
    for v in tree.pre_order:
        for c in tree.bcast_order(v):
            tag = tags(v, c)
            steps[v].append(Send(c, nbytes, tag, payload, chunk))
            steps[c].append(Recv(v, nbytes, tag, payload, chunk, reduce=False))


def allreduce_phase(steps, trees: list[Tree], workload: DecodeWorkload, tags: Tags,
                    payload: str = Payload.PARTIAL, op: str = MergeOp.PARTIAL) -> None:
    """Tree all-reduce of ``payload`` (one tree, or a double-binary pair split in halves)."""
    count = len(trees)
    sizes = workload.chunk_bytes(payload, count)
    chunks = [None] if count == 1 else [(i, count) for i in range(count)]
    for tree, size, chunk in zip(trees, sizes, chunks):
        reduce_phase(steps, tree, size, tags, payload, op, chunk)
    for tree, size, chunk in zip(trees, sizes, chunks):
        bcast_phase(steps, tree, size, tags, payload, chunk)


def make_trees(topology, shape: str, root: int = 0, k: int = 4, inner: str = "binomial",
               outer: str = "binomial", tree: Tree | None = None,
               message_bytes: float | None = None, backend=None) -> list[Tree]:
    """The tree (or double-binary pair) a ``tree`` schedule reduces over."""
    world = topology.num_gpus
    if tree is not None:
        if not isinstance(tree, Tree) or tree.world != world:
            raise SimError(f"tree must be a Tree over the topology's {world} ranks")
        return [tree]
    if not isinstance(root, int) or not 0 <= root < world:
        raise SimError(f"root {root} is not a rank of a {world}-GPU topology")
    if shape == "double_binary":
        return list(double_binary(world, root))
    if shape == "hierarchical":
        return [hierarchical(topology, root, inner, outer, k)]
    if shape == "searched":
        search = TREE_SEARCHES.get(shape)
        if search is None:  # only the simulator can price the messages the search compares
            raise SimError("the searched tree shape needs the simulator: import treeattn.sim")
        return [search(topology, root, backend, message_bytes)]
    return [simple_shape(shape, world, root, k)]


def build_tree(topology, workload: DecodeWorkload, shape: str = "binomial", root: int = 0,
               k: int = 4, **kw) -> Schedule:
    """Tree Attention over one tree shape (see the module docstring)."""
    world = topology.num_gpus
    shards = workload.shards(world)
    trees = make_trees(topology, shape, root, k, message_bytes=workload.partial_bytes, **kw)
    steps = [[workload.attention_step(shards[r])] for r in range(world)]
    allreduce_phase(steps, trees, workload, Tags())
    params = {"shape": trees[0].shape or shape, "root": trees[0].root, "k": k,
              "parent": list(trees[0].parent)}
    if len(trees) == 2:
        params["parent2"] = list(trees[1].parent)
        params["root2"] = trees[1].root
    for key in ("inner", "outer"):
        if key in kw:
            params[key] = kw[key]
    return Schedule("tree", steps, params)
