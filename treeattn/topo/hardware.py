"""Hardware constants: link bandwidths and latencies, with where each figure comes from.

Every bandwidth is bytes/s **per direction** of one link (a full-duplex link is two directed
edges, each with this figure). Every latency is seconds for one directed edge.

Latencies follow NCCL's tuning model (``src/graph/tuning.cc``: per-hop hardware latencies
of about 0.6 us on NVLink with the LL protocol, 1.0 us on PCIe and 2.7-5 us over the
network). A two-hop path (GPU -> NVSwitch -> GPU, GPU -> CPU -> GPU) splits the hop's latency
across its edges, so the GPU-to-GPU route adds up to NCCL's per-hop figure.

Per-GPU-model table (:data:`GPU_SPECS`): NVLink / xGMI, per link and direction:

============  ===========  ======  ==========  ==============================================
model         link         links   GB/s/link   source
============  ===========  ======  ==========  ==============================================
P100          NVLink1      4       20          NVIDIA Tesla P100 whitepaper (160 GB/s bidir)
V100          NVLink2      6       25          NVIDIA Tesla V100 whitepaper (300 GB/s bidir)
A100          NVLink3      12      25          NVIDIA A100 whitepaper (600 GB/s bidir)
A800          NVLink3      8       25          NVIDIA A800 product brief (400 GB/s bidir)
H100 / H200   NVLink4      18      25          NVIDIA H100 whitepaper (900 GB/s bidir)
H800          NVLink4      8       25          NVIDIA H800 product brief (400 GB/s bidir)
B200          NVLink5      18      50          NVIDIA Blackwell datasheet (1.8 TB/s bidir)
GB200         NVLink5      18      50          NVIDIA GB200 NVL72 datasheet (1.8 TB/s bidir)
RTX3090       NVLink3      4       14.0625     GeForce RTX 3090 spec, bridge 112.5 GB/s bidir
A6000         NVLink3      4       14.0625     RTX A6000 datasheet, bridge 112.5 GB/s bidir
MI250/MI250X  xGMI (IF3)   8       50          AMD CDNA2 whitepaper (100 GB/s bidir per link)
MI210         xGMI (IF3)   3       50          AMD MI210 datasheet (300 GB/s bidir, 3 links)
MI300X        xGMI (IF4)   7       64          AMD CDNA3 whitepaper (128 GB/s bidir per link)
MI300A        xGMI (IF4)   6       64          AMD CDNA3 whitepaper (128 GB/s bidir per link)
MI308X        xGMI (IF4)   7       64          same package as MI300X
RTX4090       none         0       -           GeForce RTX 4090: no NVLink, no P2P
============  ===========  ======  ==========  ==============================================

The same rows carry each model's compute figures, from which the simulator builds its
hardware models (:mod:`treeattn.sim.devices`): peak memory bandwidth and dense 16-bit tensor
throughput (BF16, or FP16 where the part has no BF16), from the vendor datasheets:

* H100 SXM5: 3.35 TB/s HBM3, 989 TFLOP/s (NVIDIA H100 Tensor Core GPU datasheet).
  H800 SXM5: as H100 (NVIDIA H800 product brief: same GPU, fewer NVLinks).
* H200 SXM: 4.8 TB/s HBM3e, 989 TFLOP/s (NVIDIA H200 datasheet).
* B200: 8 TB/s HBM3e, 2.25 PFLOP/s (NVIDIA DGX B200 datasheet, per GPU).
* GB200 (the Blackwell GPU of a GB200 superchip): 8 TB/s HBM3e, 2.5 PFLOP/s (NVIDIA GB200
  NVL72 datasheet: 576 TB/s and 180 PFLOP/s dense FP16/BF16 (360 with sparsity) for 72 GPUs).
* A100 SXM4 80 GB: 2.039 TB/s, 312 TFLOP/s (NVIDIA A100 datasheet). A800: as A100
  (NVIDIA A800 product brief: same GPU, fewer NVLinks).
* V100 SXM2: 900 GB/s, 125 TFLOP/s FP16 (NVIDIA V100 datasheet).
* P100 SXM2: 732 GB/s, 18.7 TFLOP/s FP16 (NVIDIA Tesla P100 datasheet; no tensor cores).
* RTX A6000: 768 GB/s GDDR6, 154.8 TFLOP/s dense FP16 tensor with FP32 accumulate
  (NVIDIA RTX A6000 datasheet).
* MI300X: 5.3 TB/s HBM3, 1307 TFLOP/s (AMD Instinct MI300X datasheet).
* MI300A: 5.3 TB/s, 981 TFLOP/s (AMD Instinct MI300A datasheet).
* MI308X: 5.3 TB/s (same HBM3 package as MI300X). AMD publishes no datasheet compute
  figure; we take MI300X's 1307 TFLOP/s, an assumption that does not move predictions
  because decode attention is memory-bound.
* MI250X / MI250 (per GCD, the unit a rank owns): 1.6 TB/s, 191.5 / 181 TFLOP/s
  (AMD Instinct MI250X / MI250 datasheets, halved per GCD).
* MI210: 1.6 TB/s, 181 TFLOP/s (AMD Instinct MI210 datasheet).
* RTX 4090: 1008 GB/s GDDR6X, 165 TFLOP/s BF16 with FP32 accumulate (NVIDIA Ada Lovelace
  architecture whitepaper, appendix table).
* RTX 3090: 936 GB/s, 71 TFLOP/s (NVIDIA Ampere GA102 whitepaper).
GPU memory capacity (:attr:`GpuSpec.memory_capacity`, bytes; the simulator refuses plans
whose shards do not fit), from the same datasheets: P100 16 GB, V100 32 GB, A100 80 GB (the
A100 SXM4 80 GB; the 40 GB part reports the same device family and is not told apart),
A800 / H100 / H800 80 GB, H200 141 GB, B200 180 GB (as sold in the DGX B200: 1,440 GB for 8
GPUs; the bare B200 part has 192 GB), GB200 186 GB (GB200 NVL72 datasheet: 13.4 TB HBM3e for
72 GPUs), RTX 3090 / RTX 4090 24 GB, RTX A6000 48 GB, MI250 / MI250X 64 GB per GCD (128 GB per
package), MI210 64 GB, MI300X / MI308X 192 GB, MI300A 128 GB (unified HBM3 shared with the
CPU cores). ``cpu`` has 0, meaning unknown (no capacity check).

* ``cpu``: 10 GB/s and 100 GFLOP/s, a placeholder until ``treeattn calibrate`` measures the
  machine (:func:`treeattn.testbed.host.profiles.hardware_from_profile`).
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 1e9
TB = 1e12
US = 1e-6


@dataclass(frozen=True)
class GpuSpec:
    """Peer-link and compute facts for one GPU model."""

    link: str  # "nvlink", "xgmi" or "" (none)
    links: int  # links per GPU
    link_bandwidth: float  # bytes/s per link per direction
    p2p: bool = True  # PCIe peer-to-peer allowed (False on GeForce 40xx)
    pcie_gen: int = 4  # host link generation (x16)
    memory_bandwidth: float = 0.0  # bytes/s, peak
    peak_flops: float = 0.0  # dense 16-bit tensor FLOP/s
    memory_capacity: float = 0.0  # bytes of device memory (0: unknown)


GPU_SPECS: dict[str, GpuSpec] = {
    "P100": GpuSpec("nvlink", 4, 20 * GB, pcie_gen=3,
            memory_bandwidth=732 * GB, peak_flops=18.7e12, memory_capacity=16 * GB),
    "V100": GpuSpec("nvlink", 6, 25 * GB, pcie_gen=3,
            memory_bandwidth=900 * GB, peak_flops=125e12, memory_capacity=32 * GB),
    "A100": GpuSpec("nvlink", 12, 25 * GB,
            memory_bandwidth=2.039 * TB, peak_flops=312e12, memory_capacity=80 * GB),
    "A800": GpuSpec("nvlink", 8, 25 * GB,
            memory_bandwidth=2.039 * TB, peak_flops=312e12, memory_capacity=80 * GB),
    "H100": GpuSpec("nvlink", 18, 25 * GB, pcie_gen=5,
            memory_bandwidth=3.35 * TB, peak_flops=989e12, memory_capacity=80 * GB),
    "H200": GpuSpec("nvlink", 18, 25 * GB, pcie_gen=5,
            memory_bandwidth=4.8 * TB, peak_flops=989e12, memory_capacity=141 * GB),
    "H800": GpuSpec("nvlink", 8, 25 * GB, pcie_gen=5,
            memory_bandwidth=3.35 * TB, peak_flops=989e12, memory_capacity=80 * GB),
    "B200": GpuSpec("nvlink", 18, 50 * GB, pcie_gen=5,
            memory_bandwidth=8.0 * TB, peak_flops=2250e12, memory_capacity=180 * GB),
    "GB200": GpuSpec("nvlink", 18, 50 * GB, pcie_gen=5,
            memory_bandwidth=8.0 * TB, peak_flops=2500e12, memory_capacity=186 * GB),
    "RTX3090": GpuSpec("nvlink", 4, 112.5 / 8 * GB,
            memory_bandwidth=936 * GB, peak_flops=71e12, memory_capacity=24 * GB),
    "A6000": GpuSpec("nvlink", 4, 112.5 / 8 * GB,
            memory_bandwidth=768 * GB, peak_flops=154.8e12, memory_capacity=48 * GB),
    "MI250": GpuSpec("xgmi", 8, 50 * GB,
            memory_bandwidth=1.6 * TB, peak_flops=181e12, memory_capacity=64 * GB),
    "MI250X": GpuSpec("xgmi", 8, 50 * GB,
            memory_bandwidth=1.6 * TB, peak_flops=191.5e12, memory_capacity=64 * GB),
    "MI210": GpuSpec("xgmi", 3, 50 * GB,
            memory_bandwidth=1.6 * TB, peak_flops=181e12, memory_capacity=64 * GB),
    "MI300X": GpuSpec("xgmi", 7, 64 * GB, pcie_gen=5,
            memory_bandwidth=5.3 * TB, peak_flops=1307e12, memory_capacity=192 * GB),
    "MI300A": GpuSpec("xgmi", 6, 64 * GB, pcie_gen=5,
            memory_bandwidth=5.3 * TB, peak_flops=981e12, memory_capacity=128 * GB),
    "MI308X": GpuSpec("xgmi", 7, 64 * GB, pcie_gen=5,
            memory_bandwidth=5.3 * TB, peak_flops=1307e12, memory_capacity=192 * GB),
    "RTX4090": GpuSpec("", 0, 0.0, p2p=False,
            memory_bandwidth=1008 * GB, peak_flops=165e12, memory_capacity=24 * GB),
    "cpu": GpuSpec("", 0, 0.0,
            memory_bandwidth=10 * GB, peak_flops=100e9),
}

# PCI device IDs (pci.ids) and SM / gfx versions -> model, for the NCCL/RCCL XML importer.
# MI250 and MI250X (0x7408 / 0x740c, gfx90a) share the xGMI figures, so both map to "MI250".
PCI_DEVICE_MODELS = {
    "0x2330": "H100", "0x2331": "H100", "0x2335": "H200", "0x20b0": "A100", "0x20b2": "A100",
    "0x20b5": "A100", "0x20f1": "A100", "0x2204": "RTX3090", "0x2684": "RTX4090",
    "0x2230": "A6000", "0x1db1": "V100", "0x1db5": "V100", "0x15f8": "P100",
    "0x74a1": "MI300X", "0x74b5": "MI300X", "0x74a2": "MI308X", "0x74a0": "MI300A",
    "0x7408": "MI250", "0x740c": "MI250", "0x740f": "MI210",
}
SM_MODELS = {"60": "P100", "70": "V100", "80": "A100", "86": "RTX3090", "89": "RTX4090",
             "90": "H100", "100": "B200"}
GFX_MODELS = {"gfx942": "MI300X", "gfx90a": "MI250"}
# nvidia-smi prints NV# = links between a pair; with NVSwitch that is all of a GPU's links.
NV_COUNT_MODELS = {18: "H100", 12: "A100", 8: "A800", 6: "V100", 4: "RTX3090"}

# NVLink: NCCL's 0.6 us per NVLink hop, split over GPU->NVSwitch and NVSwitch->GPU.
NVLINK_HOP_LATENCY = 0.6 * US
XGMI_HOP_LATENCY = 0.6 * US  # RCCL reuses NCCL's NVLink figure for xGMI
# PCIe: NCCL's 1.0 us for a GPU-to-GPU PCIe path, split over its four edges
# (GPU -> switch -> CPU -> switch -> GPU); UPI adds a little on top when crossing sockets.
PCIE_EDGE_LATENCY = 0.25 * US
UPI_LATENCY = 0.4 * US
# PCIe effective bandwidth per direction (x16): gen3 15.75 raw, gen4 31.5 raw, gen5 63 raw
# (PCI-SIG); ~80% after TLP/DLLP overhead, as nvbandwidth/p2pBandwidthLatencyTest show.
PCIE_BANDWIDTH = {3: 12 * GB, 4: 25 * GB, 5: 50 * GB}
# Cross-socket host-memory copy on a 4090 box: SYS paths copy at ~10 GB/s (an estimate
# for desktop boards without P2P; calibrate for your machine).
UPI_BANDWIDTH_DESKTOP = 10 * GB
# Inter-socket bandwidth NCCL assumes for GPU traffic (src/graph/topo.h): Sapphire Rapids
# UPI ~24 GB/s, Skylake-era UPI ~10 GB/s, AMD Infinity Fabric between sockets ~16 GB/s.
UPI_BANDWIDTH_SPR = 24 * GB
UPI_BANDWIDTH_AMD = 16 * GB
# InfiniBand NDR: 400 Gb/s = 50 GB/s per direction per port (one rail per GPU).
IB_NDR_BANDWIDTH = 400e9 / 8
# InfiniBand HDR / 200 GbE (ConnectX-6) for the 4090 boxes: 25 GB/s per direction.
IB_HDR_BANDWIDTH = 200e9 / 8
# InfiniBand XDR 800 Gb/s (ConnectX-8 SuperNIC): 100 GB/s per direction.
IB_XDR_BANDWIDTH = 800e9 / 8
# Network: NCCL's 2.7 us (hwLat NET, ring LL) for a NIC-leaf-NIC hop, split over NIC->leaf
# and leaf->NIC (1.35 us each); each extra switch level (leaf -> spine -> leaf) adds 0.5 us
# per edge (switch port-to-port). NCCL/RCCL messages take their per-protocol hop latency
# from the library's table instead (treeattn.sim.nccl.p2p); these link figures price gloo.
IB_EDGE_LATENCY = 1.35 * US
IB_SPINE_LATENCY = 0.5 * US
# NDR switch (Quantum-2 QM9700): 64 ports of 400 Gb/s.
IB_SWITCH_PORTS = 64
# Loopback defaults for the ``local`` builder (the runtime's calibration replaces them).
LOOPBACK_LATENCY = 20 * US
LOOPBACK_BANDWIDTH = 5 * GB


def gpu_spec(model: str) -> GpuSpec:
    """Return the facts for ``model`` (case-insensitive), or raise ``KeyError``.

    >>> gpu_spec("h100").links
    18
    """
    key = normalize_model(model)
    return GPU_SPECS[key]


def normalize_model(model: str) -> str:
    """Canonical spelling of a GPU model name: ``"rtx 3090"`` -> ``"RTX3090"``.

    >>> normalize_model("mi300x")
    'MI300X'
    """
    key = model.strip().replace(" ", "").replace("-", "").upper()
    if key == "CPU":
        return "cpu"
    for prefix in ("NVIDIA", "GEFORCE", "AMD", "INSTINCT", "TESLA"):
        key = key.removeprefix(prefix)
    if key in ("3090", "4090"):
        key = "RTX" + key
    for name in GPU_SPECS:
        if key == name.upper():
            return name
    for name in GPU_SPECS:  # "A100SXM440GB" -> "A100", "H100SXM" -> "H100"
        if name != "cpu" and key.startswith(name.upper()):
            return name
    return key
