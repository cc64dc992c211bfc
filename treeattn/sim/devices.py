"""The device cost models: per-GPU compute (:class:`HardwareModel`), per-library messaging
overhead (:class:`BackendModel`), their registries, and both built from a calibration profile.

Hardware
--------
Per-device compute models: how long a Compute or Merge step takes.

A step that touches ``nbytes`` and does ``flops`` takes
``max(nbytes / memory_bandwidth, flops / peak_flops) + launch_s`` (decode attention is
memory-bound, so the first term wins in practice).


``launch_s``: a decode attention is two kernels (split-K partial + combine); a CUDA/HIP
launch costs a few µs from the host (CUDA C++ Best Practices Guide, "kernel launch overhead").
We take 4 µs per Compute step on GPUs. The H200 run agrees: treeattn's kernel at T=4k (16.8 MB
of K+V) takes 8.2 µs as a graph replay, 3.9 µs of reading at the copy bandwidth plus about
4 µs (``benchmarks/results/kernels-h200.md``). One small kernel of a whole decode step
replayed as a CUDA graph costs about half that (``kernel_s``, per generation in
:data:`treeattn.sim.decode_kernels.GRAPH_KERNEL_S`).

Memory efficiency: no kernel reads HBM at the datasheet peak. :data:`MEMORY_EFFICIENCY` holds
the fraction a decode kernel or a copy reached where it was measured or published, and a
GPU's model reads at ``datasheet × efficiency``. GPUs without a row keep the datasheet
figure (1.0).

The ``cpu`` profile is a placeholder until a calibration replaces it. What a host adds beyond
the device's own costs (CPU ranks sharing cores, for one) is not part of these models: a
hardware model may carry a host model (``host``, :mod:`treeattn.sim.host_model`), and has
none on a GPU cluster.

The figures (peak memory bandwidth, dense 16-bit FLOP/s) and their datasheet sources live in
THE GPU table, :data:`treeattn.topo.hardware.GPU_SPECS`, which the topology builders and
importers read too; :data:`HARDWARE` has one model per row of it.

Backends
--------
Communication-library software overhead, paid at each end of every message.

A message from ``a`` to ``b`` costs ``send_s`` on the sender (posting it occupies the rank),
then the wire time along its route (per-hop link latency plus chunked, pipelined
transfer, see :mod:`treeattn.sim.network`), then ``recv_s`` on the receiver once it has
arrived. The small-message latency is therefore ``α = send_s + route latency + recv_s``.

Sources:

* ``nccl``: NCCL keeps no cost table for send/recv; we price one p2p message as one hop of
  the protocol NCCL picks for it (see :func:`treeattn.sim.nccl.collectives.p2p_cost`): inside
  a host LL up to 16 KiB, the ring LL base of NCCL 2.30.7's ``tuning.cc`` (6.6 µs) split
  between the two ends (3.3 µs each) plus the class's hop (0.6 µs NVLink, 1.0 µs PCIe);
  across hosts Simple (8.4 µs base, 14 µs network hop) unless ``nccl_env`` sets
  ``NCCL_ALLOC_P2P_NET_LL_BUFFERS=1`` or ``NCCL_NET_SHARED_BUFFERS=0``
  (LL: 6.6 + 5.0 µs). ``send_s``/``recv_s`` below
  are those halves on LL. Collectives are priced by the library's own model instead.
* ``rccl``: the same with RCCL's ring LL base for gfx942 (12.0 µs, ``tuning_model_5``):
  6.0 µs each end.
* ``gloo``: TCP on loopback through gloo's pair transport costs tens of µs per message on a
  typical Linux host; 15 µs per end is a placeholder that a calibration replaces.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from treeattn.schedule.payloads import SimError
from treeattn.sim.decode_kernels import GRAPH_KERNEL_S, generation_kernel_s
from treeattn.sim.host_model import HostSpec
from treeattn.topo.hardware import GPU_SPECS


@dataclass(frozen=True)
class HardwareModel:
    """Compute cost model of one device type.

    Examples
    --------
    >>> h = HardwareModel("toy", memory_bandwidth_Bps=1e9, peak_flops=1e12, launch_s=1e-6)
    >>> round(h.compute_time(nbytes=1000, flops=0), 9)
    2e-06
    """

    name: str
    memory_bandwidth_Bps: float
    peak_flops: float
    launch_s: float
    memory_bytes: float = 0.0  # device memory capacity; 0: unknown (no capacity check)
    # ((bytes, factor), ...) sorted by bytes: the bandwidth at a step of ``bytes`` is
    # ``memory_bandwidth_Bps × factor``, interpolated in log(bytes) and held flat beyond the
    # ends. From calibration, where caches make a small shard read faster than a large one;
    # empty: one bandwidth for every size.
    bandwidth_shape: tuple[tuple[float, float], ...] = ()
    # FLOP/s a prefill's causal attention reaches (scores, softmax, weighted sum), where it is
    # not the matmul peak: CPUs, where the softmax's exponentials cost as much as the products
    # (benchmarks/prefill_check.py measures it); 0: peak_flops
    attention_flops: float = 0.0
    # ((weight dtype, bytes/s), ...): the rate decode GEMMs read weights of that dtype, from a
    # measured kernel table (treeattn.sim.deploy.kernel_table); empty: the sourced defaults
    gemm_bandwidth: tuple[tuple[str, float], ...] = ()
    # What the host adds to each step beyond these costs (treeattn.sim.host_model); None:
    # nothing, as on a GPU cluster
    host: HostSpec | None = None
    # Fixed cost of one small kernel replayed in a CUDA graph (the whole-token model's kernels
    # outside attention; treeattn.sim.decode_kernels.GRAPH_KERNEL_S); 0: launch_s, where no
    # generation figure is sourced (and on CPUs, which replay no graph)
    kernel_s: float = 0.0
    # True where a measured kernel table's attention rows set the bandwidth and launch_s
    # (treeattn.sim.deploy.kernel_table): the whole-token model then prices the engine's
    # decode attention by that fit instead of the sourced grid model
    attention_measured: bool = False

    def __post_init__(self) -> None:
        if self.memory_bandwidth_Bps <= 0 or self.peak_flops <= 0 or self.launch_s < 0:
            raise SimError(f"hardware {self.name}: bandwidth and FLOPs must be positive")
        if self.attention_flops < 0 or self.kernel_s < 0:
            raise SimError(f"hardware {self.name}: attention FLOPs and the kernel fixed cost "
                           "must not be negative")

    @property
    def graph_kernel_s(self) -> float:
        """Fixed cost of one small kernel in a CUDA-graph replay (see ``kernel_s``).

        >>> HardwareModel("toy", 1e9, 1e12, 4e-6).graph_kernel_s
        4e-06
        >>> HardwareModel("toy", 1e9, 1e12, 4e-6, kernel_s=2.4e-6).graph_kernel_s
        2.4e-06
        """
        return self.kernel_s or self.launch_s

    def bandwidth_at(self, nbytes: float) -> float:
        """Bytes/s for a step touching ``nbytes`` (see ``bandwidth_shape``).

        >>> h = HardwareModel("toy", 1e9, 1e12, 0.0, bandwidth_shape=((1e6, 2.0), (1e8, 1.0)))
        >>> h.bandwidth_at(1e3), h.bandwidth_at(1e7), h.bandwidth_at(1e9)
        (2000000000.0, 1500000000.0, 1000000000.0)
        """
        if not self.bandwidth_shape or nbytes <= 0:
            return self.memory_bandwidth_Bps
        sizes = [math.log(b) for b, _ in self.bandwidth_shape]
        factors = [f for _, f in self.bandwidth_shape]
        x = math.log(nbytes)
        if x <= sizes[0]:
            return self.memory_bandwidth_Bps * factors[0]
        for (x0, f0), (x1, f1) in zip(zip(sizes, factors), zip(sizes[1:], factors[1:])):
            if x <= x1:
                return self.memory_bandwidth_Bps * (f0 + (f1 - f0) * (x - x0) / (x1 - x0))
        return self.memory_bandwidth_Bps * factors[-1]

    def compute_time(self, nbytes: float, flops: float = 0.0) -> float:
        """Seconds for a step touching ``nbytes`` and doing ``flops``."""
        return max(nbytes / self.bandwidth_at(nbytes), flops / self.peak_flops) + self.launch_s

    def attention_time(self, nbytes: float, flops: float) -> float:
        """Seconds for a prefill attention step (:attr:`attention_flops` where it is set)."""
        rate = self.attention_flops or self.peak_flops
        return max(nbytes / self.bandwidth_at(nbytes), flops / rate) + self.launch_s



GPU_LAUNCH_S = 4e-6
CPU_LAUNCH_S = 20e-6  # placeholder: `treeattn calibrate` measures it
# Fraction of the datasheet memory bandwidth a decode kernel reads HBM at, by GPU model:
#
# ======== ========== ===================================================================
# GPU      efficiency source
# ======== ========== ===================================================================
# H200     0.90       benchmarks/results/kernels-h200.json (NVIDIA H200, 2026-11-30, bf16,
#                     B=1, Hq=32, Hkv=8, D=128, CUDA-graph replays): treeattn's Triton
#                     decode kernel at 0.82 (T=64k), 0.88 (128k), 0.90 (256k), 0.93 (512k),
#                     0.94 (1M); the median
# H100     0.90       the H200's (same SM, memory controller design and kernel)
# B200     0.75       CUDA's bandwidthTest sample on 8 B200s (HGX, CUDA 12.8): device-to-
#                     device copies at "over 6,000 GB/s" of 8.0 TB/s (newmind.ai journal 18,
#                     "Unlocking Next-Generation AI Performance: Inside NVIDIA's Blackwell
#                     B200 Architecture"); the GB200's GPU takes the same figure
# A100     0.89       1818.21 GB/s measured HBM roof on an A100 SXM4 80 GB, "89.17 percent
#                     of nameplate" 2039 GB/s (https://github.com/openfabric-systems/simllm/
#                     pull/109); the A800 is the same GPU
# MI300X   0.74       3910.62 GB/s, the HBM bandwidth rocprofiler-compute's roofline
#                     benchmark is validated against on MI300X (ROCm/rocm-systems PR #2934,
#                     projects/rocprofiler-compute/tests/test_metric_validation.py), of the
#                     datasheet's 5.3 TB/s
# ======== ========== ===================================================================
#
# GPUs without a row keep the datasheet figure (1.0).
MEMORY_EFFICIENCY = {"H200": 0.90, "H100": 0.90, "B200": 0.75, "GB200": 0.75,
                     "A100": 0.89, "A800": 0.89, "MI300X": 0.74}
# Fraction of the datasheet HBM rate at which a decode GEMM reads FP8 weights, by GPU
# generation (the token model's weight reads; bf16 weights read at MEMORY_EFFICIENCY). The
# token model charges a GEMM its bytes at this rate plus one graph-replayed kernel's fixed
# cost (decode_kernels.GRAPH_KERNEL_S: 2.4 µs on every generation), so each rate is read from
# a published time less that fixed cost, bytes / (time - 2.4 µs) / datasheet; read from the
# whole time it would charge the fixed cost twice.
# Hopper: DeepGEMM's README at commit 7a70b43 (deepseek-ai/DeepGEMM, "Normal GEMMs for dense
# models", H800 SXM5, HBM3 at 3.35 TB/s, NVCC 12.8), its six M = 64 decode-sized rows
# (TFLOPS, GB/s): time = 2·M·N·K / TFLOPS, bytes = time × GB/s:
#   N × K         TFLOPS  GB/s   time µs  MB      GB/s in (time - 2.4 µs)  of 3.35 TB/s
#   2112 × 7168   206     1688    9.407    15.88  2266                     0.676
#   24576 × 1536  289     2455   16.719    41.05  2867                     0.856
#   32768 × 512   219     2143    9.806    21.01  2837                     0.847
#   7168 × 16384  336     2668   44.739   119.36  2819                     0.842
#   4096 × 7168   287     2320   13.094    30.38  2841                     0.848
#   7168 × 2048   295     2470    6.370    15.73  3963                     1.183
# median (0.847 + 0.848) / 2 = 0.847. The last row, above the datasheet, is a kernel whose
# fixed part is under 2.4 µs (DeepGEMM times kernels alone, without the gap to the next one);
# the median keeps it out. Cross-check, no fixed cost assumed: the least-squares line through
# the six rows (time against bytes) has a slope of 0.839 of the datasheet and 2.26 µs at zero.
# Blackwell: vLLM's bench_fp8_gemm on SM100 (https://github.com/vllm-project/vllm/pull/20071,
# "SM100 FP8 GEMM Optimizations after cutlass_profiler", B200-class at 8.0 TB/s): the CUTLASS
# FP8 GEMM alone (``fp8-channel-w-token-a-noquant``) of Llama-3.1-8B's N = 28672, K = 4096 at
# batch 1 and 16, 10.419067 and 167.030801 TFLOP/s: 22.543 and 22.499 µs for 117.51 and
# 118.49 MB (N·K + M·(N + K)·2), 5833 and 5895 GB/s in (time - 2.4 µs), 0.729 and 0.737 of
# the datasheet; their mean, 0.733.
# Generations without a published FP8 decode GEMM table here keep the bf16 rate.
GEMM_FIXED_S = GRAPH_KERNEL_S["hopper"]  # the fixed cost the token model charges each GEMM
DEEPGEMM_H800_M64 = ((2112, 7168, 206, 1688), (24576, 1536, 289, 2455), (32768, 512, 219, 2143),
                     (7168, 16384, 336, 2668), (4096, 7168, 287, 2320), (7168, 2048, 295, 2470))
VLLM_SM100_FP8_N28672 = ((1, 10.419067), (16, 167.030801))  # (M, TFLOP/s), K = 4096


def _deepgemm_rate(n: int, k: int, tflops: float, gbps: float, m: int = 64) -> float:
    seconds = 2.0 * m * n * k / (tflops * 1e12)
    return seconds * gbps * 1e9 / (seconds - GEMM_FIXED_S) / GPU_SPECS["H800"].memory_bandwidth


def _sm100_fp8_rate(m: int, tflops: float, n: int = 28672, k: int = 4096) -> float:
    seconds = 2.0 * m * n * k / (tflops * 1e12)
    nbytes = n * k + m * (n + k) * 2
    return nbytes / (seconds - GEMM_FIXED_S) / GPU_SPECS["B200"].memory_bandwidth


FP8_GEMM_EFFICIENCY = {
    "hopper": round(statistics.median(_deepgemm_rate(*row) for row in DEEPGEMM_H800_M64), 3),
    "blackwell": round(statistics.mean(_sm100_fp8_rate(*row) for row in VLLM_SM100_FP8_N28672),
                       3)}
FP8_GEMM_SOURCES = {"hopper": "DeepGEMM README @7a70b43, H800, M=64 rows less 2.4 µs, median",
                    "blackwell": "vLLM PR #20071, SM100, N=28672 K=4096 M=1/16 less 2.4 µs"}
# The same for NVFP4 weights (4.5 bits a weight with their scales), on the only generation with
# FP4 tensor cores. Blackwell: FlashInfer's ``mm_fp4`` (CUTLASS backend) on one B200 SXM at
# M = 1, N = K = 8192, timed with CUDA-graph replays, "achieves 1.78 TB/s" counting the 4-bit
# values alone (https://github.com/flashinfer-ai/flashinfer/issues/1732): 33.55 MB in
# 18.851 µs. With the scales and the 16-bit activations that is 37.78 MB, in (18.851 - 2.4)
# µs 2297 GB/s, 0.287 of the datasheet's 8.0. This is an untuned kernel in a performance bug
# report (closed), and it makes an NVFP4 GEMM slower than an FP8 one of the same weights
# (0.5625 / 0.287 against 1 / 0.733 of the datasheet time per weight, 1.44x). No faster
# public table of the NVFP4 GEMM the engines run at decode sizes was found: vLLM's CUTLASS
# NVFP4 GEMM at M = 1 on a B200 (the ``cutlass`` column of pytorch/helion PR #3046, six
# shapes from 4096 × 4096 to 8192 × 28672) lies on a line of 0.314 of the datasheet and
# 3.8 µs at zero, the same rate; benchmarks/fidelity.py scores it.
FP4_SOURCE_ROW = (1, 8192, 8192, 1.78e12)  # (M, N, K, TB/s of the 4-bit values)


def _nvfp4_rate(m: int, n: int, k: int, value_bps: float) -> float:
    seconds = n * k * 0.5 / value_bps
    nbytes = n * k * 4.5 / 8 + m * (n + k) * 2
    return nbytes / (seconds - GEMM_FIXED_S) / GPU_SPECS["B200"].memory_bandwidth


FP4_GEMM_EFFICIENCY = {"blackwell": round(_nvfp4_rate(*FP4_SOURCE_ROW), 3)}
FP4_GEMM_SOURCES = {"blackwell": "FlashInfer #1732 (untuned, bug report), B200, mm_fp4 "
                                 "CUTLASS, M=1 N=K=8192, less 2.4 µs"}
LOW_PRECISION_GEMM_EFFICIENCY = {"float8": FP8_GEMM_EFFICIENCY, "float4": FP4_GEMM_EFFICIENCY}


def check_weight_dtype(gpu_model: str, weight_dtype: str) -> None:
    """SimError for FP4 weights on a GPU without FP4 tensor cores (a generation with no
    :data:`FP4_GEMM_EFFICIENCY` row); every other pairing runs.

    >>> check_weight_dtype("B200", "float4"), check_weight_dtype("H100", "float8")
    (None, None)
    """
    from treeattn.sim.nccl.tables import ARCH_OF_MODEL

    if str(weight_dtype) in ("float4", "fp4") and \
            ARCH_OF_MODEL.get(str(gpu_model), "") not in FP4_GEMM_EFFICIENCY:
        raise SimError(f"FP4 weights need FP4 tensor cores (Blackwell); {gpu_model} has none")


def weight_read_factor(gpu_model: str, weight_dtype: str, hardware_name: str = "") -> float:
    """How many times longer a decode GEMM takes to read ``weight_dtype`` weights on a
    ``gpu_model`` GPU (as the topology names it) than the hardware model's memory bandwidth
    says: 1 for 16-bit weights and for generations without a sourced FP8 row; for FP8 and
    FP4 the hardware's memory efficiency (``hardware_name``'s, else the GPU model's) over
    :data:`LOW_PRECISION_GEMM_EFFICIENCY`'s (Hopper FP8: 0.90 / 0.847). SimError for FP4
    on a GPU without FP4 tensor cores (:func:`check_weight_dtype`).

    >>> round(weight_read_factor("H200", "float8"), 3), weight_read_factor("H200", "bfloat16")
    (1.063, 1.0)
    >>> round(weight_read_factor("B200", "float4"), 3)  # 0.75 / 0.287
    2.613
    """
    from treeattn.sim.nccl.tables import ARCH_OF_MODEL

    check_weight_dtype(gpu_model, weight_dtype)
    table = LOW_PRECISION_GEMM_EFFICIENCY.get(str(weight_dtype))
    if table is None:
        return 1.0
    rate = table.get(ARCH_OF_MODEL.get(str(gpu_model), ""))
    if rate is None:
        return 1.0
    efficiency = MEMORY_EFFICIENCY.get(hardware_name, MEMORY_EFFICIENCY.get(str(gpu_model)))
    return (efficiency or 1.0) / rate


# One model per row of THE GPU table, so every GPU a topology can name has one.
HARDWARE: dict[str, HardwareModel] = {
    name: HardwareModel(name, spec.memory_bandwidth * MEMORY_EFFICIENCY.get(name, 1.0),
                        spec.peak_flops, CPU_LAUNCH_S if name == "cpu" else GPU_LAUNCH_S,
                        memory_bytes=float(spec.memory_capacity),
                        kernel_s=generation_kernel_s(name) or 0.0)
    for name, spec in GPU_SPECS.items()
}


def hardware_for(model: str) -> HardwareModel:
    """The registered model for a GPU type name as ``Topology.gpu_model`` spells it."""
    key = str(model).strip()
    if key in HARDWARE:
        return HARDWARE[key]
    folded = {k.lower(): v for k, v in HARDWARE.items()}
    if key.lower() in folded:
        return folded[key.lower()]
    raise SimError(f"no hardware model for device {model!r} (known: {', '.join(HARDWARE)})")


@dataclass(frozen=True)
class BackendModel:
    """Per-message software overhead of a communication library.

    Examples
    --------
    >>> backend_for("nccl").send_s
    3.3e-06
    """

    name: str
    send_s: float
    recv_s: float
    # Measured collectives (calibration): ((op, world, alpha_s, seconds_per_byte), ...).
    collectives: tuple[tuple[str, int, float, float], ...] = ()
    # A GPU cluster's calibration from nccl-tests (treeattn.sim.nccl.fit), if any.
    calibration: object = field(default=None, compare=False, hash=False)
    # The NCCL/RCCL variables the library runs with, as far as the cost model reads them
    # (treeattn.sim.nccl.env): ``(name, value)`` pairs, ``--nccl-env NAME=VALUE``.
    nccl_env: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if self.send_s < 0 or self.recv_s < 0:
            raise SimError(f"backend {self.name}: overheads must be non-negative")
        if self.nccl_env:
            from treeattn.sim.nccl.env import parse_nccl_env

            object.__setattr__(self, "nccl_env", parse_nccl_env(self.nccl_env))

    def measured_collective(self, op: str, world: int) -> tuple[float, float] | None:
        """``(alpha_s, seconds_per_byte)`` calibrated for ``op`` at ``world`` ranks, if any."""
        for name, size, alpha, per_byte in self.collectives:
            if name == op and size == world:
                return alpha, per_byte
        return None

    @property
    def overhead_s(self) -> float:
        """Software part of α: both ends together."""
        return self.send_s + self.recv_s


BACKENDS: dict[str, BackendModel] = {
    "nccl": BackendModel("nccl", 3.3e-6, 3.3e-6),
    "rccl": BackendModel("rccl", 6.0e-6, 6.0e-6),
    "gloo": BackendModel("gloo", 15e-6, 15e-6),
}


def backend_for(name: str) -> BackendModel:
    key = str(name).strip().lower()
    if key not in BACKENDS:
        raise SimError(f"unknown backend {name!r} (known: {', '.join(BACKENDS)})")
    return BACKENDS[key]


def default_backend(gpu_model: str) -> BackendModel:
    """gloo for CPU ranks, RCCL on AMD GPUs, NCCL otherwise."""
    if gpu_model.lower() == "cpu":
        return BACKENDS["gloo"]
    if gpu_model.upper().startswith("MI"):
        return BACKENDS["rccl"]
    return BACKENDS["nccl"]
