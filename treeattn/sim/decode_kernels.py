"""What the serving engines' decode kernels cost on each GPU generation, from public sources.

Three prices the whole-token model (:mod:`treeattn.sim.deploy.token`) needs beyond the
HBM rate of :class:`treeattn.sim.devices.HardwareModel`:

* **a small kernel replayed in a CUDA graph** (:data:`GRAPH_KERNEL_S`): the engines replay a
  whole decode step as one graph, so each kernel outside attention costs its device-side
  fixed cost (grid launch, ramp-up, tail, the gap to the next node), not a host launch;
* **decode attention at small batch with few KV heads per GPU**
  (:func:`engine_decode_attention_s`): the engines' split-KV kernels give each (sequence, KV
  head) a number of splits by a heuristic, so at batch 1 with one or two KV heads on a GPU
  the grid is a few dozen CTAs on 108-148 SMs, and each CTA streams K and V at the rate its
  own loads in flight allow, well under its share of HBM;
* **the FP8 activation quantisation** a W8A8 linear layer runs before its GEMM
  (:data:`FP8_QUANT_KERNELS`).

Sourced table (one row per generation; ``-`` where no public measurement was found, and the
Hopper figure stands in, as said):

==========  ====  ===========  ==================================================================
generation  SMs   graph kernel sources
==========  ====  ===========  ==================================================================
ampere      108   2.4 µs (-)   SMs: NVIDIA A100 whitepaper (108 SMs on the A100 SXM4)
hopper      132   2.4 µs       SMs: NVIDIA H100 whitepaper (132 SMs on the SXM5 part; H200/H800
                               the same GH100). Kernel: treeattn's own H200 run
                               (``benchmarks/results/kernels-h200.json``, CUDA-graph replays,
                               B=1, Hkv=8, T=4k, 16.8 MB of K+V, read at the model's 4.32 TB/s
                               in 3.88 µs): two decode steps of two kernels each (a split
                               kernel and its combine), treeattn's Triton kernel in 8.18 µs and
                               PyTorch SDPA's FlashAttention-2 kernels in 9.22 µs, leave 4.29
                               and 5.33 µs fixed: 2.4 µs a kernel. An H100 graph profile of a
                               decode step is of the same order: vLLM's
                               ``scaled_fp8_quant_kernel`` replayed 128 times in one
                               ``CUDAGraphRunner`` step took 256 µs of kernel time, 2.0 µs each
                               before any gap (https://github.com/neuralmagic/nm-vllm/pull/332).
blackwell   148   2.4 µs (-)   SMs: Chips and Cheese, "Nvidia's B200: Keeping the CUDA Juggernaut
                               Rolling" (two dies of 74 enabled SMs, 148); the GB200's GPU is
                               taken as the same part
cdna3       304   2.4 µs (-)   CUs: AMD CDNA 3 whitepaper (MI300X: 304 compute units)
==========  ====  ===========  ==================================================================

Which decode kernel runs, and its grid: vLLM's by generation (:data:`DECODE_KERNEL`), read at
the commits named:

* FlashAttention 3 (Hopper, GQA and MLA), ``hopper/heuristics.h`` ``num_splits_heuristic``
  (Dao-AILab/flash-attention@13d0fd9): with ``total_mblocks`` = batch × KV heads × M-blocks
  (decode packs a KV head's query heads into 64-row M-blocks) at or above 0.8 × SMs, no
  split; with 4 or fewer N-blocks, no split; otherwise the fewest splits whose wave
  efficiency ``n/ceil(n)`` (``n`` = total_mblocks × splits / SMs) reaches 85% of the best
  over ``1 .. min(max_splits, SMs, N-blocks)``. ``hopper/tile_size.h`` (@07602ad): at head
  dim 128 the N-block is 128 tokens on a paged cache without TMA (vLLM's 16-token pages),
  at MLA's 576/512 it is 64. vLLM caps the splits under full CUDA graphs at
  ``VLLM_FLASH_ATTN_MAX_NUM_SPLITS_FOR_CUDA_GRAPH``, default 32 (``vllm/envs.py``; set as
  ``max_num_splits`` by the FA3 metadata builders of
  ``vllm/v1/attention/backends/flash_attn.py`` and its MLA twin, vllm-project/vllm@5704f34),
  so that the partials' buffers can be allocated at capture: :data:`ENGINE_MAX_SPLITS`.
* FlashAttention 2 (Ampere), ``csrc/flash_attn/flash_api.cpp`` (@765fbd9): the same rule
  called with twice the SMs and up to 128 splits, skipping split counts that leave the
  blocks per split unchanged; 64 × 128 tiles at head dim 128; vLLM's cap does not apply.
* FlashInfer (Blackwell, GQA and MLA): its decode planner splits the KV until the grid
  reaches blocks per SM × SMs, so the grid fills the GPU and the KV reads at the HBM rate.

Per-CTA streaming rate (:data:`CTA_STREAM_BPS`): a CTA keeps a bounded number of K/V tiles in
flight, so by Little's law it streams at (bytes in flight) / (memory latency) whatever the
GPU's peak. treeattn's own split-K kernel measured it on the H200 with the grid forced below
the SM count (``benchmarks/results/kernels-h200.json``, rows ``triton-forced``: 8 splits × 8
KV heads = 64 CTAs of 4 warps and a 128-token block, the tile of FlashAttention 2's split
kernel at head dim 128): 3106 GB/s at T = 64k and 3338 GB/s at T = 1M, 48.5 and 52.2 GB/s per
CTA; their mean, 50.3 GB/s. No other generation's figure was found; they take Hopper's (the
same tile over a DRAM latency of the same order). A FlashInfer pull request names the same
mechanism for TRT-LLM's XQA kernel on GH200 ("One CTA per SM cannot cover HBM latency", 60-75%
of bandwidth at 0.75 CTAs per SM: https://github.com/flashinfer-ai/flashinfer/pull/4904).

treeattn's own kernel (:mod:`treeattn.kernels.triton_partial`) aims at two programs per SM
whatever the heads, which is how ``benchmarks/results/kernels-h200.md`` measured it; the
planner's Compute steps price that kernel and are not changed here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from treeattn.schedule.payloads import SimError

#: SMs (CUs on AMD) per GPU model, from the sources in the module docstring.
SM_COUNT = {"A100": 108, "A800": 108, "H100": 132, "H200": 132, "H800": 132, "B200": 148,
            "GB200": 148, "MI300X": 304}
#: Device-side fixed cost of one small kernel replayed in a CUDA graph, by generation.
#: Hopper's: the H200 rows below, (step time - 16.8 MB at 4.32 TB/s) / 2 kernels, averaged.
H200_GRAPH_STEPS_S = (8.178e-6, 9.217e-6)  # treeattn Triton, SDPA flash; T = 4k, B = 1
H200_STEP_READ_S = 16777216 / (4.8e12 * 0.90)
HOPPER_GRAPH_KERNEL_S = round(sum(t - H200_STEP_READ_S for t in H200_GRAPH_STEPS_S) / 4, 7)
GRAPH_KERNEL_S = {"ampere": HOPPER_GRAPH_KERNEL_S, "hopper": HOPPER_GRAPH_KERNEL_S,
                  "blackwell": HOPPER_GRAPH_KERNEL_S, "cdna3": HOPPER_GRAPH_KERNEL_S}
GRAPH_KERNEL_SOURCES = {
    "hopper": "kernels-h200.json, T=4k graph replays: Triton 8.18 µs, SDPA 9.22 µs, 2 kernels",
    "ampere": "no public graph-replay measurement found: Hopper's figure",
    "blackwell": "no public graph-replay measurement found: Hopper's figure",
    "cdna3": "no public graph-replay measurement found: Hopper's figure",
}
#: treeattn's H200 forced-grid rows (8 splits × 8 KV heads, block 128): GB/s at 64k and 1M.
FORCED_GRID_GBPS = (3106.2, 3338.0)
FORCED_GRID_CTAS = 64
CTA_STREAM_BPS = sum(FORCED_GRID_GBPS) / len(FORCED_GRID_GBPS) / FORCED_GRID_CTAS * 1e9
FA_MAX_SPLITS = 128  # the limit FlashAttention passes to its heuristic
ENGINE_MAX_SPLITS = 32  # vLLM's cap on FA3's splits under full CUDA graphs
#: The decode-attention kernel vLLM runs, by generation and attention kind: FLASH_ATTN (FA3 on
#: Hopper, FA2 before it) and FLASH_ATTN_MLA head its priorities except on compute capability
#: 10, where FLASHINFER and FLASHINFER_MLA do (``vllm/platforms/cuda.py``
#: ``_get_backend_priorities``, vllm-project/vllm@5704f34). ``fills``: a kernel whose planner
#: sizes the grid to the GPU (FlashInfer's decode plan splits the KV until batch × KV heads ×
#: chunks reaches its ``max_grid_size``, blocks per SM × SMs: ``include/flashinfer/attention/
#: scheduler.cuh``), or one whose split rule has no source here (MLA before Hopper, AMD).
DECODE_KERNEL = {"ampere": {"gqa": "fa2", "mla": "fills"},
                 "hopper": {"gqa": "fa3-vllm", "mla": "fa3-vllm"},
                 "blackwell": {"gqa": "flashinfer", "mla": "flashinfer"}}
#: Per FlashAttention kernel: (M-block, N-block at head dim 128, N-block of MLA's 576/512
#: heads, CTAs per SM the heuristic counts, CTAs resident per SM, the cap vLLM passes).
#: FA3 (``hopper/tile_size.h``): decode packs a KV head's query heads into one 64-row M-block
#: (one MMA warp group), 128-token N-blocks on vLLM's paged cache (``fa3-vllm``, with vLLM's
#: cap) and 176 on a contiguous one (``fa3``, FlashAttention's own cap), 64 for MLA; one CTA
#: per SM. FA2 (``csrc/flash_attn/flash_api.cpp``, ``run_mha_fwd_splitkv_dispatch``): 64 × 128
#: tiles of 4 warps, the heuristic called with twice the SMs, no vLLM cap (its cap needs
#: FA3's ahead-of-time scheduler).
FA_TILES = {"fa3-vllm": (64, 128, 64, 1, 1, ENGINE_MAX_SPLITS),
            "fa3": (64, 176, 64, 1, 1, FA_MAX_SPLITS),
            "fa2": (64, 128, 64, 2, 2, FA_MAX_SPLITS)}
KERNELS = ("fa3-vllm", "fa3", "fa2", "flashinfer", "fills")

#: FP8 activation-quantisation kernels per block of a layer, one before each FP8 linear:
#: vLLM's W8A8 FP8 linear quantises its input per call (dynamic per-token scales; DeepSeek's
#: block FP8 per token group). A Llama layer's four linears (QKV, output, gate-up, down) show as
#: 128 ``scaled_fp8_quant_kernel`` calls for 32 layers in nm-vllm PR #332's H100 graph profile.
#: MLA: fused q_a/kv_a, q_b and output (the absorbed W_UK/W_UV products stay 16-bit); MoE: the
#: shared expert's two linears and the fused experts' two GEMMs.
FP8_QUANT_KERNELS = {"gqa_attention": 2, "mla_attention": 3, "dense_mlp": 2, "moe": 4}
#: GPUs without FP8 tensor cores: NVIDIA before compute capability 8.9 (Ada and Hopper
#: brought FP8: CUDA C++ Programming Guide, compute capabilities table), AMD before CDNA 3
#: (the CDNA 3 whitepaper introduces FP8). vLLM runs FP8 checkpoints there as a weight-only
#: Marlin GEMM, with no activation quantisation.
NO_FP8_TENSOR_CORES = {"P100", "V100", "A100", "A800", "RTX3090", "A6000", "MI250", "MI250X",
                       "MI210"}


def generation(gpu_model: str) -> str:
    """The architecture row of a GPU model (``""`` if none)."""
    from treeattn.sim.nccl.tables import ARCH_OF_MODEL

    return ARCH_OF_MODEL.get(str(gpu_model), "")


def generation_kernel_s(gpu_model: str) -> float | None:
    """Sourced fixed cost of one small kernel in a graph replay on ``gpu_model``, or None.

    >>> generation_kernel_s("H200"), generation_kernel_s("cpu")
    (2.4e-06, None)
    """
    return GRAPH_KERNEL_S.get(generation(gpu_model))


def fa_num_splits(total_mblocks: int, num_sms: int, num_n_blocks: int,
                  max_splits: int = FA_MAX_SPLITS, *, fa2: bool = False) -> int:
    """FlashAttention's ``num_splits_heuristic`` for a decode (no causal mask, a KV head
    shorter than FA3's L2 split rule needs): the fewest splits within 85% of the best wave
    efficiency. FA3 never splits 4 N-blocks or fewer; FA2 skips a split count that leaves
    the blocks per split unchanged.

    >>> fa_num_splits(1, 132, 32)  # batch 1, one KV head, 4k tokens: 28 of 132 SMs
    28
    >>> fa_num_splits(1, 132, 1024, max_splits=32)  # 128k tokens under vLLM's graph cap
    28
    >>> fa_num_splits(1, 216, 32, fa2=True)  # FA2 on an A100: 28-31 leave 2 blocks a split
    32
    >>> fa_num_splits(128, 132, 1024)  # enough CTAs already
    1
    """
    if total_mblocks < 1 or num_sms < 1:
        raise SimError("a decode grid needs at least one CTA and one SM")
    if total_mblocks >= 0.8 * num_sms or (not fa2 and num_n_blocks <= 4):
        return 1
    most = min(max_splits, num_sms, num_n_blocks)

    def eligible(splits: int) -> bool:
        return (not fa2 or splits == 1
                or math.ceil(num_n_blocks / splits) != math.ceil(num_n_blocks / (splits - 1)))

    efficiency = []
    for splits in range(1, most + 1):
        waves = total_mblocks * splits / num_sms
        efficiency.append(waves / math.ceil(waves) if eligible(splits) else 0.0)
    best = max(efficiency)
    return next(s for s, e in enumerate(efficiency, start=1) if e >= 0.85 * best)


@dataclass(frozen=True)
class DecodeGrid:
    """The grid of a split-KV decode kernel: ``ctas`` launched, ``resident`` at once,
    ``blocks`` N-blocks the longest split walks, ``tokens`` it holds, and ``kernels`` (2
    with the combine)."""

    ctas: int
    resident: int
    blocks: int
    tokens: int
    kernels: int


def engine_decode_grid(batch: int, kv_heads: int, q_heads: int, context: int,
                       gpu_model: str, *, mla: bool = False,
                       kernel: str | None = None) -> DecodeGrid | None:
    """vLLM's decode-attention grid on ``gpu_model`` over ``context`` cached tokens with
    ``kv_heads`` KV heads and ``q_heads`` query heads per GPU (:data:`DECODE_KERNEL`):
    FlashAttention's splits, a combine kernel when it splits; None where the kernel fills
    the GPU or the GPU has no SM count here. ``kernel`` (one of :data:`KERNELS`) names
    another kernel than vLLM's.

    >>> g = engine_decode_grid(1, 1, 8, 131072, "H200")  # FA3 under vLLM's cap of 32
    >>> g.ctas, g.blocks, g.kernels  # 1024 N-blocks over 28 splits: 37 each
    (28, 37, 2)
    >>> engine_decode_grid(1, 1, 16, 8192, "H200", mla=True).ctas  # MLA's 64-token blocks
    28
    >>> engine_decode_grid(1, 1, 8, 131072, "A100").ctas  # FA2, up to 128 splits
    114
    >>> engine_decode_grid(1, 1, 8, 131072, "B200") is None  # FlashInfer fills the SMs
    True
    """
    sms = SM_COUNT.get(str(gpu_model))
    if kernel is None:
        kernel = DECODE_KERNEL.get(generation(gpu_model), {}).get("mla" if mla else "gqa")
    elif kernel not in KERNELS:
        raise SimError(f"unknown decode kernel {kernel!r} (known: {', '.join(KERNELS)})")
    if not sms or kernel not in FA_TILES:
        return None
    m_block, n_block, mla_n_block, counted, resident, cap = FA_TILES[kernel]
    rows = max(1, q_heads // max(1, kv_heads))  # the query heads packed on each KV head
    total = batch * kv_heads * math.ceil(rows / m_block)
    n_blocks = math.ceil(max(1, context) / (mla_n_block if mla else n_block))
    splits = fa_num_splits(total, counted * sms, n_blocks, cap, fa2=kernel == "fa2")
    blocks = math.ceil(n_blocks / splits)
    return DecodeGrid(total * splits, resident * sms, blocks,
                      min(context, blocks * (mla_n_block if mla else n_block)),
                      2 if splits > 1 else 1)


def engine_decode_attention_s(hw, gpu_model: str, nbytes: float, kv_bytes: float,
                              flops: float, *, batch: int, kv_heads: int, q_heads: int,
                              context: int, mla: bool = False,
                              kernel: str | None = None) -> float:
    """Seconds of one layer's decode attention in the engine's kernel on ``hw`` (a
    :class:`~treeattn.sim.devices.HardwareModel`): the ``kv_bytes`` of cache read in the
    longest of three: at the GPU's rate, at the resident CTAs' streaming rate
    (:data:`CTA_STREAM_BPS` each), and the longest split streamed by one CTA (the grid's
    critical path, whole N-blocks); the rest of the ``nbytes``
    (query, partials) at the GPU's rate; plus each kernel's graph-replay fixed cost. Where
    the kernel fills the GPU it reads at the GPU's full rate.

    >>> from treeattn.sim.devices import HARDWARE
    >>> one = engine_decode_attention_s(HARDWARE["H200"], "H200", 2**25, 2**25, 0, batch=1,
    ...                                 kv_heads=1, q_heads=8, context=2**16)
    >>> round(one * 1e6, 1)  # 19 of 512 blocks of 64 KiB a CTA at 50.3 GB/s, two kernels
    29.5
    """
    rate = hw.bandwidth_at(nbytes)
    kv_s, kernels = kv_bytes / rate, 2
    grid = engine_decode_grid(batch, kv_heads, q_heads, context, gpu_model, mla=mla,
                              kernel=kernel)
    if grid is not None:
        token_bytes = kv_bytes / (batch * kv_heads * max(1, context))  # one head's token
        busy = min(grid.ctas, grid.resident) * CTA_STREAM_BPS  # the grid's streaming rate
        kv_s = max(kv_s, kv_bytes / busy, grid.tokens * token_bytes / CTA_STREAM_BPS)
        kernels = grid.kernels
    read = kv_s + max(0.0, nbytes - kv_bytes) / rate
    return max(read, flops / hw.peak_flops) + kernels * hw.graph_kernel_s
