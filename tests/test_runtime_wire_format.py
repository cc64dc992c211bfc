"""bf16 partials on real gloo ranks: each sender rounds what it moves and keeps the rounded
copy, so every rank ends with the same bits, within ``k · 2^-8 · max_i |o_i|`` of the fp32
run (``k`` the roundings on the longest path, see benchmarks/wire_format_error.py).

One process group per world size runs every case, as in test_runtime_exec.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from treeattn.kernels.reference import naive_attention
from treeattn.llm.verify import Case, CasesJob
from treeattn.runtime.launch import LaunchOptions, launch
from treeattn.runtime.plans import shard_offsets
from treeattn.runtime.wire import AttnDims, round_wire

B, HQ, HKV, D = 1, 4, 2, 8
LENGTHS = {2: (7, 3), 3: (6, 0, 5), 4: (9, 2, 5, 1)}
# algorithm -> roundings on the longest path for p ranks
ROUNDINGS = {"tree": lambda p: math.ceil(math.log2(p)) + 1,
             "butterfly": lambda p: math.ceil(math.log2(p)),
             "helix": lambda p: 2, "oneshot": lambda p: 1}
CASES = tuple(Case(a, {"shape": "binomial"} if a == "tree" else {}, partial_dtype=dtype)
              for a in ROUNDINGS for dtype in ("fp32", "bf16"))
_RESULTS: dict = {}


def _global(world: int):
    g = torch.Generator().manual_seed(7 + world)
    total = sum(LENGTHS[world])
    q = torch.randn(B, HQ, D, generator=g) * 3  # (B, Hq, D)
    k = torch.randn(B, HKV, total, D, generator=g)  # (B, Hkv, T, D)
    v = torch.randn(B, HKV, total, D, generator=g)  # (B, Hkv, T, D)
    return q, k, v


def _results(world: int):
    if world not in _RESULTS:
        q, k, v = _global(world)
        job = CasesJob(q, k, v, LENGTHS[world], CASES)
        _RESULTS[world] = launch(job, world, LaunchOptions(timeout_s=30, deadline_s=240))
    return _RESULTS[world]


def _largest_partial(world: int) -> torch.Tensor:
    """max over shards of |o_i|, elementwise (B, Hq, D)."""
    q, k, v = _global(world)
    starts = shard_offsets(list(LENGTHS[world]))
    out = torch.zeros(B, HQ, D)
    for start, n in zip(starts, LENGTHS[world], strict=True):
        if n:
            o, _ = naive_attention(q, k[:, :, start:start + n], v[:, :, start:start + n])
            out = torch.maximum(out, o.abs())
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("algorithm", sorted(ROUNDINGS))
def test_bf16_partials_agree_on_every_rank_within_the_bound(world, algorithm):
    results = _results(world)
    label = Case(algorithm, {"shape": "binomial"} if algorithm == "tree" else {}).label
    fp32 = results[label + "@fp32"]
    bf16 = results[label + "@bf16"]
    bound = ROUNDINGS[algorithm](world) * 2.0 ** -8 * _largest_partial(world) + 1e-5
    for o, _, _ in bf16:
        assert torch.all((o - fp32[0][0]).abs() <= bound)
    if algorithm != "oneshot" and not (algorithm == "butterfly" and world == 3):
        # oneshot (and the butterfly off powers of two) merge in each rank's own order
        assert all(torch.equal(o, bf16[0][0]) and torch.equal(lse, bf16[0][1])
                   for o, lse, _ in bf16)
    # the bf16 runs really rounded: the output differs from fp32's somewhere
    assert any(not torch.equal(o, f[0]) for (o, _, _), f in zip(bf16, fp32, strict=True))


def test_round_wire_rounds_only_the_heads_a_chunk_carries():
    dims = AttnDims(1, 4, 2, 8)
    flat = torch.randn(4 * 8 + 4) / 3  # o (1, 4, 8) then lse (1, 4)
    out = round_wire(flat, dims, "partial", (1, 2), "bf16")  # heads 2..3
    o, o_in = out[:32].view(4, 8), flat[:32].view(4, 8)
    assert torch.equal(o[:2], o_in[:2]) and torch.equal(out[32:], flat[32:])
    assert torch.equal(o[2:], o_in[2:].to(torch.bfloat16).float())
    assert round_wire(flat, dims, "partial", None, "fp32") is flat
    assert round_wire(flat[:4], dims, "max", None, "bf16") is not None  # not a partial
