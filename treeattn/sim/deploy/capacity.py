"""Whole-model memory and weight traffic per GPU: what a deployment holds and what one decode
step reads.

A deployment (:class:`Split`) runs ``tp`` tensor-parallel ranks per model replica, ``dcp`` of
them also sharding the KV cache along the sequence (decode context parallelism inside the
TP group, vLLM's and SGLang's ``-dcp``: no extra GPUs), and ``cp`` context-parallel
replicas of that TP group (extra GPUs, each holding a ``1/cp`` slice of every sequence, as in
Meta's context-parallel inference). ``gpus = tp × cp``; the sequence is sharded over
``dcp × cp`` ranks and the attention heads over ``tp / dcp``.

Per GPU, in bytes (``wb`` the weight dtype's bytes, ``L`` layers, ``E`` the hidden size):

* **weights held**: every layer's projections and MLP (or experts) divided by ``tp``,
  except what the engines replicate: KV projections when ``tp > Hkv`` (one KV head per rank),
  and MLA's down-projections ``q_a`` and ``kv_a`` (vLLM's ``ReplicatedLinear``); the
  embedding and LM head divided by ``tp`` (vocabulary-parallel), once if tied;
* **KV**: ``L`` layers of the rank's shard, ``ceil(seq / (dcp·cp))`` tokens of the rank's
  KV heads (MLA: the one latent, whole on every TP rank unless ``dcp`` shards it);
* **allowance** for activations, workspace, CUDA graphs and communicator buffers: the
  ``1 − 0.9`` of HBM that vLLM leaves outside its pool by default
  (``--gpu-memory-utilization`` defaults to 0.9; vLLM engine arguments,
  https://docs.vllm.ai/en/latest/configuration/engine_args.html). Weights and KV must fit
  in the other 90%.

**Weights read per decode step** (:func:`step_weight_reads`): each GEMM reads its whole
weight shard once per step, whatever the batch (decode GEMMs are matrix-vector shaped). A
MoE layer reads only the experts its ``B`` tokens route to: with ``k`` of ``n`` experts per
token and routing spread evenly (what the models' load balancing aims for), the expected
number of distinct experts is ``n · (1 − (1 − k/n)^B)``, each read once: the engines' fused
MoE sorts the step's tokens by expert and pads each expert's rows to one M tile, so an
expert's slice is streamed once however many of the ``B`` tokens chose it, and an expert
no token chose gets no tile (vLLM's and SGLang's Triton ``fused_moe``:
``moe_align_block_size`` builds the per-expert blocks the GEMM grid walks). The router
(``gate``) is not quantised: vLLM builds it without the checkpoint's quantisation
(``GateLinear`` in ``vllm/model_executor/models/deepseek_v2.py``, ``ReplicatedLinear(...,
quant_config=None)`` in the other MoE models), so it is held and read in 16 bits whatever
the weights' dtype. So are the embedding and the LM head: vLLM's
``VocabParallelEmbedding`` and ``ParallelLMHead`` take a quantisation method only where the
checkpoint's config returns one for them, and its FP8 config returns methods for linear,
fused-MoE and attention layers only (``vllm/model_executor/layers/quantization/fp8.py``,
``get_quant_method``), so they fall back to the unquantised embedding method. The shared
experts are a plain gated MLP next to the fused MoE (``DeepseekV2MLP``), sharded like the
routed experts; where the engine runs them as more experts of the fused MoE
(``fused_shared``: SGLang's shared experts fusion,
:meth:`treeattn.sim.deploy.engines.Engine.fuses_shared_experts`) their slices are read by
the fused MoE with the routed ones, always touched. The embedding is a row gather (``B``
rows, counted) and the LM head reads its whole shard.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from treeattn.schedule.payloads import SimError
from treeattn.schedule.workload import STORAGE_DTYPE_BYTES, ModelConfig

#: vLLM's default ``--gpu-memory-utilization``: the pool for weights and KV (source above).
MEMORY_UTILIZATION = 0.9
#: Weight and KV dtypes the CLI accepts, by their short names.
SHORT_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp8": "float8", "fp32": "float32"}
#: Weights may also be NVFP4: 4-bit E2M1 values with one FP8 (E4M3) scale per 16 of them,
#: 4.5 bits a weight (NVIDIA, "Introducing NVFP4 for Efficient and Accurate Low-Precision
#: Inference", developer.nvidia.com blog, 2025: "a shared FP8 scale ... applied to each
#: 16-value micro-block"; the one FP32 scale per tensor is negligible).
SHORT_WEIGHT_DTYPES = {**SHORT_DTYPES, "fp4": "float4"}
WEIGHT_DTYPE_BYTES = {**STORAGE_DTYPE_BYTES, "float4": 4.5 / 8}


def dtype_name(short: str | None, default: str, *, weights: bool = False) -> str:
    """``"fp8"`` -> ``"float8"``; ``None`` keeps ``default``; ``weights``: also ``"fp4"``."""
    if short is None:
        return default
    known = SHORT_WEIGHT_DTYPES if weights else SHORT_DTYPES
    name = known.get(short, short)
    if name not in (WEIGHT_DTYPE_BYTES if weights else STORAGE_DTYPE_BYTES):
        raise SimError(f"unknown dtype {short!r} (known: {', '.join(known)})")
    return name


@dataclass(frozen=True)
class Split:
    """``tp`` × ``cp`` GPUs, ``dcp`` of each TP group also sharding the sequence."""

    tp: int = 1
    cp: int = 1
    dcp: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "cp", "dcp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise SimError(f"{name} must be a positive integer, got {value!r}")
        if self.tp % self.dcp:
            raise SimError(f"dcp {self.dcp} must divide tp {self.tp} (decode context "
                           "parallelism reuses the GPUs of the TP group)")

    @property
    def gpus(self) -> int:
        return self.tp * self.cp

    @property
    def attention_tp(self) -> int:
        """Ranks the attention heads are split over."""
        return self.tp // self.dcp

    @property
    def seq_ranks(self) -> int:
        """Ranks the sequence is sharded over."""
        return self.dcp * self.cp

    @property
    def label(self) -> str:
        return f"TP{self.tp}" + (f"×DCP{self.dcp}" if self.dcp > 1 else "") + (
            f"×CP{self.cp}" if self.cp > 1 else "")


def check_split(model: ModelConfig, split: Split) -> None:
    """Refuse a split the engines cannot run on ``model``'s heads."""
    if model.n_heads % split.tp:
        raise SimError(f"tp {split.tp} does not divide {model.name}'s {model.n_heads} query "
                       "heads")
    hkv = model.n_kv_heads
    if hkv >= split.tp and hkv % split.tp:
        raise SimError(f"tp {split.tp} does not divide {model.name}'s {hkv} KV heads")
    if hkv < split.tp and split.tp % hkv:
        raise SimError(f"tp {split.tp} is not a multiple of {model.name}'s {hkv} KV heads "
                       "(KV heads are replicated evenly)")
    copies = max(1, split.tp // hkv)  # TP ranks holding the same KV head
    if copies % split.dcp:
        raise SimError(f"dcp {split.dcp} must divide the {copies} TP ranks that hold the same "
                       f"KV head of {model.name} (DCP shards only duplicated KV)")


# -- weights -----------------------------------------------------------------------------
def _attention_weights(m: ModelConfig, tp: int) -> tuple[float, float]:
    """``(sharded, replicated)`` parameters of one attention block on one TP rank."""
    if m.is_mla:
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        q = (m.dim * m.q_lora_rank, m.q_lora_rank * m.n_heads * qk) if m.q_lora_rank else (
            0, m.dim * m.n_heads * qk)
        kv_a = m.dim * (m.kv_lora_rank + m.qk_rope_head_dim)
        kv_b = m.kv_lora_rank * m.n_heads * (m.qk_nope_head_dim + m.v_head_dim)
        o = m.n_heads * m.v_head_dim * m.dim
        return (q[1] + kv_b + o) / tp, q[0] + kv_a
    q_o = 2 * m.dim * m.n_heads * m.head_dim / tp
    kv = 2 * m.dim * m.head_dim * max(1, m.n_kv_heads // tp)
    return q_o + kv, 0.0


def _mlp_params(m: ModelConfig, width: int) -> float:
    return 3.0 * m.dim * width  # gated MLP: gate, up, down


def distinct_experts(n: int, k: int, tokens: int) -> float:
    """Expected distinct experts of ``n`` that ``tokens`` tokens touch, each choosing ``k``
    of them evenly: each expert is missed by a token with probability ``1 − k/n``.

    >>> distinct_experts(256, 8, 1), round(distinct_experts(256, 8, 4), 2)
    (8.0, 30.53)
    """
    return n * (1.0 - (1.0 - k / n) ** tokens)


def expected_experts(m: ModelConfig, tokens: int) -> float:
    """Distinct routed experts ``tokens`` tokens touch, routing spread evenly."""
    return distinct_experts(m.n_routed_experts, m.experts_per_token, tokens)


#: What :attr:`LayerWeights.gemms` tags each GEMM as, for the rate it is read at: a dense
#: linear at the weights' dtype rate, an unquantised one (the router, the embedding and the
#: LM head) at the 16-bit rate, the fused MoE's routed experts.
DENSE, UNQUANTIZED, EXPERTS = "dense", "unquantized", "experts"


@dataclass(frozen=True)
class LayerWeights:
    """Bytes one GPU holds and reads per step for one kind of layer, by GEMM."""

    held: float
    gemms: tuple[tuple[str, float, float, str], ...]  # (name, bytes read, FLOPs, kind)

    @property
    def read(self) -> float:
        return sum(g[1] for g in self.gemms)


def layer_weights(m: ModelConfig, tp: int, wb: float, batch: int, moe: bool,
                  fused_shared: bool = False) -> LayerWeights:
    """One layer on one TP rank: attention projections plus a dense or MoE MLP; with
    ``fused_shared`` the shared experts are read by the fused MoE as experts every token
    routes to (module docstring)."""
    sharded, replicated = _attention_weights(m, tp)
    attn = (sharded + replicated) * wb
    gemms = [("attention projections", attn, 2.0 * batch * (sharded + replicated), DENSE)]
    if moe:
        expert = _mlp_params(m, m.moe_ffn_dim) / tp
        shared = m.n_shared_experts * expert
        touched = expected_experts(m, batch)
        router = m.dim * m.n_routed_experts  # replicated gate, never below 16 bits
        router_bytes = router * max(wb, 2.0)
        held = attn + (m.n_routed_experts * expert + shared) * wb + router_bytes
        gemms.append(("router", router_bytes, 2.0 * batch * router, UNQUANTIZED))
        if fused_shared:
            gemms.append(("routed and shared experts", (touched * expert + shared) * wb,
                          2.0 * batch * (m.experts_per_token * expert + shared), EXPERTS))
        else:
            gemms += [("routed experts", touched * expert * wb,
                       2.0 * batch * m.experts_per_token * expert, EXPERTS),
                      ("shared experts", shared * wb, 2.0 * batch * shared, DENSE)]
    else:
        mlp = _mlp_params(m, m.ffn_dim) / tp
        held = attn + mlp * wb
        gemms.append(("MLP", mlp * wb, 2.0 * batch * mlp, DENSE))
    return LayerWeights(held, tuple(gemms))


def _layer_counts(m: ModelConfig) -> tuple[int, int]:
    """``(dense layers, MoE layers)``."""
    if not m.is_moe:
        return m.n_layers, 0
    return m.first_dense_layers, m.n_layers - m.first_dense_layers


def embedding_bytes(m: ModelConfig, tp: int, wb: float) -> tuple[float, float]:
    """``(embedding held, LM head held)`` per GPU; a tied head is the embedding itself. Never
    below 16 bits (module docstring)."""
    table = m.vocab_size * m.dim * max(wb, 2.0) / tp
    return table, 0.0 if m.tie_embeddings else table


def weights_held(m: ModelConfig, tp: int, wb: float) -> float:
    dense, moe = _layer_counts(m)
    total = sum(embedding_bytes(m, tp, wb))
    if dense:
        total += dense * layer_weights(m, tp, wb, 1, moe=False).held
    if moe:
        total += moe * layer_weights(m, tp, wb, 1, moe=True).held
    return total


def step_weight_reads(m: ModelConfig, tp: int, wb: float, batch: int,
                      fused_shared: bool = False) -> list[tuple]:
    """``(name, count, bytes, FLOPs, kind)`` per GEMM kind of one decode step on one GPU
    (``kind``: :data:`DENSE`, :data:`UNQUANTIZED` or :data:`EXPERTS`); ``fused_shared``: the MoE
    layers' shared experts read inside the fused MoE (:func:`layer_weights`)."""
    dense, moe = _layer_counts(m)
    out = []
    for count, is_moe in ((dense, False), (moe, True)):
        if count:
            layer = layer_weights(m, tp, wb, batch, is_moe, fused_shared and is_moe)
            for name, nbytes, flops, kind in layer.gemms:
                out.append((name + (" (MoE layers)" if is_moe and m.first_dense_layers else
                                    ""), count, nbytes, flops, kind))
    head = m.vocab_size * m.dim / tp
    table_wb = max(wb, 2.0)  # unquantised, as the router
    out.append(("LM head", 1, head * table_wb, 2.0 * batch * head, UNQUANTIZED))
    out.append(("embedding rows", 1, batch * m.dim * table_wb, 0.0, UNQUANTIZED))
    return out


# -- the whole check ---------------------------------------------------------------------
@dataclass(frozen=True)
class MemoryCheck:
    """What one GPU of a deployment needs against what it has."""

    weights_bytes: float
    kv_bytes: float
    allowance_bytes: float
    capacity_bytes: float  # 0: unknown (no check)

    @property
    def need_bytes(self) -> float:
        return self.weights_bytes + self.kv_bytes + self.allowance_bytes

    @property
    def fits(self) -> bool:
        return not self.capacity_bytes or self.need_bytes <= self.capacity_bytes

    def to_json(self) -> dict:
        return {"fits": self.fits, "memory_need_bytes": int(self.need_bytes),
                "memory_capacity_bytes": int(self.capacity_bytes),
                "weights_bytes": int(self.weights_bytes), "kv_cache_bytes": int(self.kv_bytes),
                "allowance_bytes": int(self.allowance_bytes)}

    def describe(self) -> str:
        def gib(n: float) -> str:
            return f"{n / 1024 ** 3:,.1f} GiB"

        return (f"each GPU needs {gib(self.need_bytes)} ({gib(self.weights_bytes)} weights + "
                f"{gib(self.kv_bytes)} KV cache + {gib(self.allowance_bytes)} activation and "
                f"workspace allowance) and has {gib(self.capacity_bytes)}")


def kv_cache_bytes(m: ModelConfig, split: Split, seq_len: int, batch: int, kv_bytes: int) -> float:
    """All layers' KV of one GPU's shard (see the module docstring)."""
    tokens = math.ceil(seq_len / split.seq_ranks)
    heads = max(1, m.n_kv_heads // split.tp)
    per_token = (1 if m.is_mla else 2) * heads * m.head_dim * kv_bytes
    return float(m.n_layers) * batch * tokens * per_token


def memory_check(m: ModelConfig, split: Split, seq_len: int, batch: int, capacity: float,
                 weights_dtype: str | None = None, kv_dtype: str | None = None, *,
                 gpu_model: str) -> MemoryCheck:
    """The whole-model check of one ``gpu_model`` GPU (``capacity`` 0: unknown, always
    fits); SimError for weights in a dtype that GPU cannot run (FP4 without FP4 tensor
    cores: :func:`treeattn.sim.devices.check_weight_dtype`), so no path sizes them."""
    from treeattn.sim.devices import check_weight_dtype

    check_weight_dtype(gpu_model, weights_dtype or m.dtype)
    wb = WEIGHT_DTYPE_BYTES[weights_dtype or m.dtype]
    kb = STORAGE_DTYPE_BYTES[kv_dtype or m.dtype]
    return MemoryCheck(weights_held(m, split.tp, wb), kv_cache_bytes(m, split, seq_len, batch, kb),
                       (1.0 - MEMORY_UTILIZATION) * capacity, capacity)
