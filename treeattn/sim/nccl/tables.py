"""The constants of NCCL's and RCCL's collective tuning model, each with its source.

Nothing here is fitted to a measurement: every figure is read from the libraries' public
source, so the fidelity report (``benchmarks/fidelity.py``) is a real test of the model.
Calibration against a user's own nccl-tests output is a separate, explicit step.

Sources
-------
========  =============================================================================
key       where the figures come from
========  =============================================================================
NCCL      NVIDIA/nccl 2.30.7 (commit 5067397c), ``src/graph/tuning.cc``:
          ``baseLat``, ``hwLat``, ``llMaxBws``, ``perChMaxRingLL128Bws``,
          ``perChMaxTreeLL128Bws``, ``perChMaxTreeBws``, ``perChMaxNVLSTreeBws``,
          ``treeCorrectionFactor``, ``nvlsEfficiency``; ``src/graph/search.cc``: the
          per-channel search speeds; ``src/graph/topo.h``: NCCL's NVLink bandwidth per
          link (``SM80_NVLINK_BW`` 20, ``SM86`` 12, ``SM90`` 20.6, ``SM100`` 40.1 GB/s).
NCCL-p2p  ``src/enqueue.cc`` (``addP2pToPlan``): a send/recv uses LL while its bytes are at
          most ``nChannels × NCCL_P2P_LL_THRESHOLD`` (16 KiB), Simple above. ``nChannels``
          is ``min(nChannelsMin, ceil(bytes / minPartSize))`` with ``minPartSize`` the p2p
          chunk over 8 on one node and over 2 on several (``src/init.cc``: 512 KiB on an
          all-NVLink node, 128 KiB on PCIe and across nodes): 64 KiB parts on NVLink and
          the network, so one channel and LL up to 16 KiB; 16 KiB parts on one PCIe node,
          so up to ``nChannelsMin`` (2) channels and LL up to 32 KiB. LL also needs the
          connection's LL buffer, which a network connection has only under
          ``NCCL_ALLOC_P2P_NET_LL_BUFFERS=1`` (``src/init.cc``, default 0) or with its
          own buffers, ``NCCL_NET_SHARED_BUFFERS=0`` (``src/transport/net.cc``). NCCL
          keeps no latency table for p2p (our analogy: one hop, see
          :mod:`treeattn.sim.nccl.collectives`).
NCCL-net  ``src/graph/tuning.cc`` ``getNetOverhead``: the network post overhead a multi-node
          ring step cannot go below, 1 µs on x86 Intel hosts, 2 µs on x86 AMD hosts, 1 µs
          otherwise (×3 for Simple); ``llMaxBws`` rows for several nodes are picked by the
          CPU vendor (AMD or mixed: the second row); the tree's bus bandwidth ×0.85 when the
          tree graph has pattern ``NCCL_TOPO_PATTERN_TREE`` (``search.cc`` forces it when a
          node holds one GPU of the communicator). RCCL (commit 03a89144) keeps the same
          ``getNetOverhead``, the same ring rule and the same one-GPU-per-node rule for the
          network hop latency (the tree's, ``ppn == 1``).
RCCL      ROCm/rocm-systems ``projects/rccl/src/graph/tuning.cc`` (commit 03a89144):
          RCCL's own ``baseLat`` and ``tuning_model_5`` (gfx942, MI300X) hardware
          latencies, bandwidth ratios and correction factors (``ncclTopoGetAlgoTime``
          multiplies them into the time the tuner ranks by; we rank by it too, but price
          the pick without them: RCCL's entries are selection weights, 0.1 to 5.5, not
          measured bandwidth fractions like NCCL's); ``rccl_wrap.cc``: the
          per-rank LL size limits applied after the model; ``topo.h``:
          ``GFX94X_XGMI_WIDTH`` 48 GB/s, MI200 36 GB/s.
MSCCL     ROCm/rccl ``src/misc/msccl/msccl_lifecycle.cc`` (``mscclEnqueueCheck``: an
          all-reduce first tries a loaded MSCCL schedule and never reaches the tuner if one
          matches), ``src/graph/rome_models.cc`` (the 8×MI300X model sets ``mscclEnabled=1``),
          and the XML headers in ``tools/msccl-algorithms/`` as of ROCm 6.3 (rccl PR #1375):
          the all-pairs all-reduce ``allreduce-allpairs-8n-ll-32tb(-op)``, LL, 4 channels,
          256 chunks per loop, 0–65536 bytes, two dependent direct hops. On by default for
          one 8-GPU gfx942 node from RCCL 2.21.5 (ROCm 6.3, MSCCL allowed in single-process
          runs) until MSCCL's removal (ROCm/rocm-systems PR #4340, 2026; TheRock builds
          already set ``ENABLE_MSCCL_KERNEL=OFF``).
logs      Channel counts NCCL's search reports on a DGX H100 (ring/tree ``nChannels 12,
          bw 30``, NVLS ``nChannels 8, bw 40/60``) in NVIDIA/nccl issues #1197 and #1410.
NCCL-grp  The group's channels and NVLS, same commit: ``src/graph/search.cc``
          (``ncclTopoCompute``: speed arrays per generation, the lower-speed retry, the NVLS
          graph's one channel per GPU up to ``NCCL_MAX_NVLS_ARITY``, ``ncclTopoSearchTryNvls``,
          ``ncclTopoDupChannels``); ``src/init.cc`` (ring graph ``maxChannels``);
          ``src/graph/connect.cc`` (compute channels = twice the search channels, twice
          again on sm90+ across nodes for a ring above 45 GB/s under 16 channels);
          ``src/graph/paths.cc`` (p2p channels per peer); ``src/enqueue.cc`` (an all-to-all's
          per-peer channels, fp8 reductions: refused below sm90, deep rings ×1024);
          ``src/include/device.h`` ``ncclNvlsSupported`` (the dtypes and ops NVLS reduces);
          ``src/transport/nvls.cc`` (NVLS needs 2 GPUs).
NCCL-chan ``src/enqueue.cc`` ``topoGetAlgoInfo``: a ring or tree kernel runs a message on
          fewer channels the smaller it is (``NCCL_THREAD_THRESHOLD``, ``NCCL_MAX_THREADS``
          below; ``src/include/comm.h``, ``device.h``; ``tuning.cc`` maxThreads and the
          ring's LL threshold × ranks).
NCCL-gen  The generation of the GPUs under NCCL's latency tables. ``baseLat`` and ``hwLat``
          have no architecture index (unlike ``llMaxBws`` and the ``perChMax*`` rows,
          indexed by ``compCapIndex``) and were last retuned in NCCL 2.18.1 (commit
          d97a32fa, 2023: ring LL base 3.6 to 6.6 µs, NVLink LL hop 0.47 to 0.6 µs), the
          Hopper launch release; the H100 families of ``benchmarks/fidelity.py`` match them.
          NCCL ranks algorithms by these figures as they are, on every generation. We
          scale the node-local part (base and NVLink/PCIe hops; not the network hop) by
          :data:`NCCL_GEN_LATENCY_SCALE`, each row with its own source there, for the
          price only: the pick is ranked on the unscaled figures, as NCCL ranks it
          (``collectives._nvidia_costs``), so the factor never moves a switch point. A
          calibration (``calibrate --nccl-tests``) does move them: its scales describe
          the cluster the measurement ran on, picks included, and rank and price alike.
========  =============================================================================

Units: latencies in µs and bandwidths in GB/s (1e9 B/s), as in the sources; the model in
:mod:`treeattn.sim.nccl.collectives` converts to seconds and bytes.
"""

from __future__ import annotations

PROTOCOLS = ("LL", "LL128", "Simple")
NCCL_ALGORITHMS = ("tree", "ring", "nvls", "nvls_tree", "pat")
HW_CLASSES = ("nvlink", "pci", "net")

# --- NVIDIA (NCCL 2.30.7) -----------------------------------------------------------------
# baseLat[algorithm][protocol], µs. NVLS and NVLS-tree have no base: their hop latency is the
# whole cost.
NCCL_BASE_LAT = {
    "tree": (6.8, 14.0, 8.4),
    "ring": (6.6, 14.0, 8.4),
    "nvls": (0.0, 0.0, 0.0),
    "nvls_tree": (0.0, 0.0, 0.0),
    "pat": (8.0, 8.0, 8.0),
}
# hwLat[hw class][algorithm][protocol], µs per hop.
NCCL_HW_LAT = {
    "nvlink": {"tree": (0.6, 1.25, 4.0), "ring": (0.6, 1.9, 3.4), "nvls": (0, 0, 25.0),
               "nvls_tree": (0, 0, 25.0), "pat": (0, 0, 4.0)},
    "pci": {"tree": (1.0, 1.9, 4.0), "ring": (1.0, 2.5, 5.7), "nvls": (0, 0, 0.0),
            "nvls_tree": (0, 0, 0.0), "pat": (0, 0, 4.0)},
    "net": {"tree": (5.0, 8.5, 14.0), "ring": (2.7, 4.0, 14.0), "nvls": (0, 0, 18.0),
            "nvls_tree": (0, 0, 20.9), "pat": (0, 0, 14.0)},
}
# Per-architecture caps, columns = (1 node, 2 nodes, more). llMaxBws rows are indexed by the
# architecture on one node and by the host CPU on several (Intel: the first row).
NCCL_LL_MAX_BW = {"volta": (39.0, 39.0, 20.4), "ampere": (87.7, 22.5, 19.0),
                  "hopper": (141.0, 45.0, 35.0), "blackwell": (282.0, 90.0, 70.0)}
NCCL_LL_MAX_BW_MULTINODE_INTEL = (39.0, 39.0, 20.4)
NCCL_LL_MAX_BW_MULTINODE_AMD = (87.7, 22.5, 19.0)  # AMD or mixed hosts (llMaxBws row 1)
NCCL_PER_CH_RING_LL128 = {"volta": (20.0,) * 3, "ampere": (20.0,) * 3,
                          "hopper": (36.7,) * 3, "blackwell": (40.0,) * 3}
NCCL_PER_CH_TREE_LL128 = {"volta": (20.0,) * 3, "ampere": (20.0,) * 3,
                          "hopper": (36.7, 36.7, 29.0), "blackwell": (55.6, 31.67, 20.0)}
NCCL_PER_CH_TREE = {"volta": (26.5, 18.5, 10.0), "ampere": (24.0, 23.6, 17.8),
                    "hopper": (38.7, 41.4, 36.0), "blackwell": (70.0, 42.8, 24.0)}
NCCL_PER_CH_NVLS_TREE = {"hopper": (0.0, 57.7, 45.5), "blackwell": (0.0, 96.0, 80.0)}
NCCL_NVLS_EFFICIENCY = {"hopper": 0.85, "blackwell": 0.74}
# treeCorrectionFactor[protocol][log2(bytes / 64)], for all-reduce over a tree: NCCL's tuner
# ranks by the entry as a step; the price joins the entries linearly in log2(bytes) between
# powers of two (collectives.tree_correction).
# tuning.cc reads the first 23 entries for the tree (``logSize < 23``) and all 24 for
# NVLS_TREE, which it corrects only where ``minCompCap >= 100`` and the hosts' CPU arch is
# x86 (``NCCL_TOPO_CPU_ARCH_X86``: Intel or AMD on every rank; init.cc marks differing
# arches MIXED).
NCCL_TREE_CORRECTION = {
    "LL": (1, 1, 1, 1, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1, 1, 1, 1,
           1),
    "LL128": (1, 1, 1, 1, 1, .9, .8, .8, .8, .7, .6, .6, .6, .6, .6, .6, .8, .9, .9, .9, .9, 1,
              1, 1),
    "Simple": (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7,
               .8, .9, .9, .9),
}
NCCL_TREE_CORRECTION_ENTRIES = {"tree": 23, "nvls_tree": 24}
NCCL_NVLS_TREE_CORRECTION_MIN_COMP_CAP = 100
# NCCL-gen: the factor on NCCL's node-local latencies (base and NVLink/PCIe hop) for each
# GPU generation; Hopper is what the tables describe. Each row's source:
# - volta, ampere: NCCL's LL/LL128/Simple steps are device loops (store data and flag to the
#   peer, spin on the local flag, reduce, forward) whose cost is counted in SM cycles, so we
#   scale it with the SM clock: the H100/H200 SXM's 1980 MHz boost over the A100 SXM4's 1410
#   MHz and the V100 SXM2's 1530 MHz (GPU boost clocks in the comparison tables of NVIDIA's
#   "A100 Tensor Core GPU Architecture" and "Tesla V100 GPU Architecture" whitepapers; the
#   H100 SXM5's maximum SM clock as nvidia-smi reports it). The P100 runs NCCL's Volta rows
#   (it has no row of its own) but its own clock, 1480 MHz (P100 SXM2 boost, NVIDIA's "Tesla
#   P100" datasheet): :data:`NCCL_GEN_LATENCY_SCALE_OF_MODEL`. An A100 8-GPU ring LL
#   all-reduce at 8 B: (6.6 + 14 x 0.6) x 1980 / 1410 = 21.1 µs. The only public A100 floor
#   (ABCI, NCCL 2.8.4, in benchmarks/fidelity.py) reads two ways: against that release's
#   own tables (ring LL base 3.6 µs, NVLink LL hop 0.47 µs: 10.2 µs on 8 GPUs, 6.4 on 4)
#   its measured 17.0 and 11.9 µs are 1.67x and 1.85x, consistent with a generation factor
#   (the clock ratio, 1.40, is part of it); against 2.30.7's tables, which this model
#   prices, the clock-scaled model is 1.13-1.25x slow there (21.1 and 14.3 µs).
# - blackwell: 3.0 / 2.3 = 1.30, the ratio of two device-side small-message floors taken
#   the same way on both generations: NVIDIA/nccl issue #1940 (2025-12-12) times NCCL's
#   symmetric all-reduce at 8 B on 8 GPUs (symmetric buffers, "exactly the same tuning
#   methods" on both): "around 3 µs" on 8 B200s, "about 2.3 µs" on 8 H800s or H200s (the
#   B200 figure matches NVIDIA/nccl-tests issue #333, 2025-10-01: "just over 3
#   microseconds" with symmetric buffers and CUDA graphs). Floors that low have the host's
#   launch out of the timing; what is left is the NVLink round trip and flag polling that
#   also make the legacy LL kernels' base and per-hop cost, and our assumption is that
#   those scale alike. Not a clock effect (B200 clocks match the H100
#   SXM5's: chipsandcheese, "Nvidia's B200: Keeping the CUDA Juggernaut Rolling"), and not a
#   rule of NCCL 2.30.7's tuner: baseLat/hwLat have no compCap index; the LL/LL128/Simple
#   device code has no sm100 branch (src/device: only >= 700/800/900 guards); the sm100
#   rules found (search.cc speed arrays, topo.h SM100_NVLINK_BW, the Blackwell llMaxBws and
#   perChMax* rows, nvlsEfficiency 0.74, nvls.cc channel counts, enqueue.cc's CE all-gather
#   above 8 MB, the NVLink-centric scheduling launch attribute, off by default) set
#   bandwidths or need registered buffers. NCCL's own symmetric-kernel model
#   (sym_kernels.cc queryModel_lsa) does charge Blackwell more (LL base 11 µs for an
#   all-reduce, 8.5 for an all-gather, against Hopper's 4.5), but as selection weights far
#   above the 3 µs measured, so its ratio is not used. A 4-GB200 ring LL all-reduce at 8 B:
#   (6.6 + 6 x 0.6) x 1.30 = 13.3 µs, under the Azure ND GB200 v6 single-process -g 4 run's
#   16 µs floor (github.com/Azure/AI-benchmarking-guide @ 2a370be6, NCCL 2.25.1), an upper
#   bound (one host thread launches the 4 GPUs' kernels; not scored, as the H100 -g 4
#   run's 23 µs is not).
# Generations without a row (PCIe-class sm86/sm89 boards) keep NCCL's figures.
NCCL_GEN_LATENCY_SCALE = {"volta": 1980 / 1530, "ampere": 1980 / 1410, "hopper": 1.0,
                          "blackwell": 3.0 / 2.3}
NCCL_GEN_LATENCY_SCALE_OF_MODEL = {"P100": 1980 / 1480}  # a model's own clock, where it
# differs from its generation row's
# Network post overhead folded into the intra-node hop of a multi-node ring, by host CPU
# vendor (getNetOverhead; anything but x86 Intel/AMD: 1 µs), ×3 for Simple; and the
# multi-node ring Simple all-reduce latency factor beyond 64 B per channel-rank.
NCCL_NET_OVERHEAD_US = {"intel": 1.0, "amd": 2.0, "other": 1.0}
NCCL_NET_OVERHEAD_SIMPLE_FACTOR = 3
NCCL_TREE_PATTERN_FACTOR = 0.85  # tree bus bandwidth when the tree graph is PATTERN_TREE
# tuning.cc ``ncclTopoGetAlgoTime``: ``minCompCap < 80 ? 1.9 : 1.4`` ("Plateau effect of
# ring"), by the compute capability of the arch row (NCCL_COMP_CAP)
NCCL_RING_SIMPLE_PLATEAU = {"below_comp_cap": 80, "below": 1.9, "from": 1.4}
# Per-channel search speeds, GB/s, tried from high to low (search.cc: speedArrayIntra/Inter
# before Hopper, sm90SpeedArray*, sm100SpeedArray* from Blackwell on).
NCCL_SPEEDS_INTRA = {"blackwell": (90, 80, 70, 60, 50, 45, 40, 30, 24, 20, 19, 18),
                     "hopper": (60, 50, 40, 30, 24, 20, 15, 12, 11, 6, 3),
                     "other": (40, 30, 20, 18, 15, 12, 10, 9, 7, 6, 5, 4, 3)}
NCCL_SPEEDS_INTER = {"blackwell": (96, 86, 80, 48, 45.1, 42, 40, 30, 24, 22, 20, 17.5, 15, 12, 6,
                                   3, 2.4, 1.2, 0.24, 0.12),
                     "hopper": (48, 45, 42, 40, 30, 24, 22, 20, 17.5, 15, 12, 6, 3, 2.4, 1.2,
                                0.24, 0.12),
                     "other": (48, 30, 28, 24, 20, 18, 15, 12, 10, 9, 7, 6, 5, 4, 3, 2.4, 1.2,
                               0.24, 0.12)}
# The ring search (search.cc ``ncclTopoCompute``): from the first speed that fits, lower
# speeds are tried while they are above this fraction of the one found (``> .49``), a graph
# replacing another only with more channels × speed; init.cc caps a ring graph at
# MAXCHANNELS / 2 channels.
NCCL_SEARCH_LOWER_SPEED_FRACTION = 0.49
# ncclTopoDupChannels: a graph found at this speed or more is doubled (channels × 2, speed
# / 2), except from Hopper on (ccMin > 80) below the second speed with more than 4 channels.
NCCL_DUP_CHANNELS_MIN_SPEED = 25.0
NCCL_DUP_CHANNELS_SM90_SPEED = (50.0, 4)
# connect.cc ``ncclTopoPostset``: the rings run on twice the search channels (``nChannels *
# 2``, at most MAXCHANNELS = 64); every p2p operation runs on these compute channels. Then
# (NCCL 2.30.7 src/graph/connect.cc, "Use 4 compute channels per search channel to reach
# peak BW on <8 PPN") they are doubled once more when ``minCompCap >= 90``, the communicator
# spans more than one node, the ring graph's ``bwIntra`` is above 45 GB/s and the channels
# (already doubled) are fewer than 16: a rail group of one H100 or B200 per node (1 search
# channel at 48 GB/s) runs 4 compute channels (group_shape.compute_channel_count).
NCCL_MAX_CHANNELS = 64
NCCL_COMPUTE_CHANNELS_PER_SEARCH = 2
NCCL_COMPUTE_CHANNELS_REDOUBLE = {"min_comp_cap": 90, "min_ring_bw_intra": 45.0,
                                  "below_channels": 16}
# The compute capability NCCL's tuning compares (``comm->minCompCap``) for each arch row:
# sm70 (Volta; the P100's sm60 is also below every threshold used), sm80, sm86/sm89 boards,
# sm90, sm100 (B200 and GB200).
NCCL_COMP_CAP = {"volta": 70, "ampere": 80, "ampere-sm86": 86, "hopper": 90, "blackwell": 100}
# enqueue.cc ``topoGetAlgoInfo``: the channels a ring or tree kernel runs on shrink with the
# message: one is dropped while bytes < channels × threads × threshold. Per-thread thresholds
# (comm.h ``NCCL_{LL,LL128,SIMPLE}_THREAD_THRESHOLD``; tuning.cc multiplies the ring's LL one
# by the ranks) and the protocols' default threads (device.h ``NCCL_LL_MAX_NTHREADS``,
# ``NCCL_LL128_MAX_NTHREADS``, ``NCCL_SIMPLE_MAX_NTHREADS``; tuning.cc maxThreads: a ring's
# Simple runs 256 threads where its graph carries at most ``PCI_BW`` = 12 GB/s, topo.h).
NCCL_THREAD_THRESHOLD = {"LL": 8, "LL128": 8, "Simple": 64}
NCCL_MAX_THREADS = {"LL": 512, "LL128": 640, "Simple": 512}
NCCL_SLOW_RING_SIMPLE = (12.0, 256)  # (PCI_BW GB/s, Simple threads at or below it)
# NVLS (search.cc): one channel per GPU of the node (``maxChannels = min(NCCL_MAX_NVLS_ARITY
# = 32, ngpus)``, ``minChannels = maxChannels`` on one node); a channel's head GPU carries
# twice the channel's speed on its NVLinks (``ncclTopoSearchTryNvls``: ``d == g ? 2 : 1``),
# so every GPU carries ``(channels + 1) × speed``. Pass 2 raises ``bwInter`` while it is below
# twice ``bwIntra``. NVLS needs at least 2 GPUs (nvls.cc ``ncclNvlsInit``: ``gpuCount < 2``)
# and 2 channels (tuning.cc), multicast (NVSwitch, sm90+).
NCCL_MAX_NVLS_ARITY = 32
# Which (op, dtype) NVLS reduces (src/include/device.h ``ncclNvlsSupported``, kept in sync
# with the kernels generate.py builds): sums and min/max of 32/64-bit integers, fp16 and
# bf16; sums only of fp32 and fp64; nothing else (no int8/uint8, no fp8). An all-gather
# moves bytes and runs on NVLS whatever the dtype (enqueue.cc: ``|| func == AllGather``).
NCCL_NVLS_REDUCTIONS = {
    "int32": ("sum", "max", "min"), "uint32": ("sum", "max", "min"),
    "int64": ("sum", "max", "min"), "uint64": ("sum", "max", "min"),
    "float16": ("sum", "max", "min"), "bfloat16": ("sum", "max", "min"),
    "float32": ("sum",), "float64": ("sum",),
}
# nccl.h ``ncclDataType_t``: every dtype NCCL's collectives take, with its bytes (fp8 from
# NCCL 2.24 on sm90+); the reductions NCCL has for all of them (``ncclRedOp_t``).
NCCL_DTYPES = {"int8": 1, "uint8": 1, "int32": 4, "uint32": 4, "int64": 8, "uint64": 8,
               "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8,
               "float8_e4m3": 1, "float8_e5m2": 1}
NCCL_REDUCTIONS = ("sum", "prod", "max", "min", "avg")
# enqueue.cc: an fp8 reduction on a ring of more than 8 ranks has its estimate × 1024, so
# any other algorithm is picked first (precision loss of deep fp8 rings)
NCCL_FP8_DEEP_RING_PENALTY = 1024.0
NCCL_DTYPE_ALIASES = {"fp16": "float16", "half": "float16", "bf16": "bfloat16",
                      "fp32": "float32", "float": "float32", "fp64": "float64",
                      "double": "float64", "fp8": "float8_e4m3", "float8": "float8_e4m3",
                      "e4m3": "float8_e4m3", "e5m2": "float8_e5m2", "char": "int8"}
# p2p channels (paths.cc): per peer ``2 × max(1, pathBw / NVLinkBw)`` on NVLink, 2 on PCIe,
# ``max(NICs, netBw / NCCL_P2P_PER_CHANNEL_NET_BW)`` (14 GB/s) across nodes, the smallest
# over peers, a power of two (``p2pnChannelsPerPeer``), at most the communicator's p2p
# channels (its compute channels rounded up to a power of two). A grouped send/recv to every
# peer (enqueue.cc ``scheduleP2pTasksToPlan``) halves the per-peer channels until they times
# the ranks fit in the p2p channels, so the peers run side by side.
NCCL_P2P_PER_CHANNEL_NET_BW = 14.0
# p2p operations one channel runs side by side in one work batch (device.h
# NCCL_MAX_DEV_WORK_P2P_PER_BATCH), also the p2p schedule's group of ranks on several nodes
# (init.cc NCCL_P2P_SCHEDULE_GROUP_SIZE's default)
NCCL_MAX_DEV_WORK_P2P_PER_BATCH = 8
# NCCL's usable bandwidth per NVLink, GB/s (topo.h); line rate is 25 (NVLink3/4), 50 (NVLink5).
NCCL_NVLINK_BW = {"volta": 20.0, "ampere": 20.0, "ampere-sm86": 12.0, "hopper": 20.6,
                  "blackwell": 40.1}
NCCL_NVLS_GRAPH = (8, 40.0, 60.0)  # logs: NVLS graph channels, intra and inter GB/s (8 H100s)
NCCL_MAX_SEARCH_CHANNELS = 32  # init.cc: ring graph maxChannels = MAXCHANNELS / 2
NCCL_P2P_LL_THRESHOLD = 16384  # bytes per channel
NCCL_P2P_CHANNELS = 2  # p2p channels per peer on PCIe (paths.cc); NVLink peers get more
# p2p chunk sizes (init.cc): on one all-NVLink node, otherwise (PCIe, several nodes); the
# minimum part per channel is the chunk over 8 on one node, over 2 on several (enqueue.cc).
NCCL_P2P_CHUNK = {"nvlink": 1 << 19, "other": 1 << 17}

# --- AMD (RCCL, tuning model 5: gfx942 / MI300X) -----------------------------------------
RCCL_BASE_LAT = {"tree": (12.0, 12.0, 17.0), "ring": (12.0, 12.0, 17.0)}
RCCL_HW_LAT = {
    "nvlink": {"tree": (0.9, 0.9, 2.3), "ring": (0.8, 0.8, 2.1)},  # xGMI
    "pci": {"tree": (2.2, 2.2, 5.7), "ring": (2.2, 2.2, 5.7)},
    "net": {"tree": (10.5, 10.5, 25.0), "ring": (9.5, 9.5, 320.0)},
}
# bwRatio[(≤2 nodes, more)][algorithm][protocol] multiplies the bus bandwidth.
RCCL_BW_RATIO = {
    "tree": ((0.06, 0.06, 0.11), (0.06, 0.06, 0.59)),
    "ring": ((0.08, 0.08, 1.00), (0.08, 0.08, 1.00)),
}
# Correction factors by log2(bytes / 64), clamped to 0..26 (64 B .. 4 GiB).
RCCL_TREE_CORRECTION = {
    "LL": (.1,) * 6 + (1, 1, 1, 1, 1, .6, 1, .9, 1, 1) + (.1,) * 11,
    "Simple": (.1,) * 15 + (.7, 1, 1, 1, 1, 1, .7, .7, .5, .6, .6, .6),
}
RCCL_RING_CORRECTION = {  # applied on several nodes only
    "LL": (.1,) * 11 + (1, .2, 1, .4, .4, .1, .2, .2) + (.1,) * 8,
    "Simple": (.1,) * 22 + (.7, .2, 1, 1, 1),
}
# Per-rank byte limits up to which RCCL forces LL after the model (rccl_wrap.cc, gfx942).
RCCL_LL_MAX_PER_RANK_MULTINODE = {"all_reduce": 524288, "all_gather": 98304,
                                  "reduce_scatter": 655360, "broadcast": 8192}
RCCL_LL_MAX_PER_RANK_RS_ONE_NODE = 352128
RCCL_XGMI_BW = {"cdna3": 48.0, "cdna2": 36.0}  # GB/s per xGMI link as RCCL models it
# RCCL's MSCCL all-pairs all-reduce on one 8-GPU gfx942 node (ROCm 6.3 XML set). It has no
# cost of its own in RCCL: we price it with the tuner's ring LL base and xGMI hop latency,
# two hops, and each link carrying 2 × bytes/8 (our structural assumption).
RCCL_MSCCL_ALLREDUCE = {"arch": "cdna3", "ranks": 8, "protocol": "LL", "hops": 2,
                        "chunks_per_loop": 256, "element_bytes": 4,
                        "min_bytes": 0, "max_bytes": 65536}

# --- GPU model -> family and architecture ---------------------------------------------------
# GPUs sold in multi-node NVLink racks, whose trays share one NVLink fabric with fabric
# memory handles (IMEX): the GB200 NVL72 (NVIDIA GB200 NVL72 datasheet; FlashInfer's MNNVL
# kernels need it, SGLang issue #33355)
MNNVL_MODELS = ("GB200",)

ARCH_OF_MODEL = {
    "P100": "volta", "V100": "volta", "A100": "ampere", "A800": "ampere",
    "RTX3090": "ampere-sm86", "A6000": "ampere-sm86", "RTX4090": "ampere-sm86",
    "H100": "hopper", "H200": "hopper", "H800": "hopper", "B200": "blackwell",
    "GB200": "blackwell",
    "MI300X": "cdna3", "MI308X": "cdna3", "MI300A": "cdna3",
    "MI250": "cdna2", "MI250X": "cdna2", "MI210": "cdna2",
}
