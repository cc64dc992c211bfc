"""The engines' decode-kernel prices by GPU generation (treeattn.sim.decode_kernels) and the
per-generation HBM and FP8 rates of treeattn.sim.devices, each against its sourced figure."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from treeattn.schedule.workload import DecodeWorkload, ModelConfig
from treeattn.sim.decode_kernels import (
    CTA_STREAM_BPS,
    GRAPH_KERNEL_S,
    SM_COUNT,
    engine_decode_attention_s,
    engine_decode_grid,
    fa_num_splits,
)
from treeattn.sim.deploy.capacity import Split
from treeattn.sim.deploy.token import predict_token
from treeattn.sim.devices import (
    FP8_GEMM_EFFICIENCY,
    HARDWARE,
    MEMORY_EFFICIENCY,
    weight_read_factor,
)
from treeattn.topo import Topology


# -- the sourced rows, recomputed by hand from the published figures ----------------------
def test_hbm_efficiency_rows_are_their_published_figures():
    assert MEMORY_EFFICIENCY["A100"] == pytest.approx(1818.21 / 2039, abs=0.005)
    assert MEMORY_EFFICIENCY["MI300X"] == pytest.approx(3910.62 / 5300, abs=0.005)
    assert HARDWARE["A100"].memory_bandwidth_Bps == pytest.approx(2.039e12 * 0.89)


def test_blackwell_fp8_gemm_rate_is_vllms_sm100_rows():
    """N = 28672, K = 4096 FP8 GEMM alone at batch 1 and 16: 10.419067 and 167.030801
    TFLOP/s; bytes = N·K + batch·(N + K)·2, read in the published time less the one
    graph-replayed kernel's fixed cost the token model charges the GEMM on top (2.4 µs)."""
    n, k = 28672, 4096
    ratios = []
    for m, tflops in ((1, 10.419067), (16, 167.030801)):
        seconds = 2 * m * n * k / (tflops * 1e12)
        ratios.append((n * k + m * (n + k) * 2) / (seconds - 2.4e-6) / 8.0e12)
    assert 0.72 < sum(ratios) / 2 < 0.74  # 5833 and 5895 GB/s of 8.0 TB/s
    assert FP8_GEMM_EFFICIENCY["blackwell"] == pytest.approx(sum(ratios) / 2, abs=0.001)
    assert weight_read_factor("B200", "float8") == pytest.approx(0.75 / FP8_GEMM_EFFICIENCY[
        "blackwell"])


def test_graph_kernel_cost_is_the_h200_steps_fixed_part():
    """Two graph-replayed decode steps at T = 4k (16,777,216 bytes read at 0.9 × 4.8 TB/s),
    8.178 and 9.217 µs, two kernels each."""
    read = 16777216 / 4.32e12
    assert GRAPH_KERNEL_S["hopper"] == pytest.approx((8.178e-6 + 9.217e-6 - 2 * read) / 4,
                                                     abs=1e-8)
    assert HARDWARE["H200"].graph_kernel_s == GRAPH_KERNEL_S["hopper"]
    assert HARDWARE["B200"].graph_kernel_s == GRAPH_KERNEL_S["blackwell"]


def test_cta_rate_is_the_forced_grid_rows():
    assert CTA_STREAM_BPS == pytest.approx((3106.2e9 + 3338.0e9) / 2 / 64)


# -- the split heuristic, by hand ------------------------------------------------------------
def test_fa_split_heuristic_by_hand():
    # 1 CTA, 132 SMs, 32 N-blocks: efficiency s/132 peaks at s = 32; 85% of it first at 28
    assert fa_num_splits(1, 132, 32) == 28
    # 2 CTAs, 108 SMs, 1000 N-blocks, cap 32: 2s/108 peaks at 32 (0.593); 85%: s >= 27.2
    assert fa_num_splits(2, 108, 1000, max_splits=32) == 28
    assert fa_num_splits(4, 132, 4) == 1  # four N-blocks or fewer: never split
    assert fa_num_splits(106, 132, 1000) == 1  # 106 >= 0.8 × 132: the grid is full
    # batch 1, 1 KV head of 8 query heads at 128k under vLLM's cap: 28 CTAs and a combine
    grid = engine_decode_grid(1, 1, 8, 131072, "H100")
    assert (grid.ctas, grid.blocks, grid.kernels) == (28, 37, 2)  # ceil(1024 / 28) blocks
    # FA2 on an A100 (2 × 108 SMs counted), 32 N-blocks: efficiency s/216 is best at 32
    # splits; 85% of it needs 28 or more, and 28-31 leave 2 blocks a split as 27 does (not
    # eligible), so 32
    assert fa_num_splits(1, 216, 32, fa2=True) == 32
    assert engine_decode_grid(1, 1, 8, 4096, "A100").ctas == 32
    # FlashInfer on Blackwell and MI300X's kernels fill the GPU: no grid limit
    assert engine_decode_grid(1, 1, 8, 131072, "B200") is None
    assert engine_decode_grid(1, 1, 8, 131072, "MI300X") is None


def test_one_kv_head_at_batch_1_reads_at_its_ctas_rate():
    """Llama-3.1-70B on 8 H100s, batch 1, 128k: one KV head per GPU, 1024 N-blocks of 64 KiB
    of K+V over 28 CTAs, the longest walking 37 at 50.3 GB/s (1.3 TB/s of the model's 3.0),
    plus two kernels."""
    hw = HARDWARE["H100"]
    nbytes = 2 * 131072 * 128 * 2
    t = engine_decode_attention_s(hw, "H100", nbytes, nbytes, 0, batch=1, kv_heads=1,
                                  q_heads=8, context=131072)
    assert t == pytest.approx(37 * 65536 / CTA_STREAM_BPS + 2 * GRAPH_KERNEL_S["hopper"])
    assert t > 1.5 * hw.compute_time(nbytes)  # the slowdown the plain HBM model misses


def test_the_token_model_prices_few_kv_heads_slower_per_byte():
    topo = Topology.from_spec("dgx-h100")
    few = predict_token(topo, "llama-3.1-70b", 131072, Split(8))  # 1 KV head per GPU
    view = DecodeWorkload(ModelConfig.from_name("llama-3.1-70b"), 131072, batch=1)
    per_layer = view.kv_bytes(131072) / 8
    assert few.attention_layer_s > per_layer / HARDWARE["H100"].memory_bandwidth_Bps * 1.5


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(sorted(SM_COUNT)), st.integers(1, 4), st.integers(0, 5),
       st.integers(10, 18), st.sampled_from([1, 4, 8]))
def test_fewer_kv_heads_are_never_faster_at_the_same_bytes(gpu, batch, log_heads, log_ctx,
                                                           group):
    """Halving the KV heads per GPU and doubling the context reads the same bytes over a grid
    no larger, so it never takes less time. From 1k tokens up: FlashAttention never splits a
    KV head of 4 N-blocks or fewer (512 tokens), so there a wider, unsplit grid of short
    heads is slower than a split one of long heads, as the kernel runs."""
    hw = HARDWARE[gpu]
    heads, context = 2 ** log_heads, 2 ** log_ctx
    nbytes = 2 * batch * heads * context * 128 * 2

    def price(h, t):
        return engine_decode_attention_s(hw, gpu, nbytes, nbytes, 0, batch=batch, kv_heads=h,
                                         q_heads=h * group, context=t)

    wide = price(heads, context)
    if heads > 1:
        assert price(heads // 2, context * 2) >= wide * (1 - 1e-12)
    assert wide >= nbytes / hw.memory_bandwidth_Bps  # never faster than HBM


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(sorted(SM_COUNT)), st.integers(1, 8), st.integers(0, 4),
       st.integers(1024, 200_000), st.integers(1, 4096), st.sampled_from([1, 8, 16, 128]),
       st.booleans())
def test_a_longer_context_is_never_faster(gpu, batch, log_heads, context, more, group, mla):
    """From 1k tokens up, more cached tokens never take less time: the grid's critical path
    is whole N-blocks of its longest split, and the splits only grow with the blocks."""
    hw, heads = HARDWARE[gpu], 2 ** log_heads

    def price(t):
        nbytes = 2 * batch * heads * t * 256
        return engine_decode_attention_s(hw, gpu, nbytes, nbytes, 0, batch=batch,
                                         kv_heads=heads, q_heads=heads * group, context=t,
                                         mla=mla)

    assert price(context + more) >= price(context) * (1 - 1e-12)


def test_fa3_on_a_contiguous_cache_by_hand():
    """FlashAttention 3 on a contiguous cache (176-token N-blocks, its own cap of 128), batch
    1, 32 query / 4 KV heads, 1k tokens: 6 N-blocks, 4 CTAs before splitting; efficiency
    4s/132 is best at 6 splits and 85% of it needs 6, so 24 CTAs each walk one block of
    176 tokens × 512 B at 50.3 GB/s, plus a split kernel and its combine."""
    grid = engine_decode_grid(1, 4, 32, 1024, "H200", kernel="fa3")
    assert (grid.ctas, grid.blocks, grid.tokens, grid.kernels) == (24, 1, 176, 2)
    kv = 2 * 4 * 1024 * 128 * 2
    t = engine_decode_attention_s(HARDWARE["H200"], "H200", kv, kv, 0, batch=1, kv_heads=4,
                                  q_heads=32, context=1024, kernel="fa3")
    assert t == pytest.approx(176 * 512 / CTA_STREAM_BPS + 2 * GRAPH_KERNEL_S["hopper"])


def test_an_unknown_kernel_is_refused():
    from treeattn.schedule.payloads import SimError

    with pytest.raises(SimError, match="unknown decode kernel"):
        engine_decode_grid(1, 1, 8, 4096, "H200", kernel="xqa")
