"""Schedules: every generator validates, executes to exact attention, and validate() bites."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from treeattn.schedule.algorithms import ALGORITHM_NAMES
from treeattn.schedule.algorithms.trees import double_binary, hierarchical, simple_shape
from treeattn.schedule.ir import Collective, Compute, Merge, Recv, Schedule, Send
from treeattn.schedule.payloads import shard_bounds
from treeattn.schedule.reference import execute, full_attention
from treeattn.sim import DecodeWorkload, ScheduleError, build_schedule
from treeattn.topo import Topology

SHAPES = ("chain", "flat", "binary", "kary", "binomial", "double_binary", "hierarchical",
          "searched")
VARIANTS = [("tree", {"shape": s}) for s in SHAPES] + [
    ("butterfly", {}), ("allgather", {}), ("ring", {}),
    ("allreduce3", {"inner": "tree"}), ("allreduce3", {"inner": "ring"}),
    ("allreduce3", {"inner": "tree", "shape": "double_binary"}),
    ("allreduce3", {}), ("allreduce2", {}), ("oneshot", {}), ("helix", {}), ("dcp", {}),
    ("dcp", {"query_gather": True}), ("ring-passq", {}),
]


def local(p: int) -> Topology:
    return Topology.from_spec(f"local:ranks={p},latency=1e-6,bandwidth=1e9")


def shard_lengths(draw_lengths, p):
    return tuple(draw_lengths[:p]) + (0,) * max(0, p - len(draw_lengths))


@settings(max_examples=60, deadline=None)
@given(variant=st.sampled_from(VARIANTS), p=st.integers(2, 11), root=st.integers(0, 10),
       lengths=st.lists(st.integers(0, 6), min_size=11, max_size=11), seed=st.integers(0, 99),
       layout=st.sampled_from(["replicated", "head_sharded"]))
def test_every_schedule_validates_and_computes_exact_attention(variant, p, root, lengths, seed,
                                                               layout):
    algorithm, params = variant
    params = dict(params)
    if "shape" in params and algorithm == "tree":
        params["root"] = root % p
    lengths = list(lengths[:p])
    lengths[0] += 1  # at least one token somewhere
    w = DecodeWorkload("debug", sum(lengths), shard_lengths=tuple(lengths), layout=layout)
    schedule = build_schedule(algorithm, local(p), w, **params)
    schedule.validate()
    rng = np.random.default_rng(seed)
    heads, dim = w.model.n_heads, w.model.head_dim
    q = rng.standard_normal((heads, dim))  # (Hq, D)
    k = rng.standard_normal((w.seq_len, heads, dim))  # (T, H, D)
    v = rng.standard_normal((w.seq_len, heads, dim))
    bounds = np.cumsum([0] + lengths)
    shards = [(k[a:b], v[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
    want_o, want_lse = full_attention(q, k, v)
    for rank, (o, lse) in enumerate(execute(schedule, q, shards)):
        heads_of_rank = slice(None)
        if schedule.output_layout == "head_sharded":  # rank r holds head chunk (r, p)
            heads_of_rank = slice(*shard_bounds(heads, p)[rank])
        # fp64 throughout; merges reorder sums only
        np.testing.assert_allclose(o[heads_of_rank], want_o[heads_of_rank], rtol=1e-10,
                                   atol=1e-12)
        np.testing.assert_allclose(lse[heads_of_rank], want_lse[heads_of_rank], rtol=1e-10,
                                   atol=1e-12)


@settings(max_examples=40, deadline=None)
@given(algorithm=st.sampled_from(ALGORITHM_NAMES), p=st.integers(2, 64),
       batch=st.integers(1, 256), layout=st.sampled_from(["replicated", "head_sharded"]))
def test_every_algorithm_validates_for_any_world_and_batch(algorithm, p, batch, layout):
    w = DecodeWorkload("llama-3.1-8b", 4096, batch=batch, layout=layout)
    schedule = build_schedule(algorithm, local(p), w).validate()
    assert schedule.output_layout in ("replicated", layout)
    # only the head-scatter algorithms may leave heads sharded, and only when asked to
    if schedule.output_layout == "head_sharded":
        assert algorithm in ("helix", "dcp") and layout == "head_sharded"


def test_collective_validation_names_the_odd_rank():
    group = (0, 1, 2)
    good = Collective("all_reduce_max", group, 64, "max")
    odd = Collective("all_reduce_sum", group, 64, "max")
    steps = [[good], [good], [odd]]
    with pytest.raises(ScheduleError, match="rank 2 step 0: collective 0 of group"):
        Schedule("x", steps).validate()
    with pytest.raises(ScheduleError, match="rank 2 never reaches collective 0"):
        Schedule("x", [[good], [good], []]).validate()
    with pytest.raises(ScheduleError, match="not in"):
        Schedule("x", [[Collective("all_reduce_max", (1, 2), 64, "max")], [], []]).validate()
    with pytest.raises(ScheduleError, match="needs a tag"):
        Schedule("x", [[Collective("all_gather", (0,), 64)]]).validate()


@settings(max_examples=40, deadline=None)
@given(variant=st.sampled_from(VARIANTS), p=st.integers(2, 9), pick=st.integers(0, 10**6))
def test_validate_catches_a_removed_recv(variant, p, pick):
    """Remove any receive, or any rank's part in a collective: validate() must object."""
    algorithm, params = variant
    schedule = build_schedule(algorithm, local(p), DecodeWorkload("debug", 64), **params)
    recvs = [(r, i) for r, steps in enumerate(schedule.steps)
             for i, s in enumerate(steps) if isinstance(s, Recv | Collective)]
    r, i = recvs[pick % len(recvs)]
    steps = [list(s) for s in schedule.steps]
    del steps[r][i]
    with pytest.raises(ScheduleError):
        Schedule(schedule.algorithm, steps).validate()


def test_validate_names_size_mismatch_and_deadlock():
    bad_size = Schedule("x", [[Send(1, 8, 0)], [Recv(0, 16, 0, reduce=False)]])
    with pytest.raises(ScheduleError, match="rank 1 step 0"):
        bad_size.validate()
    deadlock = Schedule("x", [[Recv(1, 8, 0, reduce=False), Send(1, 8, 0)],
                              [Recv(0, 8, 0, reduce=False), Send(0, 8, 0)]])
    with pytest.raises(ScheduleError, match="deadlock: rank 0 step 0"):
        deadlock.validate()
    unmerged = Schedule("x", [[Send(1, 8, 0)], [Recv(0, 8, 0)]])
    with pytest.raises(ScheduleError, match="never merged"):
        unmerged.validate()
    bad_label = Schedule("x", [[Compute("nope")], []])
    with pytest.raises(ScheduleError, match="unknown compute label"):
        bad_label.validate()
    ok = Schedule("x", [[Compute("attention"), Send(1, 8, 0)],
                        [Compute("attention"), Recv(0, 8, 0), Merge(24, "partial", 0)]])
    assert ok.validate() is ok


@pytest.mark.parametrize("p", [2, 3, 5, 8, 13, 16])
def test_tree_shapes_depths(p):
    assert simple_shape("chain", p).depth == p - 1
    assert simple_shape("flat", p).depth == 1
    assert simple_shape("binomial", p).depth == max(bin(i).count("1") for i in range(p))
    assert simple_shape("binary", p).depth == (p).bit_length() - 1
    for shape in ("chain", "flat", "binary", "binomial"):
        for root in range(p):
            assert simple_shape(shape, p, root=root).root == root


@pytest.mark.parametrize("p", [4, 6, 8, 16])
def test_double_binary_trees_are_complementary(p):
    a, b = double_binary(p)
    inner_a = {v for v in range(p) if a.children[v]}
    inner_b = {v for v in range(p) if b.children[v]}
    # NCCL's property: the inner nodes of one tree are leaves of the other
    assert len(inner_a & inner_b) <= 1


def test_hierarchical_reduces_within_hosts_first():
    topo = Topology.from_spec("dgx-h100:nodes=3")
    tree = hierarchical(topo, root=9)
    for v in range(topo.num_gpus):
        u = tree.parent[v]
        if u >= 0 and topo.host_of(u) != topo.host_of(v):
            leaders = {9, 0, 16}  # the root, and the lowest rank of each other host
            assert v in leaders and u in leaders


def test_step_names_and_str():
    schedule = build_schedule("ring", local(3), DecodeWorkload("debug", 9))
    assert "Schedule(ring, world=3" in str(schedule)
    from treeattn.schedule.ir import step_name
    names = {step_name(s) for s in schedule.steps[0]}
    assert names == {"send", "recv", "attention", "attention_block", "merge:partial"}


def test_bad_parameters_are_sim_errors():
    from treeattn.sim import SimError
    topo = local(4)
    w = DecodeWorkload("debug", 64)
    with pytest.raises(SimError, match="unknown algorithm"):
        build_schedule("nope", topo, w)
    with pytest.raises(SimError, match="unknown parameter"):
        build_schedule("ring", topo, w, shape="chain")
    with pytest.raises(SimError, match="root 7"):
        build_schedule("tree", topo, w, root=7)
    with pytest.raises(SimError, match="unknown tree shape"):
        build_schedule("tree", topo, w, shape="star")
    with pytest.raises(SimError, match="smaller than the number of GPUs"):
        build_schedule("tree", topo, DecodeWorkload("debug", 3))
    frozen = dataclasses.replace(w, shard_lengths=(64, 0, 0))
    with pytest.raises(SimError, match="3 shard_lengths given for 4 ranks"):
        build_schedule("tree", topo, frozen)
