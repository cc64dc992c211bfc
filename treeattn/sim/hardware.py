"""Per-device compute models: how long a Compute or Merge step takes.

A step that touches ``nbytes`` and does ``flops`` takes
``max(nbytes / memory_bandwidth, flops / peak_flops) + launch_s`` (decode attention is
memory-bound, so the first term wins in practice).

Sources (vendor datasheets, dense BF16 tensor throughput, peak memory bandwidth):

* H100 SXM5: 3.35 TB/s HBM3, 989 TFLOP/s (NVIDIA H100 Tensor Core GPU datasheet).
* H200 SXM: 4.8 TB/s HBM3e, 989 TFLOP/s (NVIDIA H200 datasheet).
* B200: 8 TB/s HBM3e, 2.25 PFLOP/s (NVIDIA DGX B200 datasheet, per GPU).
* A100 SXM4 80 GB: 2.039 TB/s, 312 TFLOP/s (NVIDIA A100 datasheet).
* V100 SXM2: 900 GB/s, 125 TFLOP/s FP16 (NVIDIA V100 datasheet).
* MI300X: 5.3 TB/s HBM3, 1307 TFLOP/s (AMD Instinct MI300X datasheet).
* MI300A: 5.3 TB/s, 981 TFLOP/s (AMD Instinct MI300A datasheet).
* MI250X / MI250 (per GCD, the unit a rank owns): 1.6 TB/s, 191.5 / 181 TFLOP/s
  (AMD Instinct MI250X / MI250 datasheets, halved per GCD).
* MI210: 1.6 TB/s, 181 TFLOP/s (AMD Instinct MI210 datasheet).
* RTX 4090: 1008 GB/s GDDR6X, 165 TFLOP/s BF16 with FP32 accumulate (NVIDIA Ada Lovelace
  architecture whitepaper, appendix table).
* RTX 3090: 936 GB/s, 71 TFLOP/s (NVIDIA Ampere GA102 whitepaper).

``launch_s``: a decode attention is two kernels (split-K partial + combine); a CUDA/HIP
launch costs a few µs from the host (CUDA C++ Best Practices Guide, "kernel launch overhead").
We take 4 µs per Compute step on GPUs; this is an estimate, not a datasheet figure.

The ``cpu`` profile is a placeholder until the runtime calibrates it
(:func:`treeattn.sim.profile.hardware_from_profile`). ``cores`` is the number of compute
servers shared by all ranks of one host (``None``: each rank owns its device).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from treeattn.sim.errors import SimError

TB = 1e12
GB = 1e9


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
    cores: int | None = None

    def __post_init__(self) -> None:
        if self.memory_bandwidth_Bps <= 0 or self.peak_flops <= 0 or self.launch_s < 0:
            raise SimError(f"hardware {self.name}: bandwidth and FLOPs must be positive")
        if self.cores is not None and self.cores < 1:
            raise SimError(f"hardware {self.name}: cores must be at least 1")

    def compute_time(self, nbytes: float, flops: float = 0.0) -> float:
        """Seconds for a step touching ``nbytes`` and doing ``flops``."""
        return max(nbytes / self.memory_bandwidth_Bps, flops / self.peak_flops) + self.launch_s

    def with_cores(self, cores: int | None) -> HardwareModel:
        return replace(self, cores=cores)


_LAUNCH = 4e-6
HARDWARE: dict[str, HardwareModel] = {
    h.name: h
    for h in (
        HardwareModel("H100", 3.35 * TB, 989e12, _LAUNCH),
        HardwareModel("H200", 4.8 * TB, 989e12, _LAUNCH),
        HardwareModel("H800", 3.35 * TB, 989e12, _LAUNCH),
        HardwareModel("B200", 8.0 * TB, 2250e12, _LAUNCH),
        HardwareModel("A100", 2.039 * TB, 312e12, _LAUNCH),
        HardwareModel("A800", 2.039 * TB, 312e12, _LAUNCH),
        HardwareModel("V100", 900 * GB, 125e12, _LAUNCH),
        HardwareModel("MI300X", 5.3 * TB, 1307e12, _LAUNCH),
        HardwareModel("MI300A", 5.3 * TB, 981e12, _LAUNCH),
        HardwareModel("MI250X", 1.6 * TB, 191.5e12, _LAUNCH),
        HardwareModel("MI250", 1.6 * TB, 181e12, _LAUNCH),
        HardwareModel("MI210", 1.6 * TB, 181e12, _LAUNCH),
        HardwareModel("RTX4090", 1008 * GB, 165e12, _LAUNCH),
        HardwareModel("RTX3090", 936 * GB, 71e12, _LAUNCH),
        # Placeholder: calibrate with `treeattn calibrate` (see treeattn.sim.profile).
        HardwareModel("cpu", 10 * GB, 100e9, 20e-6),
    )
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
