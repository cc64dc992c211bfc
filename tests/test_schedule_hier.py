"""``hier``: exact on the reference executor for any host layout, its groups counted by hand,
and the planner's use of it (a win on several DGX hosts, never inside one NVLink domain)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from treeattn.schedule.algorithms import BASELINES, OWN, SOURCES, build_schedule
from treeattn.schedule.algorithms.hier import ONE_HOST, ONE_PER_HOST, RAILS
from treeattn.schedule.ir import Collective, Merge
from treeattn.schedule.reference import execute
from treeattn.sim import DecodeWorkload, SimError
from treeattn.sim import plan_workload as plan
from treeattn.sim.network import CostModel
from treeattn.topo import Topology, TopologyError


class Layout:
    """What ``hier`` reads of a topology, for host layouts no builder makes (uneven hosts):
    ``hosts[h]`` lists the ranks of host ``h``."""

    def __init__(self, hosts: list[list[int]]) -> None:
        self.layout = hosts
        self.num_gpus = sum(len(h) for h in hosts)
        self.hosts = [f"h{i}" for i in range(len(hosts))]
        self._host = {r: f"h{i}" for i, ranks in enumerate(hosts) for r in ranks}

    def host_of(self, rank: int) -> str:
        return self._host[rank]


def attention64(q, k, v, hkv: int):
    """Single-process attention in float64, GQA by repeating each KV head over its group.
    q (Hq, D), k/v (T, Hkv, D) -> o (Hq, D), lse (Hq,)."""
    group = q.shape[0] // hkv
    k = np.repeat(k.astype(np.float64), group, axis=1)  # (T, Hq, D)
    v = np.repeat(v.astype(np.float64), group, axis=1)
    s = np.einsum("hd,thd->ht", q.astype(np.float64), k) / np.sqrt(q.shape[1])  # (Hq, T)
    m = s.max(axis=1, keepdims=True)
    w = np.exp(s - m)
    return np.einsum("ht,thd->hd", w / w.sum(axis=1, keepdims=True), v), \
        (m + np.log(w.sum(axis=1, keepdims=True)))[:, 0]


@st.composite
def layouts(draw):
    """A world of 2-8 ranks laid out as 1-4 hosts, hosts of any (uneven) sizes, and the
    ranks of a host contiguous or interleaved."""
    world = draw(st.integers(2, 8))
    hosts = draw(st.integers(1, min(4, world)))
    cuts = sorted(draw(st.lists(st.integers(1, world - 1), min_size=hosts - 1,
                                max_size=hosts - 1, unique=True)))
    sizes = [b - a for a, b in zip([0, *cuts], [*cuts, world])]
    order = draw(st.permutations(range(world)))
    out, at = [], 0
    for size in sizes:
        out.append(sorted(order[at:at + size]))
        at += size
    return out


@settings(max_examples=80, deadline=None)
@given(layout=layouts(), lengths=st.lists(st.integers(0, 5), min_size=8, max_size=8),
       batch=st.integers(1, 2), hkv=st.sampled_from([1, 2, 4]), seed=st.integers(0, 99),
       rail=st.sampled_from(RAILS))
def test_hier_equals_single_process_attention_fp32(layout, lengths, batch, hkv, seed, rail):
    topology = Layout(layout)
    world = topology.num_gpus
    lengths = lengths[:world]
    lengths[seed % world] += 1  # one token somewhere; the other shards may be empty
    w = DecodeWorkload("debug", sum(lengths), shard_lengths=tuple(lengths))
    schedule = build_schedule("hier", topology, w, rail=rail).validate()
    rng = np.random.default_rng(seed)
    heads, dim = 4, 8
    bounds = np.cumsum([0, *lengths])
    for _ in range(batch):  # the reference drops the batch axis: one sequence at a time
        q = rng.standard_normal((heads, dim)).astype(np.float32)  # (Hq, D)
        k = rng.standard_normal((sum(lengths), hkv, dim)).astype(np.float32)  # (T, Hkv, D)
        v = rng.standard_normal((sum(lengths), hkv, dim)).astype(np.float32)
        # the reference attends per query head: give it each head's KV head (GQA)
        k_q, v_q = (np.repeat(x, heads // hkv, axis=1) for x in (k, v))  # (T, Hq, D)
        shards = [(k_q[a:b], v_q[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
        want_o, want_lse = attention64(q, k, v, hkv)
        for o, lse in execute(schedule, q, shards):
            np.testing.assert_allclose(o, want_o, rtol=1e-6, atol=1e-6)
            np.testing.assert_allclose(lse, want_lse, rtol=1e-6, atol=1e-6)


def groups(schedule, rank: int) -> list[tuple[str, tuple[int, ...]]]:
    return [(str(s.op), s.group) for s in schedule.steps[rank] if isinstance(s, Collective)]


def test_two_dgx_hosts_node_then_rail_by_hand():
    topo = Topology.from_spec("dgx-h100:nodes=2")
    s = build_schedule("hier", topo, DecodeWorkload("llama-3.1-8b", 4096))
    assert groups(s, 3) == [("all_gather", tuple(range(8))), ("all_gather", (3, 11))]
    assert groups(s, 12) == [("all_gather", tuple(range(8, 16))), ("all_gather", (4, 12))]
    assert s.params == {"hosts": 2, "rails": 8, "gpus_per_host": [8]}
    pb = DecodeWorkload("llama-3.1-8b", 4096).partial_bytes
    node, rail = (x for x in s.steps[0] if isinstance(x, Collective))
    assert (node.nbytes, rail.nbytes) == (8 * pb, 2 * pb)  # nccl-tests' all-gather size


def test_uneven_hosts_rail_missing_a_gpu_broadcasts_by_hand():
    # hosts of 3 and 2 GPUs: rails over the 2 every host has; host 0's third GPU (rank 2)
    # gets the output from GPU 2 mod 2 = 0 of its host
    s = build_schedule("hier", Layout([[0, 1, 2], [3, 4]]), DecodeWorkload("debug", 10))
    assert groups(s, 0) == [("all_gather", (0, 1, 2)), ("all_gather", (0, 3)),
                            ("broadcast", (0, 2))]
    assert groups(s, 2) == [("all_gather", (0, 1, 2)), ("broadcast", (0, 2))]
    assert groups(s, 4) == [("all_gather", (3, 4)), ("all_gather", (1, 4))]
    assert s.params["broadcast_to"] == 1 and s.params["rails"] == 2


@pytest.mark.parametrize(("spec", "reason"), [("dgx-h100:nodes=1", ONE_HOST),
                                              ("local:ranks=4,hosts=4", ONE_PER_HOST)])
def test_degenerate_layouts_are_oneshot_and_say_so(spec, reason):
    topo = Topology.from_spec(spec)
    w = DecodeWorkload("llama-3.1-8b", 4096, partial_dtype="fp32")  # one format for both
    s = build_schedule("hier", topo, w)
    one = build_schedule("oneshot", topo, w)
    assert s.params["degenerate"] == reason
    def untagged(schedule):
        return [[dataclasses.replace(x, tag=None) if hasattr(x, "tag") else x for x in steps]
                for steps in schedule.steps]

    assert untagged(s) == untagged(one)  # the same collective and merge on every rank


def test_tp_groups_of_one_gpu_per_host_have_no_node_step():
    p = plan(Topology.from_spec("dgx-h100:nodes=4"),
             DecodeWorkload("llama-3.1-70b", 131072, tp=8), algorithms=("hier",))
    assert p.schedule.params["degenerate"] == ONE_PER_HOST
    assert [str(s.op) for s in p.schedule.steps[0] if isinstance(s, Collective)] == \
        ["all_gather"]


def test_registered_as_treeattns_own():
    assert "hier" in OWN and "hier" not in BASELINES and SOURCES["hier"].startswith("treeattn")


def test_host_layout_that_does_not_divide_the_ranks_is_refused():
    with pytest.raises(TopologyError, match="hosts=3 does not divide ranks=4"):
        Topology.from_spec("local:ranks=4,hosts=3")


def test_rail_all_gather_beats_the_two_all_reduces_it_replaces():
    """The rail step's all-gather against the all-reduce form (a max, then the packed sums)
    on the same rail, priced by NCCL's model: at decode sizes one collective wins."""
    topo = Topology.from_spec("dgx-h100:nodes=4")
    for batch in (1, 8, 64):
        w = DecodeWorkload("llama-3.1-70b", 131072, batch=batch)
        cm = CostModel(topo, w)
        rail = (0, 8, 16, 24)
        gather = cm.collective_time("all_gather", rail, 4 * w.partial_bytes)
        reduces = (cm.collective_time("all_reduce_max", rail, w.max_bytes)
                   + cm.collective_time("all_reduce_sum", rail, w.partial_bytes))
        assert gather < reduces, batch


@pytest.mark.parametrize("nodes", [4, 16])
def test_planner_picks_hier_on_several_dgx_hosts(nodes):
    p = plan(Topology.from_spec(f"dgx-h100:nodes={nodes}"),
             DecodeWorkload("llama-3.1-8b", 131072))  # fits each GPU at TP 1
    assert p.algorithm == "hier"
    assert p.latency_s < p.best_baseline().latency_s


@pytest.mark.parametrize("batch", [1, 8, 64])
def test_no_own_win_inside_one_nvlink_domain(batch):
    p = plan(Topology.from_spec("dgx-h100:nodes=1"),
             DecodeWorkload("llama-3.1-70b", 131072, batch=batch))
    assert p.algorithm in BASELINES
    assert all(c.algorithm != "hier" for c in p.candidates)  # degenerate: not a candidate


def test_merge_sizes_count_the_partials_read_and_written():
    w = DecodeWorkload("debug", 64)
    s = build_schedule("hier", Topology.from_spec("local:ranks=6,hosts=2"), w)
    merges = [m.nbytes for m in s.steps[0] if isinstance(m, Merge)]
    assert merges == [4 * w.partial_bytes, 3 * w.partial_bytes]  # 3 + 1, then 2 + 1


def test_plan_files_carry_hier_groups_and_roots():
    from treeattn.sim.files.export import schedule_from_json, schedule_to_json

    s = build_schedule("hier", Layout([[0, 1, 2], [3, 4]]), DecodeWorkload("debug", 10))
    back = schedule_from_json(schedule_to_json(s))
    assert back.steps == s.steps and back.algorithm == "hier"


def test_node_step_priced_one_sided_rail_step_on_nccl():
    p = plan(Topology.from_spec("dgx-h100:nodes=2"), DecodeWorkload("llama-3.1-8b", 131072))
    variants = {c.name: c for c in p.candidates if c.algorithm == "hier"}
    assert {"hier", "hier@symm_mem", "hier@nccl-symm"} <= set(variants)
    costs = variants["hier@symm_mem"].costs
    node, rail = tuple(range(8)), (0, 8)
    assert costs.one_sided("all_gather", node) and not costs.one_sided("all_gather", rail)
    # no other plan spans one NVLink domain here: none of them is offered a transport
    assert all(c.transport == "nccl" for c in p.candidates if c.algorithm != "hier")
    only_nccl = plan(Topology.from_spec("dgx-h100:nodes=2"),
                     DecodeWorkload("llama-3.1-8b", 131072), transports=("nccl",))
    assert {c.name for c in only_nccl.candidates if c.algorithm == "hier"} == \
        {"hier", "hier/all_reduce"}


def test_rail_as_all_reduces_by_hand_and_bad_rail_refused():
    s = build_schedule("hier", Topology.from_spec("local:ranks=4,hosts=2"),
                       DecodeWorkload("debug", 16), rail="all_reduce")
    assert groups(s, 1) == [("all_gather", (0, 1)), ("all_reduce_max", (1, 3)),
                            ("all_reduce_sum", (1, 3))]
    assert s.params["rail"] == "all_reduce"
    with pytest.raises(SimError, match="rail must be one of all_gather, all_reduce"):
        build_schedule("hier", Topology.from_spec("local:ranks=4,hosts=2"),
                       DecodeWorkload("debug", 16), rail="tree")
