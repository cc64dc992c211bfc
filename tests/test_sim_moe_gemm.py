"""A MoE layer's routed experts at decode: the bytes a step reads from them, the fused-MoE
rate they are read at (each generation's from one published table), and that rate against
the published fused-MoE calls it was not read from."""

from __future__ import annotations

import statistics

import pytest
from benchmark_module import load_benchmark

from treeattn.sim import ModelConfig
from treeattn.sim.deploy.capacity import (
    DENSE,
    EXPERTS,
    UNQUANTIZED,
    Split,
    layer_weights,
    step_weight_reads,
)
from treeattn.sim.deploy.token import predict_token
from treeattn.topo import Topology

H200 = Topology.from_spec("hgx-h200")


def _rows_rate(experts, topk, hidden, n, rows, kernels, datasheet):
    """Each published row's rate by hand: the touched experts' FP8 gate-up and down slices
    over the time less ``kernels`` × 2.4 µs, over the datasheet bandwidth."""
    rates = []
    for m, us in rows:
        touched = experts * (1 - (1 - topk / experts) ** m)
        rates.append(touched * 3 * hidden * n / (us * 1e-6 - kernels * 2.4e-6) / datasheet)
    return rates


def test_deepseek_v3_tp8_batch4_reads_each_touched_expert_once_by_hand():
    """DeepSeek-V3 at TP8 with FP8 weights, batch 4: an expert's slice on a rank is gate-up
    2 × 256 × 7168 plus down 7168 × 256 bytes; 4 tokens choosing 8 of 256 each touch
    256 × (1 − (248/256)^4) = 30.53 experts, each read once, on each of the 58 MoE layers;
    the router (7168 × 256) stays 16-bit, the shared expert is one more slice."""
    m = ModelConfig.from_name("deepseek-v3")
    slice_bytes = 2 * 256 * 7168 + 7168 * 256
    assert slice_bytes == 5_505_024
    touched = 256 * (1 - (248 / 256) ** 4)
    assert touched == pytest.approx(30.53, abs=0.01)
    reads = {name.replace(" (MoE layers)", ""): (count, nbytes, kind) for name, count, nbytes,
             _, kind in step_weight_reads(m, 8, 1.0, 4) if "(MoE layers)" in name}
    assert reads["routed experts"] == (58, pytest.approx(touched * slice_bytes), EXPERTS)
    assert reads["router"] == (58, 7168 * 256 * 2, UNQUANTIZED)
    assert reads["shared experts"] == (58, slice_bytes, DENSE)
    held = layer_weights(m, 8, 1.0, 1, moe=True)
    assert held.gemms[1][1] == 7168 * 256 * 2  # the router is held in 16 bits too


def test_hopper_moe_rate_is_the_median_of_vllm_36559s_rows():
    """vLLM PR #36559 on an H200: Qwen3-Next-80B FP8 at benchmark_moe.py's default TP2 (512
    experts, top 10, hidden 2048, N = 256), the PR kernel's times at M = 1-32; each less the
    8 kernels the token model charges that span (top-k, align, two quantisations, two GEMMs,
    SiLU·mul, sum) at 2.4 µs, of 4.8 TB/s; their median is the M = 8 row's 0.602."""
    from treeattn.sim.moe_gemm import MOE_GEMM_EFFICIENCY

    rows = ((1, 26.72), (2, 30.78), (4, 44.60), (8, 59.86), (16, 93.03), (24, 111.70),
            (32, 130.30))
    rates = _rows_rate(512, 10, 2048, 256, rows, 8, 4.8e12)
    assert statistics.median(rates) == pytest.approx(rates[3])
    assert MOE_GEMM_EFFICIENCY["float8"]["hopper"] == pytest.approx(rates[3], abs=0.0005)
    assert MOE_GEMM_EFFICIENCY["float8"]["hopper"] == pytest.approx(0.602, abs=0.001)


def test_blackwell_moe_rate_is_the_median_of_sglang_11816s_rows():
    """SGLang PR #11816 on a B200: DeepSeek-R1 at TP8 (257 experts with the shared one, top
    8, hidden 7168, N = 256), shipped configs, M = 1-24; each less SGLang's 7 kernels (its
    script runs the top-k outside the graph) at 2.4 µs, of 8.0 TB/s; median of six."""
    from treeattn.sim.moe_gemm import MOE_GEMM_EFFICIENCY

    rows = ((1, 52.65), (2, 60.35), (4, 79.09), (8, 95.47), (16, 138.68), (24, 175.80))
    rates = sorted(_rows_rate(257, 8, 7168, 256, rows, 7, 8.0e12))
    assert MOE_GEMM_EFFICIENCY["float8"]["blackwell"] == pytest.approx(
        (rates[2] + rates[3]) / 2, abs=0.0005)


def test_the_token_model_reads_fp8_experts_at_the_moe_rate(monkeypatch):
    """The same step with the experts at the dense FP8 rate (0.847 of 4.8 TB/s) is faster by
    exactly the 58 layers' expert bytes read at 0.602 instead; the shared expert and every
    other GEMM keep the dense rate; 16-bit experts and A100s have no MoE row."""
    import treeattn.sim.moe_gemm as moe_gemm
    from treeattn.sim.moe_gemm import expert_read_factor

    m = ModelConfig.from_name("deepseek-v3")
    fused = predict_token(H200, m, 5120, Split(8), batch=4, weights_dtype="float8")
    monkeypatch.setattr(moe_gemm, "MOE_GEMM_EFFICIENCY", {})
    dense = predict_token(H200, m, 5120, Split(8), batch=4, weights_dtype="float8")
    experts = 58 * 256 * (1 - (248 / 256) ** 4) * 5_505_024
    extra = experts / 4.8e12 * (1 / 0.602 - 1 / 0.847)
    assert fused.parts_s["weights"] - dense.parts_s["weights"] == pytest.approx(extra,
                                                                                 rel=0.01)
    assert extra > 0.9e-3  # about a millisecond of this step
    monkeypatch.undo()
    assert expert_read_factor("H200", "bfloat16") == 1.0
    assert expert_read_factor("A100", "float8") == 1.0


def test_fused_moe_prices_against_the_calls_it_was_not_read_from():
    """benchmarks/fidelity.py's MoE rows: the two source tables are listed, not scored, and
    their median rows come back within 1% (the Hopper M = 8 row; Blackwell's M = 4 and 8
    straddle it); the held-out H200 tables (vLLM #36559's DeepSeek-R1 at TP2, slices four
    times wider, priced slow; SGLang #11730's Qwen3-235B at TP8 on its default config, priced
    fast) are within a factor of 1.6 each and 30% on the geometric mean."""
    fidelity = load_benchmark("fidelity_kernels")
    points = [p for p in fidelity.score_kernels() if p.get("kind") == "moe"]
    sources = {"vllm-h200-fp8-moe-36559-qwen3next", "sglang-b200-fp8-moe-11816"}
    assert {p["table"] for p in points if not p["scored"]} == sources
    hopper = {p["m"]: p["ratio"] for p in points
              if p["table"] == "vllm-h200-fp8-moe-36559-qwen3next"}
    assert hopper[8] == pytest.approx(1.0, abs=0.01)
    blackwell = {p["m"]: p["ratio"] for p in points if p["table"] == "sglang-b200-fp8-moe-11816"}
    assert blackwell[4] < 1 < blackwell[8]
    scored = [p for p in points if p["scored"]]
    assert {p["table"] for p in scored} == {"vllm-h200-fp8-moe-36559-dsr1",
                                            "sglang-h200-fp8-moe-11730"}
    assert all(1 / 1.6 <= p["ratio"] <= 1.6 for p in scored)
    assert fidelity.geo_error([p["ratio"] for p in scored]) <= 0.30
    assert ("H200", "fp8 MoE") in {(g["gpu"], g["dtype"])
                                   for g in fidelity.kernel_summary(points)}
    assert "Fused-MoE calls" in fidelity.kernel_markdown(fidelity.score_kernels())


def test_sglang_runs_the_shared_expert_inside_the_fused_moe_by_hand():
    """DeepSeek-V3 at TP8, batch 4, FP8 weights on an H200, priced as SGLang runs it (shared
    experts fusion, on by default there): each of the 58 MoE layers launches no shared-expert
    gate-up GEMM, SiLU·mul, down GEMM or add, nor the FP8 quantisations before its two
    linears: 58 × (4 + 2) = 348 kernels fewer at 2.4 µs. vLLM's step: 3 per step, 61 MLA
    layers × (11 + 3 quantisations), 3 dense MLPs × (3 + 2), 58 MoE layers × (11 + 4) =
    1742 kernels; SGLang's 1394. The shared expert's slice (gate-up 2 × 256 × 7168 plus
    down 7168 × 256 FP8 bytes a rank) is read by the fused MoE instead of a dense GEMM:
    the same bytes, moved from the dense FP8 rate (0.847 of 4.8 TB/s) to the experts'
    (0.602); nothing else in the step changes."""
    from treeattn.sim.deploy.token import kernels_per_step

    m = ModelConfig.from_name("deepseek-v3")
    vllm = predict_token(H200, m, 5120, Split(8), batch=4, weights_dtype="float8")
    sglang = predict_token(H200, m, 5120, Split(8), batch=4, weights_dtype="float8",
                           engine="sglang")
    assert not vllm.extra["shared_experts_fused"] and sglang.extra["shared_experts_fused"]
    assert 3 + 61 * (11 + 3) + 3 * (3 + 2) + 58 * (11 + 4) == 1742
    assert kernels_per_step(m, "float8", "H200") == 1742
    assert kernels_per_step(m, "float8", "H200", fused_shared=True) == 1742 - 58 * 6
    assert kernels_per_step(m, "bfloat16", "H200", fused_shared=True) == (
        kernels_per_step(m) - 58 * 4)
    assert vllm.parts_s["kernels"] - sglang.parts_s["kernels"] == pytest.approx(348 * 2.4e-6)

    shared = 2 * 256 * 7168 + 7168 * 256
    touched = 256 * (1 - (248 / 256) ** 4)

    def by_kind(fused):
        out = {}
        for _, count, nbytes, _, kind in step_weight_reads(m, 8, 1.0, 4, fused):
            out[kind] = out.get(kind, 0.0) + count * nbytes
        return out

    plain, fused = by_kind(False), by_kind(True)
    assert fused[EXPERTS] - plain[EXPERTS] == pytest.approx(58 * shared)
    assert plain[DENSE] - fused[DENSE] == pytest.approx(58 * shared)
    assert fused[UNQUANTIZED] == plain[UNQUANTIZED]
    rows = {name: nbytes for name, _, nbytes, _, _ in step_weight_reads(m, 8, 1.0, 4, True)}
    assert rows["routed and shared experts (MoE layers)"] == pytest.approx(
        (touched + 1) * shared)
    assert "shared experts (MoE layers)" not in rows
    slower = 58 * shared / 4.8e12 * (1 / 0.602 - 1 / 0.847)
    assert sglang.parts_s["weights"] - vllm.parts_s["weights"] == pytest.approx(slower,
                                                                                 rel=0.01)
    for part in ("tp_all_reduce", "lm_head_gather", "attention"):
        assert sglang.parts_s[part] == vllm.parts_s[part]
    assert sglang.memory.weights_bytes == vllm.memory.weights_bytes  # the same bytes held


def test_the_engine_changes_nothing_where_sglang_does_not_fuse():
    """vLLM named is vLLM by default; a dense model has no shared expert; on a B200
    SGLang's default MoE runner for DeepSeek-V3 (FlashInfer's TRT-LLM MoE) turns the fusion
    off; an unknown engine is refused."""
    from treeattn.sim import SimError

    for topo, model in ((H200, "llama-3.1-70b"), (H200, "deepseek-v3"),
                        (Topology.from_spec("dgx-b200"), "deepseek-v3")):
        base = predict_token(topo, model, 4096, Split(8), batch=4, weights_dtype="float8")
        named = predict_token(topo, model, 4096, Split(8), batch=4, weights_dtype="float8",
                              engine="vllm")
        assert named.parts_s == base.parts_s
        if model != "deepseek-v3" or topo is not H200:
            sglang = predict_token(topo, model, 4096, Split(8), batch=4,
                                   weights_dtype="float8", engine="sglang")
            assert sglang.parts_s == base.parts_s
            assert not sglang.extra["shared_experts_fused"]
    with pytest.raises(SimError, match="unknown engine 'trtllm'"):
        predict_token(H200, "deepseek-v3", 4096, Split(8), engine="trtllm")
