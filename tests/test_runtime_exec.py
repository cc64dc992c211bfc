"""Every algorithm and tree shape, run for real on 2, 3 and 4 local ranks, equals
single-process attention on the full KV cache (global reference -> shard -> compare).

One process group is spawned per world size and runs all cases, to keep the suite fast.
"""

from __future__ import annotations

import pytest
import torch

from treeattn.kernels.reference import naive_attention
from treeattn.llm.verify import Case, CasesJob
from treeattn.runtime.launch import LaunchOptions, launch

TREE_SHAPES = ("chain", "flat", "binary", "binomial", "double_binary", "searched")
CASES = (
    *(Case("tree", {"shape": s}) for s in TREE_SHAPES),
    Case("tree", {"shape": "kary", "k": 3}),
    Case("tree", {"shape": "binomial", "root": 1}),
    Case("butterfly"),
    Case("allreduce3", {"inner": "ring"}),
    Case("allreduce3", {"inner": "tree"}),
    Case("allreduce3", {"inner": "tree"}, native=True),
    Case("allreduce3"),  # three library all-reduces
    Case("allreduce2"),
    Case("oneshot"),
    Case("helix"),  # all-to-all of head chunks (uneven at world 3: 4 heads), then a gather
    Case("dcp"),  # all-gather of LSEs, reduce-scatter of heads, then a gather
    Case("dcp", {"query_gather": True}),
    Case("allgather"),
    Case("ring"),
    Case("ring-passq"),  # B = 2 < p = 3, 4: dummy queries travel and are dropped
)
# Uneven shards, including an empty one (world 3) and the default-split remainder rule.
LENGTHS = {2: (7, 3), 3: (6, 0, 5), 4: (9, 2, 5, 1)}
B, HQ, HKV, D = 2, 4, 2, 8
# fp32 kernels against a float64 oracle: a few ulps of accumulated rounding over <= 17 keys.
# bf16: the inputs themselves carry 8 bits of mantissa (~4e-3 relative), so allow 2e-2.
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def _global(world: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(100 + world)
    total = sum(LENGTHS[world])
    q = torch.randn(B, HQ, D, generator=g).to(dtype)  # (B, Hq, D)
    k = torch.randn(B, HKV, total, D, generator=g).to(dtype)  # (B, Hkv, T, D)
    v = torch.randn(B, HKV, total, D, generator=g).to(dtype)  # (B, Hkv, T, D)
    return q, k, v


_RESULTS: dict = {}


def _results(world: int, dtype: torch.dtype):
    key = (world, dtype)
    if key not in _RESULTS:
        q, k, v = _global(world, dtype)
        job = CasesJob(q, k, v, LENGTHS[world], CASES)
        _RESULTS[key] = launch(job, world, LaunchOptions(timeout_s=30, deadline_s=240))
    return _RESULTS[key]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.label)
def test_every_rank_gets_the_single_process_result(world: int, case: Case) -> None:
    dtype = torch.float32
    q, k, v = _global(world, dtype)
    ref_o, ref_lse = naive_attention(q, k, v)  # (B, Hq, D), (B, Hq)
    outputs = _results(world, dtype)[case.label]
    assert len(outputs) == world
    for o, lse, _ in outputs:
        torch.testing.assert_close(o, ref_o, **TOL[dtype])
        torch.testing.assert_close(lse, ref_lse, **TOL[dtype])


@pytest.mark.timeout(300)
def test_bf16_cache_on_three_ranks() -> None:
    world, dtype = 3, torch.bfloat16
    q, k, v = _global(world, dtype)
    ref_o, ref_lse = naive_attention(q, k, v)
    for label, outputs in _results(world, dtype).items():
        for o, lse, _ in outputs:
            torch.testing.assert_close(o, ref_o, **TOL[dtype], msg=label)
            torch.testing.assert_close(lse, ref_lse, **TOL[dtype], msg=label)


@pytest.mark.timeout(300)
def test_tree_sends_one_partial_per_edge_and_ring_sends_kv() -> None:
    world = 4
    results = _results(world, torch.float32)
    partial_bytes = 4 * B * HQ * (D + 1)
    tree = [sent for _, _, sent in results["tree[shape=binary]"]]
    # reduce up and broadcast down a tree: 2 (p - 1) partial messages in all
    assert sum(tree) == 2 * (world - 1) * partial_bytes
    ring = [sent for _, _, sent in results["ring[]"]]
    kv_total = 2 * B * HKV * sum(LENGTHS[world]) * D * 4
    # each block travels p - 1 hops
    assert sum(ring) == (world - 1) * kv_total
