"""The routed experts of a MoE layer at decode: the rate the engines' fused-MoE kernels read
the experts' weights at, from published kernel timings.

At decode the engines run a MoE layer's routed experts as one fused kernel per expert GEMM
(vLLM's and SGLang's Triton ``fused_moe``, FP8 weights in 128 × 128 blocks): the step's
tokens are sorted by expert, each expert any token chose gets one M tile, and the grid walks
those tiles times the output columns, so each touched expert's slice is read once
(:func:`treeattn.sim.deploy.capacity.step_weight_reads` counts the touched experts). A TP
rank's slice is narrow (DeepSeek-V3 at TP8: gate-up 512 × 7168 and down 7168 × 256 FP8
values an expert), so each expert is a few CTAs that stream their K in sequence, and the
kernel reads HBM well under a dense GEMM's rate for the same bytes.

Each rate is read from one published table the way the dense FP8 rates are
(:mod:`treeattn.sim.devices`): the token model charges the fused span each of its kernels'
graph-replay fixed cost (:data:`treeattn.sim.decode_kernels.GRAPH_KERNEL_S`) in its kernel
count, and the touched experts' bytes at this rate, so a rate is the bytes over the
published time less those fixed costs, over the datasheet bandwidth. The kernels of the timed
span are those :data:`treeattn.sim.deploy.token.KERNELS_PER_LAYER` counts for a MoE layer
outside its router and shared expert (grouped top-k, expert sort/align, the two expert GEMMs,
SiLU·mul, the expert sum: 6) plus the FP8 quantisation before each expert GEMM (2,
:data:`treeattn.sim.decode_kernels.FP8_QUANT_KERNELS`): 8 in vLLM's
``benchmarks/kernels/benchmark_moe.py``, which times ``fused_topk`` and ``fused_experts``
in one CUDA graph; 7 in SGLang's ``benchmark/kernels/fused_moe_triton/
tuning_fused_moe_triton.py``, which runs ``select_experts`` outside its graph. Both draw the
router logits at random, so the experts a batch touches are the even-routing count the token
model uses (:func:`treeattn.sim.deploy.capacity.distinct_experts`).

Sourced table (bytes: touched experts × 3 × hidden × N FP8 bytes; N the rank's expert
intermediate width; time less 8 or 7 × 2.4 µs; of the datasheet's 4.8 TB/s (H200) or
8.0 TB/s (B200)):

=========  ===========================================================================
gen.       source, rows (M tokens: µs published, MB, GB/s in the net time, of datasheet)
=========  ===========================================================================
hopper     vLLM PR #36559 (https://github.com/vllm-project/vllm/pull/36559, merged), the
           PR's own kernel on an H200: ``benchmark_moe.py --model
           Qwen/Qwen3-Next-80B-A3B-Instruct-FP8 --dtype fp8_w8a8`` at the script's default
           TP2: 512 experts, top 10, hidden 2048, N = 256, block FP8. 1: 26.72 µs, 15.7 MB,
           2092, 0.436; 2: 30.78, 31.2, 2690, 0.560; 4: 44.60, 61.1, 2405, 0.501; 8: 59.86,
           117.6, 2891, 0.602; 16: 93.03, 218.0, 2952, 0.615; 24: 111.70, 303.7, 3283,
           0.684; 32: 130.30, 376.9, 3393, 0.707. Median 0.602 (the M = 8 row). The same
           slice width as DeepSeek-V3's at TP8; M = 1 and 2 fit in the H200's 50 MB L2,
           which the script's ten back-to-back calls on the same experts may hit.
blackwell  SGLang PR #11816 (https://github.com/sgl-project/sglang/pull/11816, comment of
           2025-10-19, "Before"): SGLang's Triton ``fused_moe`` with the B200 configs it
           shipped (the config differs by batch, as a tuned file's do),
           ``tuning_fused_moe_triton.py --model deepseek-ai/DeepSeek-R1 --tp 8
           --dtype w8a8``: 257 experts (the shared one fused in as an expert), top 8,
           hidden 7168, N = 256. 1: 52.65 µs, 44.0 MB, 1228, 0.154; 2: 60.35, 86.7, 1991,
           0.249; 4: 79.09, 168.1, 2699, 0.337; 8: 95.47, 316.2, 4020, 0.502; 16: 138.68,
           561.8, 4609, 0.576; 24: 175.80, 752.5, 4732, 0.592. Median 0.420 (between the
           M = 4 and 8 rows). The engines' other Blackwell MoE kernels (FlashInfer's
           TRT-LLM MoE, SGLang's default there since that PR for 10% end to end) have no
           public decode-sized table found.
=========  ===========================================================================

One rate serves every slice width, so wide slices are priced slow: vLLM #36559's
DeepSeek-R1 rows on the same H200 at TP2 (N = 1024, four times the bytes an expert) read at
0.68-0.91 of HBM and are priced up to 1.5× slow (``benchmarks/results/fidelity.md`` scores
them). 16-bit and NVFP4 experts, and generations without a row, keep their dense rate (no
public decode-sized table found).

What it does to a step: DeepSeek-V3 at TP8 with FP8 weights on an H200, batch 4, touches
256 × (1 − (248/256)^4) = 30.5 experts of 5.5 MB a layer, 9.75 GB over its 58 MoE layers:
3.37 ms at 0.602 of 4.8 TB/s where the dense FP8 rate (0.847) gave 2.40 ms.
"""

from __future__ import annotations

import statistics

from treeattn.sim.decode_kernels import GRAPH_KERNEL_S, generation
from treeattn.sim.deploy.capacity import distinct_experts
from treeattn.topo.hardware import GPU_SPECS

#: Kernels of a fused-MoE benchmark's timed span that the token model charges a fixed cost
#: each (module docstring): top-k, sort/align, two FP8 quantisations, gate-up, SiLU·mul,
#: down, expert sum; SGLang's script runs the top-k outside its graph.
SPAN_KERNELS = {"vllm": 8, "sglang": 7}
#: (experts, top-k, hidden, N per rank) of each source and its rows (M tokens, µs).
VLLM_36559_H200 = ((512, 10, 2048, 256), ((1, 26.72), (2, 30.78), (4, 44.60), (8, 59.86),
                                           (16, 93.03), (24, 111.70), (32, 130.30)))
SGLANG_11816_B200 = ((257, 8, 7168, 256), ((1, 52.65), (2, 60.35), (4, 79.09), (8, 95.47),
                                            (16, 138.68), (24, 175.80)))


def expert_bytes(shape: tuple[int, int, int, int], tokens: int, wb: float = 1.0) -> float:
    """Weight bytes ``tokens`` tokens read from a fused MoE of ``shape`` (experts, top-k,
    hidden, N): the touched experts' gate-up (2N × hidden) and down (hidden × N) slices.

    >>> round(expert_bytes((256, 8, 7168, 256), 1) / 1e6, 2)  # 8 DeepSeek-V3 experts, TP8
    44.04
    """
    experts, topk, hidden, n = shape
    return distinct_experts(experts, topk, tokens) * 3 * hidden * n * wb


def _rate(shape, tokens: int, time_us: float, kernels: int, gpu: str) -> float:
    """Fraction of ``gpu``'s datasheet HBM rate a published row read its experts at."""
    net = time_us * 1e-6 - kernels * GRAPH_KERNEL_S[generation(gpu)]
    return expert_bytes(shape, tokens) / net / GPU_SPECS[gpu].memory_bandwidth


def _median_rate(source, kernels: int, gpu: str) -> float:
    shape, rows = source
    return round(statistics.median(_rate(shape, m, t, kernels, gpu) for m, t in rows), 3)


#: Fraction of the datasheet HBM rate at which a fused MoE reads its routed experts at
#: decode, by weight dtype and generation (sourced table in the module docstring).
MOE_GEMM_EFFICIENCY = {"float8": {
    "hopper": _median_rate(VLLM_36559_H200, SPAN_KERNELS["vllm"], "H200"),
    "blackwell": _median_rate(SGLANG_11816_B200, SPAN_KERNELS["sglang"], "B200")}}
MOE_GEMM_SOURCES = {
    "hopper": "vLLM PR #36559, H200, Qwen3-Next-80B FP8 TP2 (N=256), M=1-32 less 8 × 2.4 µs",
    "blackwell": "SGLang PR #11816, B200, DeepSeek-R1 FP8 TP8 (N=256), M=1-24 less 7 × 2.4 µs"}


def expert_read_factor(gpu_model: str, weight_dtype: str, hardware_name: str = "") -> float:
    """How many times longer a fused MoE takes to read ``weight_dtype`` experts on a
    ``gpu_model`` GPU than the hardware model's memory bandwidth says: its memory efficiency
    (``hardware_name``'s, else the GPU model's) over :data:`MOE_GEMM_EFFICIENCY`'s; a dtype
    or generation without a row reads at the dense rate
    (:func:`treeattn.sim.devices.weight_read_factor`).

    >>> round(expert_read_factor("H200", "float8"), 3), expert_read_factor("H200", "bfloat16")
    (1.495, 1.0)
    >>> round(expert_read_factor("B200", "float8"), 3)  # 0.75 / 0.420
    1.786
    """
    from treeattn.sim.devices import MEMORY_EFFICIENCY, weight_read_factor

    rate = MOE_GEMM_EFFICIENCY.get(str(weight_dtype), {}).get(generation(gpu_model))
    if rate is None:
        return weight_read_factor(gpu_model, weight_dtype, hardware_name)
    efficiency = MEMORY_EFFICIENCY.get(hardware_name, MEMORY_EFFICIENCY.get(str(gpu_model)))
    return (efficiency or 1.0) / rate


def fused_moe_span_s(hw, gpu_model: str, shape: tuple[int, int, int, int], tokens: int,
                     weight_dtype: str = "float8", engine: str = "vllm") -> float:
    """The token model's price of one fused-MoE call as ``engine``'s benchmark times it:
    its kernels' graph-replay fixed costs plus the touched experts' bytes at the sourced
    rate on ``hw`` (a :class:`treeattn.sim.devices.HardwareModel` of ``gpu_model``)."""
    from treeattn.sim.deploy.capacity import WEIGHT_DTYPE_BYTES

    nbytes = expert_bytes(shape, tokens, WEIGHT_DTYPE_BYTES[weight_dtype])
    flops = 2.0 * tokens * shape[1] * 3 * shape[2] * shape[3]
    slower = expert_read_factor(gpu_model, weight_dtype, hw.name)
    return (hw.compute_time(nbytes * slower, flops) - hw.launch_s
            + SPAN_KERNELS[engine] * hw.graph_kernel_s)
