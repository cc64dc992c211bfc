"""The partial wire format: sizes by hand, each baseline on its engine's format, the refusal of
a format an algorithm cannot use, and the bf16 merge on the numpy reference (bit-identical
replicas, error within ``k · 2^-8 · max_i |o_i|``, see benchmarks/wire_format_error.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from treeattn.cli import main
from treeattn.schedule.algorithms import WireFormatRefused, build_schedule
from treeattn.schedule.ir import Collective, Send
from treeattn.schedule.payloads import shard_bounds
from treeattn.schedule.reference import execute, full_attention, partial, round_bf16
from treeattn.schedule.workload import DecodeWorkload
from treeattn.sim.files.export import schedule_from_json, schedule_to_json
from treeattn.sim.planning.planner import plan_workload as plan
from treeattn.topo import Topology

# Llama 3.1 8B, batch 1: 32 heads of 128
FP32_PARTIAL = 4 * 32 * 128 + 4 * 32  # 16512 B
BF16_PARTIAL = 2 * 32 * 128 + 4 * 32  # 8320 B: o in bf16, lse in fp32


def _moved(schedule) -> set[int]:
    return {s.nbytes for steps in schedule.steps for s in steps
            if isinstance(s, Send | Collective) and str(s.payload) == "partial"}


def test_partial_sizes_by_hand():
    assert DecodeWorkload("llama-3.1-8b", 1024).partial_bytes == FP32_PARTIAL
    assert DecodeWorkload("llama-3.1-8b", 1024, partial_dtype="bf16").partial_bytes \
        == BF16_PARTIAL
    # a chunk of 8 heads of 32: a quarter of each array
    w = DecodeWorkload("llama-3.1-8b", 1024, partial_dtype="bf16")
    assert w.chunk_bytes("partial", 4) == [BF16_PARTIAL // 4] * 4


def test_each_algorithm_moves_its_engines_format_by_default():
    topo = Topology.from_spec("dgx-h100")
    w = DecodeWorkload("llama-3.1-8b", 8192)
    helix = build_schedule("helix", topo, w)
    oneshot = build_schedule("oneshot", topo, w)
    tree = build_schedule("tree", topo, w)
    assert (helix.partial_dtype, oneshot.partial_dtype, tree.partial_dtype) == (
        "bf16", "bf16", "fp32")
    # the all-to-all's size is one rank's partial; the all-gather's the p partials
    assert BF16_PARTIAL in _moved(helix)
    assert _moved(oneshot) == {8 * BF16_PARTIAL}
    assert _moved(tree) == {FP32_PARTIAL}
    # an fp32 model's engine moves fp32 partials
    assert build_schedule("helix", topo, DecodeWorkload("debug", 64)).partial_dtype == "fp32"


def test_a_forced_format_applies_to_every_algorithm_and_to_plan_files():
    topo = Topology.from_spec("dgx-h100")
    w = DecodeWorkload("llama-3.1-8b", 8192, partial_dtype="bf16")
    for name in ("tree", "butterfly", "allgather", "oneshot", "helix"):
        schedule = build_schedule(name, topo, w)
        assert schedule.partial_dtype == "bf16" and _moved(schedule) <= {
            BF16_PARTIAL, 8 * BF16_PARTIAL}, name
    again = schedule_from_json(schedule_to_json(build_schedule("tree", topo, w)))
    assert again.partial_dtype == "bf16"
    fp32 = build_schedule("helix", topo, DecodeWorkload("llama-3.1-8b", 8192,
                                                        partial_dtype="fp32"))
    assert FP32_PARTIAL in _moved(fp32)


def test_bf16_on_an_algorithm_without_partials_is_refused():
    topo = Topology.from_spec("local:ranks=4")
    w = DecodeWorkload("debug", 64, partial_dtype="bf16")
    for name in ("allreduce3", "allreduce2", "ring"):
        with pytest.raises(WireFormatRefused):
            build_schedule(name, topo, w)
    chosen = plan(topo, w)
    assert set(chosen.refused) == {"allreduce3", "allreduce2", "ring"}
    assert chosen.algorithm not in chosen.refused


def test_run_refuses_bf16_on_ring_in_one_line(capsys):
    code = main(["run", "--nproc", "2", "--seq-len", "64", "--algorithm", "ring",
                 "--partial-dtype", "bf16"])
    err = capsys.readouterr()[1]
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1
    assert "ring" in err


def test_predict_prices_bf16_partials_cheaper(capsys):
    argv = ["predict", "--topology", "dgx-h100:nodes=2", "--model", "llama-3.1-8b",
            "--seq-len", "32k", "--json"]
    import json

    assert main(argv) == 0
    plain = {r["algorithm"]: r for r in json.loads(capsys.readouterr()[0])["rows"]}
    assert main([*argv, "--partial-dtype", "bf16"]) == 0
    bf16 = {r["algorithm"]: r for r in json.loads(capsys.readouterr()[0])["rows"]}
    assert bf16["tree"]["comm_bytes"] * FP32_PARTIAL == plain["tree"]["comm_bytes"] \
        * BF16_PARTIAL
    assert bf16["helix"]["latency_s"] == pytest.approx(plain["helix"]["latency_s"])


def test_round_bf16_is_round_to_nearest_even():
    # 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties go to the even significand (1)
    assert round_bf16(1 + 2 ** -8) == 1.0
    assert round_bf16(1 + 3 * 2 ** -8) == 1 + 2 ** -6  # halfway, up to the even one
    assert round_bf16(1 + 2 ** -8 + 2 ** -12) == 1 + 2 ** -7
    assert np.isneginf(round_bf16(-np.inf)) and round_bf16(0.0) == 0.0


# k: roundings on an output's longest path (benchmarks/wire_format_error.py)
ROUNDINGS = {"oneshot": lambda p: 1, "allgather": lambda p: 1, "helix": lambda p: 2,
             "butterfly": lambda p: math.ceil(math.log2(p)),
             "tree": lambda p: math.ceil(math.log2(p)) + 1}
IDENTICAL = ("tree", "helix", "dcp", "ring-passq", "oneshot")  # and the
# butterfly at powers of two


@settings(max_examples=15, deadline=None)
@given(world=st.integers(2, 4), seed=st.integers(0, 2 ** 16),
       algorithm=st.sampled_from(sorted(ROUNDINGS)))
def test_bf16_merge_stays_within_the_bound_and_replicas_agree(world, seed, algorithm):
    rng = np.random.default_rng(seed)
    heads, dim, tokens = 4, 16, 13
    q = rng.normal(size=(heads, dim)) * 3  # (H, D)
    k, v = rng.normal(size=(2, tokens, heads, dim))  # (T, H, D) each
    shards = [(k[a:b], v[a:b]) for a, b in shard_bounds(tokens, world)]
    topo = Topology.from_spec(f"local:ranks={world}")
    params = {"shape": "binomial"} if algorithm == "tree" else {}
    out = {dtype: [o for o, _ in execute(build_schedule(
        algorithm, topo, DecodeWorkload("debug", tokens, partial_dtype=dtype), **params),
        q, shards)] for dtype in ("fp32", "bf16")}
    exact = full_attention(q, k, v)[0]
    assert all(np.allclose(o, exact, atol=1e-12) for o in out["fp32"])
    largest = np.max(np.abs([partial(q, *s)[0] for s in shards]), axis=0)  # (H, D)
    bound = ROUNDINGS[algorithm](world) * 2.0 ** -8 * largest + 1e-12
    for o in out["bf16"]:
        assert np.all(np.abs(o - out["fp32"][0]) <= bound)
    if algorithm in IDENTICAL or (algorithm == "butterfly" and world & (world - 1) == 0):
        assert all(np.array_equal(o, out["bf16"][0]) for o in out["bf16"])


@pytest.mark.parametrize("extra", [("--token",), ("--prefill",)])
def test_whole_step_searches_refuse_the_wire_flag_in_one_line(capsys, extra):
    code = main(["predict", "--topology", "dgx-h100", "--model", "llama-3.1-8b", "--seq-len",
                 "4096", "--partial-dtype", "bf16", *extra])
    err = capsys.readouterr()[1]
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1
