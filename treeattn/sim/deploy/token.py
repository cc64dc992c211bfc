"""The whole decode step: time per output token (TPOT) of one deployment.

A user picks a deployment by its TPOT, not by one attention layer. One decode step of a
deployment (:class:`treeattn.sim.deploy.capacity.Split`: ``tp`` × ``cp`` GPUs, ``dcp`` of each TP
group sharding the KV cache) is priced on one GPU's critical path as the sum of:

* **weight reads**: each GEMM kind of every layer (:func:`treeattn.sim.deploy.capacity.
  step_weight_reads`) at the GPU's hardware model (:class:`treeattn.sim.devices.
  HardwareModel`: ``max(bytes / bandwidth, FLOPs / peak)``), in the weight dtype (``bf16``,
  ``fp8``, or NVFP4 ``fp4`` on GPUs with FP4 tensor cores); a MoE layer's routed experts at
  the fused-MoE kernels' own sourced rate (:mod:`treeattn.sim.moe_gemm`), its router in
  16 bits;
* **kernels**: every kernel of a layer outside attention pays the fixed cost of a small
  kernel replayed in a CUDA graph (the engines replay the whole step as one graph:
  ``HardwareModel.graph_kernel_s``, 2.4 µs, sourced per GPU generation in
  :mod:`treeattn.sim.decode_kernels`). The kernels per layer (:data:`KERNELS_PER_LAYER`)
  are counted by hand from vLLM's model code (below), plus, with FP8 weights, the
  activation quantisation before each FP8 linear; fusion by ``torch.compile`` can merge a
  few elementwise ones, so this errs high. A step priced as SGLang runs it (``engine``)
  follows SGLang's shared experts fusion where SGLang turns it on
  (:meth:`treeattn.sim.deploy.engines.Engine.fuses_shared_experts`): the shared expert's
  own kernels (:data:`SHARED_EXPERT_KERNELS`) are not launched and its weights are read by
  the fused MoE at the experts' rate;
* **TP all-reduces**: two per layer (after the attention output projection and after the
  MLP or experts) of ``B × hidden`` activations, plus the vocabulary-parallel embedding's
  all-reduce and the LM head's all-gather of the logits, each priced by the collective
  model (:func:`treeattn.sim.nccl.collectives.collective_cost`, under the backend's NCCL
  variables, or its nccl-tests calibration where it has one) on TP group 0's GPUs, on
  the fastest of the allowed transports that runs it there (inside one NVLink domain the
  engines run their TP all-reduce on symmetric memory: :mod:`treeattn.sim.onesided`), the
  same transports the attention merge is planned on;
* **attention and its merge**, per layer: with the sequence on one rank, the engine's
  decode kernel over the rank's heads and the whole cache: its split-KV grid on the GPU's
  SMs, each CTA streaming at its own rate, so one or two KV heads at batch 1 read well
  under the HBM rate (:func:`treeattn.sim.decode_kernels.engine_decode_attention_s`);
  otherwise the planner's pick
  (:func:`treeattn.sim.planning.planner.plan_workload`) for the attention view of the split:
  the heads over ``tp / dcp`` ranks, the sequence over ``dcp × cp``, the KV in its own dtype.
  With ``dcp > 1`` the TP ranks hold different heads, so the queries of the DCP group are first
  all-gathered (vLLM's and SGLang's DCP do so), priced by the same collective model.

Kernels per layer outside the attention kernel itself (which the planner prices), counted
from the modules of vLLM's ``vllm/model_executor/models/deepseek_v2.py``
(https://github.com/vllm-project/vllm, read at commit 002d6073): its decoder layer (input
norm, attention, post-attention norm, MLP or MoE), its GQA/MHA attention (``qkv_proj``,
``rotary_emb``, ``attn``, ``o_proj``, the pattern of ``llama.py`` too), its gated MLP
(``gate_up_proj``, ``SiluAndMul``, ``down_proj``), its MoE (a router GEMM and a fused-MoE
call with the shared expert), and the modules its MLA wrapper is given (``fused_qkv_a_proj``,
``q_a_layernorm``, ``q_b_proj``, ``kv_a_layernorm``, ``kv_b_proj`` absorbed as the two
``W_UK``/``W_UV`` products, ``rotary_emb``, ``o_proj``). Inside the fused MoE and the MLA
wrapper the kernels are our reading of those calls (top-k, expert sort, two expert GEMMs with
the activation between, the expert sum; the cache write). The counts are vLLM's; with
SGLang's shared experts fusion a MoE layer drops the last four (the shared expert's gate-up,
SiLU·mul and down, and the add: SGLang's ``DeepseekV2MoE`` builds no ``shared_experts`` MLP
and has no shared output to add) and, with FP8 or FP4 weights, the quantisations before the
shared expert's two linears; the fused MoE's kernels stay as they are, one more expert wide:

==================  ===========================================================  =====
block               kernels                                                      count
==================  ===========================================================  =====
GQA attention       input norm, QKV GEMM, RoPE, KV-cache write, output GEMM      5
MLA attention       input norm, fused q_a/kv_a GEMM, q_a norm, kv_a norm, q_b       11
                    GEMM, W_UK bmm, RoPE, cache write, W_UV bmm, output GEMM,
                    post-attention norm
dense gated MLP     (post-attention norm for GQA), gate-up GEMM, SiLU·mul, down  3 (+1)
MoE                 router GEMM, grouped top-k, expert sort/align, experts'      11
                    gate-up, SiLU·mul, experts' down, expert sum, shared
                    expert gate-up, SiLU·mul, down, add
once per step       embedding, final norm, LM head GEMM                          3
==================  ===========================================================  =====

What is left out, and biases the prediction low: sampling, the host's scheduling between
steps (a serving benchmark's TPOT also holds the prefills of other requests run between
decode steps), and any overlap of communication with compute (which would bias it high).

Per sequence, a step yields one token: ``tokens_per_s = 1 / tpot_s``; for the batch,
``batch / tpot_s``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from treeattn.schedule.payloads import SimError
from treeattn.schedule.workload import (
    DTYPE_BYTES,
    STORAGE_DTYPE_BYTES,
    DecodeWorkload,
    ModelConfig,
)
from treeattn.sim.decode_kernels import (
    FP8_QUANT_KERNELS,
    NO_FP8_TENSOR_CORES,
    engine_decode_attention_s,
)
from treeattn.sim.deploy.capacity import (
    DENSE,
    EXPERTS,
    UNQUANTIZED,
    WEIGHT_DTYPE_BYTES,
    MemoryCheck,
    Split,
    check_split,
    memory_check,
    step_weight_reads,
)
from treeattn.sim.deploy.kernel_table import CANONICAL
from treeattn.sim.devices import BackendModel, weight_read_factor
from treeattn.sim.moe_gemm import expert_read_factor
from treeattn.sim.nccl.collectives import GroupShape, collective_cost
from treeattn.sim.nccl.env import with_env
from treeattn.sim.network import TRANSPORTS, resolve_backend, resolve_hardware
from treeattn.sim.onesided import one_sided
from treeattn.sim.parallel import cp_group, group_workload, sub_topology
from treeattn.topo.hardware import normalize_model

#: Kernels per layer outside attention, and once per step (see the module docstring).
KERNELS_PER_LAYER = {"gqa_attention": 5, "mla_attention": 11, "dense_mlp": 3,
                     "gqa_post_norm": 1, "moe": 11}
KERNELS_PER_STEP = 3
#: Of a MoE layer's kernels, those of its shared expert beside the fused MoE, in
#: :data:`KERNELS_PER_LAYER` (gate-up GEMM, SiLU·mul, down GEMM, the add) and in
#: :data:`treeattn.sim.decode_kernels.FP8_QUANT_KERNELS` (before its two linears): what a
#: layer does not launch when the engine fuses the shared expert into the MoE.
SHARED_EXPERT_KERNELS = (4, 2)


def kernels_per_step(model: ModelConfig, weights_dtype: str = "bfloat16",
                     gpu_model: str = "", fused_shared: bool = False) -> int:
    """Kernels one decode step launches outside attention (see the module docstring); with
    FP8 or FP4 weights, plus the activation quantisation before each such linear
    (:data:`treeattn.sim.decode_kernels.FP8_QUANT_KERNELS`), except FP8 on a GPU without
    FP8 tensor cores (before compute capability 8.9), which vLLM runs as Marlin's
    weight-only GEMM with no activation to quantise (``Fp8LinearMethod``'s ``use_marlin``,
    ``vllm/model_executor/layers/quantization/fp8.py``). ``fused_shared``: the MoE layers'
    shared experts run inside the fused MoE (:data:`SHARED_EXPERT_KERNELS` not launched).

    >>> m = ModelConfig.from_name("llama-3.1-8b")
    >>> kernels_per_step(m, "float8", "H100") - kernels_per_step(m), kernels_per_step(
    ...     m, "float8", "A100") - kernels_per_step(m)
    (128, 0)
    """
    counts = [(KERNELS_PER_LAYER, SHARED_EXPERT_KERNELS[0])]
    weight_only = str(weights_dtype) == "float8" and gpu_model in NO_FP8_TENSOR_CORES
    if str(weights_dtype) in ("float8", "float4") and not weight_only:
        counts.append((FP8_QUANT_KERNELS, SHARED_EXPERT_KERNELS[1]))
    moe_layers = model.n_layers - model.first_dense_layers if model.is_moe else 0
    dense_layers = model.n_layers - moe_layers
    total = KERNELS_PER_STEP
    for k, shared in counts:
        attention = (k["mla_attention"] if model.is_mla
                     else k["gqa_attention"] + k.get("gqa_post_norm", 0))
        moe = k["moe"] - (shared if fused_shared else 0)
        total += model.n_layers * attention + dense_layers * k["dense_mlp"] + moe_layers * moe
    return total


@dataclass
class TokenPrediction:
    """One deployment's decode step: TPOT, its parts, the merge it uses and its memory."""

    model: str
    split: Split
    seq_len: int
    batch: int
    weights_dtype: str
    kv_dtype: str
    parts_s: dict[str, float]
    merge: str  # the planner's pick for the attention merge ("none": one sequence rank)
    merge_system: str
    memory: MemoryCheck
    attention_layer_s: float
    extra: dict = field(default_factory=dict)

    @property
    def tpot_s(self) -> float:
        return sum(self.parts_s.values())

    @property
    def tokens_per_s(self) -> float:
        return 1.0 / self.tpot_s

    @property
    def batch_tokens_per_s(self) -> float:
        return self.batch / self.tpot_s

    def to_json(self) -> dict:
        return {"model": self.model, "deployment": self.split.label, "gpus": self.split.gpus,
                "tp": self.split.tp, "dcp": self.split.dcp, "cp": self.split.cp,
                "seq_len": self.seq_len, "batch": self.batch,
                "weights_dtype": self.weights_dtype, "kv_dtype": self.kv_dtype,
                "merge": self.merge, "merge_system": self.merge_system,
                "tpot_s": self.tpot_s, "tokens_per_s": self.tokens_per_s,
                "batch_tokens_per_s": self.batch_tokens_per_s,
                "attention_layer_s": self.attention_layer_s,
                "parts_s": dict(self.parts_s), **self.memory.to_json(), **self.extra}


def check_token_model(model: ModelConfig) -> None:
    """Refuse a model whose registry entry lacks what the whole step needs."""
    missing = [a for a in ("dim", "ffn_dim", "vocab_size", "n_layers") if getattr(model, a) <= 0]
    if model.is_moe and (model.experts_per_token <= 0 or model.moe_ffn_dim <= 0):
        missing.append("experts_per_token/moe_ffn_dim")
    if model.is_mla and (model.v_head_dim <= 0 or model.qk_nope_head_dim <= 0):
        missing.append("v_head_dim/qk_nope_head_dim")
    if missing:
        raise SimError(f"model {model.name} lacks the shapes --token needs: {', '.join(missing)}")


def deployment_topology(topology, split: Split):
    """The first ``split.gpus`` GPUs of ``topology`` (the whole topology if it has no more)."""
    if split.gpus > topology.num_gpus:
        raise SimError(f"{split.label} needs {split.gpus} GPUs and the topology has "
                       f"{topology.num_gpus}")
    if split.gpus == topology.num_gpus:
        return topology
    return sub_topology(topology, list(range(split.gpus)))


def _collective(op: str, nbytes: int, topology, ranks: list[int],
                transports: tuple[str, ...], backend: BackendModel,
                dtype: str = "bfloat16") -> tuple[float, str]:
    """(seconds, transport) of the fastest of ``transports`` that runs ``op`` on ``ranks``
    (``dtype`` data, summed); NCCL's regular path where it is allowed or none of the
    one-sided ones runs the op (the libraries' own fallback). NCCL's path sees the group as
    ``backend``'s variables leave it (``--nccl-env``) and takes ``backend``'s nccl-tests
    calibration where it has one, as the merge's collectives do."""
    if len(ranks) < 2 or nbytes < 1:
        return 0.0, "none"
    shape = with_env(GroupShape.of(topology, ranks), backend.nccl_env)
    options = []
    for name in transports:
        transport = one_sided(name)
        if transport is not None and transport.unavailable(op, shape, "sum") is None:
            options.append((transport.cost(op, int(nbytes), shape, "sum").time_s, name))
    if "nccl" in transports or not options:
        if backend.calibration is not None:  # measured on this cluster: trust it
            nccl_s = backend.calibration.time_s(op, int(nbytes), shape)
        else:
            nccl_s = collective_cost(op, int(nbytes), shape, dtype=dtype).time_s
        options.append((nccl_s, "nccl"))
    return min(options)


def attention_view(model: ModelConfig, split: Split, seq_len: int, batch: int,
                   kv_dtype: str) -> DecodeWorkload:
    """The attention workload the planner merges: KV in its dtype, heads over ``tp/dcp``."""
    layout = "head_sharded" if split.cp == 1 and split.tp > 1 else "replicated"
    return DecodeWorkload(replace(model, dtype=kv_dtype), seq_len, batch=batch, layout=layout,
                          tp=split.attention_tp)


def predict_token(topology, model: ModelConfig | str, seq_len: int, split: Split, *,
                  batch: int = 1, weights_dtype: str | None = None,
                  kv_dtype: str | None = None, hardware=None, backend=None,
                  algorithms: tuple[str, ...] | None = None,
                  max_simulated: int | None = None,
                  transports: tuple[str, ...] = TRANSPORTS,
                  tp_transports: tuple[str, ...] | None = None,
                  engine: str = "vllm") -> TokenPrediction:
    """Price one decode step of ``model`` deployed as ``split`` on ``topology``'s first GPUs,
    its collectives and merge on the fastest of ``transports`` (``("nccl",)``: what a
    deployment on NCCL alone runs). ``tp_transports`` (default: ``transports``) are those the
    TP all-reduce and the LM head's gather may run on, where an engine runs them on other
    kernels than its attention merge (:data:`treeattn.sim.deploy.engines.ENGINES`).
    ``engine`` (a key of ``ENGINES``; vLLM's by default) is the engine whose model code the
    MoE layers' kernels and weight reads follow (SGLang's shared experts fusion).

    >>> from treeattn.topo import Topology
    >>> p = predict_token(Topology.from_spec("dgx-h100"), "llama-3.1-8b", 32768, Split(tp=8))
    >>> p.merge, round(p.tpot_s * 1e3, 1) > 0
    ('none', True)
    """
    from treeattn.schedule.algorithms import SOURCES
    from treeattn.sim.deploy.engines import ENGINES
    from treeattn.sim.planning.planner import plan_workload

    if engine not in ENGINES:
        raise SimError(f"unknown engine {engine!r} (known: {', '.join(ENGINES)})")
    model = ModelConfig.from_name(model) if isinstance(model, str) else model
    check_token_model(model)
    check_split(model, split)
    wdt, kdt = weights_dtype or model.dtype, kv_dtype or model.dtype
    for name, known in ((wdt, WEIGHT_DTYPE_BYTES), (kdt, STORAGE_DTYPE_BYTES)):
        if name not in known:
            raise SimError(f"unknown dtype {name!r}")
    topo = deployment_topology(topology, split)
    hw = resolve_hardware(topo, hardware)[0]
    gpu = normalize_model(topo.gpu_model(0))
    # FP4 weights refused on a GPU without FP4 cores, whatever kernel table it was given
    memory = memory_check(model, split, seq_len, batch, hw.memory_bytes, wdt, kdt,
                          gpu_model=gpu)
    act = STORAGE_DTYPE_BYTES[model.dtype]
    parts: dict[str, float] = {}

    fused = ENGINES[engine].fuses_shared_experts(model, gpu)
    reads = step_weight_reads(model, split.tp, WEIGHT_DTYPE_BYTES[wdt], batch, fused)
    # FP8/FP4 GEMMs read below the bf16 rate (devices.LOW_PRECISION_GEMM_EFFICIENCY), the
    # fused MoE's experts below that (moe_gemm), the unquantised ones at the bf16 rate; a
    # kind whose dtype the user's kernel table (calibrate --kernels) has reads at its
    # measured rate instead (one rate for the dense GEMMs and the experts alike)
    slower = {DENSE: weight_read_factor(gpu, wdt, hw.name), UNQUANTIZED: 1.0,
              EXPERTS: expert_read_factor(gpu, wdt, hw.name)}
    table = dict(hw.gemm_bandwidth)

    def read_s(nbytes: float, flops: float, kind: str) -> float:
        dtype = "bfloat16" if kind == UNQUANTIZED else wdt
        measured = table.get(CANONICAL.get(dtype, dtype))
        if measured:
            return max(nbytes / measured, flops / hw.peak_flops)
        return hw.compute_time(nbytes * slower[kind], flops) - hw.launch_s

    parts["weights"] = sum(count * read_s(nbytes, flops, kind)
                           for _, count, nbytes, flops, kind in reads)
    parts["kernels"] = kernels_per_step(model, wdt, gpu, fused) * hw.graph_kernel_s

    tp_ranks = list(range(split.tp))
    hidden = batch * model.dim * act
    # the activations are summed in the model's compute dtype (bf16 for an fp8 checkpoint)
    act_dtype = model.dtype if model.dtype in DTYPE_BYTES else "bfloat16"
    library = resolve_backend(topo, backend)
    tp_transports = transports if tp_transports is None else tp_transports
    all_reduce_s, tp_transport = _collective("all_reduce", hidden, topo, tp_ranks, tp_transports,
                                             library, act_dtype)
    parts["tp_all_reduce"] = (2 * model.n_layers + 1) * all_reduce_s
    parts["lm_head_gather"] = _collective("all_gather", batch * model.vocab_size * act, topo,
                                          tp_ranks, tp_transports, library)[0]

    view = attention_view(model, split, seq_len, batch, kdt)
    if split.seq_ranks == 1:
        local = group_workload(view) if split.attention_tp > 1 else view
        nbytes, flops = local.attention_bytes(seq_len), local.attention_flops(seq_len)
        if hw.attention_measured:  # the user's kernel table's attention fit
            layer_s = hw.compute_time(nbytes, flops)
        else:  # the engine's split-KV kernel on this GPU's SMs (decode_kernels)
            layer_s = engine_decode_attention_s(
                hw, normalize_model(topo.gpu_model(0)), nbytes, local.kv_bytes(seq_len),
                flops, batch=batch,
                kv_heads=local.model.n_kv_heads, q_heads=local.model.n_heads,
                context=seq_len, mla=model.is_mla)
        merge, system = "none", "no merge (the sequence on one rank)"
    else:
        chosen = plan_workload(topo, view, hardware, backend, algorithms=algorithms,
                               max_simulated=max_simulated, transports=transports)
        layer_s, merge, system = chosen.latency_s, chosen.name, SOURCES[chosen.algorithm]
    if split.dcp > 1:  # gather the DCP group's queries: B × (heads of tp/dcp ranks) × width
        heads = model.n_heads // split.attention_tp
        q_bytes = batch * heads * model.head_dim * act
        group = cp_group(split.tp, split.attention_tp)
        layer_s += _collective("all_gather", q_bytes, topo, group, transports, library)[0]
    parts["attention"] = model.n_layers * layer_s
    return TokenPrediction(model.name, split, seq_len, batch, wdt, kdt, parts, merge, system,
                           memory, layer_s, extra={"tp_all_reduce_transport": tp_transport,
                                                   "engine": engine,
                                                   "shared_experts_fused": fused})
