"""``treeattn plan --emit vllm|sglang``: the serving engine's flags for the best plan it can
express, checked against the engine's documented constraints.

Both engines run decode context parallelism (DCP) inside their tensor-parallel group: with
``--tensor-parallel-size W`` and a DCP size ``D`` the KV cache is split along the sequence
over ``D`` ranks and the heads over ``W / D``. That is treeattn's ``--tp W/D`` on ``W`` GPUs,
so the pick's workload maps to one DCP size, and each of the engine's communication backends
to one of treeattn's schedules (table below). The engine's output is head-sharded (its
tensor-parallel output projection follows), so both the engine's plans and treeattn's pick
are priced with ``layout="head_sharded"``. vLLM's all-gather of the queries ahead of the
``ag_rs`` backend is not priced (treeattn's ranks hold the whole query).

Sources (the flags, their choices and the constraints checked):

======== ================================================ ==================================
engine   flags / version                                  where documented
======== ================================================ ==================================
vLLM     ``--decode-context-parallel-size`` (DCP, since   docs.vllm.ai/en/latest/serving/
         v0.11), ``--cp-kv-cache-interleave-size``,       context_parallel_deployment.html;
         ``--dcp-comm-backend ag_rs|a2a`` (a2a: vLLM PR   github.com/vllm-project/vllm/pull/
         #34883, main in 2026)                            34883; constraints as restated in
                                                          docs.vllm.ai/projects/ascend (CP
                                                          user guide) and awsdocs-neuron
                                                          vllm-neuron design/parallelism/dcp
SGLang   ``--dcp-size``, ``--dcp-comm-backend``,          docs.sglang.io/docs/advanced_
         ``--dcp-replicate-q-proj`` (SGLang main, DCP     features/dcp.md; github.com/
         docs page and issue #19436 / PR #21637, 2026)    sgl-project/sglang/issues/19436
======== ================================================ ==================================

Transports: each backend runs on the transports the engine gives it
(:mod:`treeattn.sim.onesided`), and each is priced on each of them that the cluster offers;
the switch of the fastest is emitted with the flags:

========  ============  ===========  ====================================================
engine    backend       transport    switch (source)
========  ============  ===========  ====================================================
both      ag_rs         nccl-symm    vLLM ``VLLM_USE_NCCL_SYMM_MEM=1 NCCL_NVLS_ENABLE=1
                                     NCCL_CUMEM_ENABLE=1`` (vLLM ``benchmarks/kernels/
                                     benchmark_device_communicators.py``, PR #24532);
                                     SGLang ``--enable-symm-mem`` (``server_args.py``)
vLLM      a2a           symm_mem     ``VLLM_USE_DIRECT_DCP_A2A=1``: partials stored into
                                     the peers' buffers (PRs #48897, #50484)
SGLang    fi_a2a        mnnvl_ll128  FlashInfer's MNNVL LL128 all-to-all; needs an MNNVL
                                     fabric (GB200 NVL72), so it is priced only there
========  ============  ===========  ====================================================

The TP all-reduce (two per layer) runs on the engine's own all-reduce paths, not on its DCP
backends' (``Engine.tp_all_reduce``), each where the cluster offers it:

========  ===========  ===========================================================
engine    transport    switch (source)
========  ===========  ===========================================================
vLLM      symm_mem     torch ``symm_mem`` multimem/two-shot, on by default on Hopper
                       and Blackwell (``VLLM_ALLREDUCE_USE_SYMM_MEM``, PR #24111)
vLLM      nccl-symm    ``VLLM_USE_NCCL_SYMM_MEM=1`` (PR #24532)
SGLang    nccl-symm    ``--enable-symm-mem`` (``server_args.py``)
SGLang    symm_mem     ``--enable-torch-symm-mem`` (torch symm_mem multimem/two-shot,
                       SM90+; PR #10571)
both      nccl         NCCL's regular path
========  ===========  ===========================================================

Both engines also run their own IPC custom all-reduce (vLLM ``csrc/custom_all_reduce.cuh``,
SGLang's ``sgl-kernel`` port, on by default), which no transport here prices; a deployment
priced as an engine runs it (:meth:`Engine.runs`) takes the fastest of the paths above.
Each engine's DCP exchange runs only on its backends' transports: SGLang has no
direct-store all-to-all, so a plan of SGLang's is never priced on vLLM's
``VLLM_USE_DIRECT_DCP_A2A``.

The a2a backends are priced on NCCL's regular path: NCCL has no symmetric all-to-all kernel
(SGLang's a2a on registered windows, PR #32560, runs ``ncclAllToAll``, whose grouped
sends NCCL's model prices as on any buffer). Each engine routes a collective to NCCL's
symmetric kernels within its own size thresholds
(vLLM: ``should_nccl_symm_mem_allreduce`` and ``should_nccl_symm_mem_ag_rs``), which are not
modelled: the backend is priced as if every collective it can run there did.

A DeepSeek-V3-style MoE layer (MLA, 256 routed experts, one shared expert) runs its shared
expert differently in the two engines, and the token model prices each engine's way
(:meth:`Engine.fuses_shared_experts`, read by :func:`treeattn.sim.deploy.token.predict_token`):

========  ===================================================================================
engine    the shared expert at decode (source)
========  ===================================================================================
vLLM      a separate gated MLP beside the fused MoE: its gate-up GEMM, SiLU·mul, down GEMM and
          the add of its output (``DeepseekV2MoE`` in ``vllm/model_executor/models/
          deepseek_v2.py``); vLLM fuses it into the MoE only on ROCm with AITER opted in
          (``VLLM_ROCM_USE_AITER_FUSION_SHARED_EXPERTS`` under ``VLLM_ROCM_USE_AITER``, off by
          default), which this model does not price
SGLang    one more expert of the fused MoE ("shared experts fusion", PR #5571, on by default:
          ``--disable-shared-experts-fusion`` defaults to false in ``server_args.py``):
          ``DeepseekV2MoE`` builds its fused MoE with ``n_routed_experts +
          num_fused_shared_experts`` experts and ``top_k + num_fused_shared_experts``, builds no
          ``shared_experts`` MLP, and ``forward_normal`` then has no shared output to add
          (``python/sglang/srt/models/deepseek_v2.py``, sgl-project/sglang@3e4a39ee).
          ``determine_num_fused_shared_experts`` keeps it on only for
          ``DeepseekV3ForCausalLM`` with ``n_routed_experts == 256`` and ``n_shared_experts ==
          1`` on CUDA compute capability 8.0 or newer (later SGLang also AMD gfx942 and
          newer), without expert parallelism or DeepEP and not for W4AFP8 checkpoints. On
          SM100 (Blackwell) SGLang's defaults for ``DeepseekV3ForCausalLM`` pick the
          ``flashinfer_trtllm`` MoE runner (FP8 is assumed when the checkpoint names no
          quantisation), and that runner sets ``disable_shared_experts_fusion``
          (``server_args.py``, ``_handle_model_specific_adjustments`` and
          ``_handle_moe_kernel_config``): there the shared expert stays a separate MLP
========  ===================================================================================

The token model's deployments are TP only (no expert parallelism), so SGLang fuses where
:data:`SHARED_EXPERT_FUSION` lists the GPU's generation.

Constraints: ``tp % dcp == 0`` (both); for GQA models vLLM shards only the KV heads that
tensor parallelism replicates, so ``tp // num_kv_heads >= dcp``; SGLang documents DCP for MLA
attention layers only (its page: "stripes a request's MLA KV cache"), so a model with
grouped-query attention is refused for SGLang by name. The interleave size emitted is 1
(token round-robin, vLLM's default), which every block size divides.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from treeattn.schedule.payloads import SimError
from treeattn.schedule.workload import ModelConfig
from treeattn.sim.decode_kernels import generation
from treeattn.sim.network import TRANSPORTS
from treeattn.sim.planning.planner import plan_workload


@dataclass(frozen=True)
class Backend:
    """One of an engine's DCP communication backends: its flag value, the treeattn schedule
    it is, and the transports it runs on, each with the switch that turns it on."""

    choice: str  # the --dcp-comm-backend value
    algorithm: str
    transports: dict[str, tuple[tuple[str, ...], tuple[str, ...]]]  # name -> (env, flags)


#: GPU generations (:func:`treeattn.sim.decode_kernels.generation`) on which SGLang runs a
#: DeepSeek-V3 MoE layer's shared expert inside the fused MoE by default (module docstring):
#: CUDA compute capability 8.0 and newer except SM100, whose default MoE runner turns it
#: off; AMD CDNA 3 (gfx942, the capability 9.4 SGLang's later check admits).
SHARED_EXPERT_FUSION = ("ampere", "ampere-sm86", "hopper", "cdna3")


@dataclass(frozen=True)
class Engine:
    name: str
    version: str
    docs: str
    dcp_flag: str
    backends: tuple[Backend, ...]
    mla_only: bool
    extra: tuple[str, ...] = ()
    tp_all_reduce: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = field(
        default_factory=lambda: {"nccl": _PLAIN})  # transport -> (env, flags)
    shared_expert_fusion: tuple[str, ...] = ()  # generations whose default fuses it

    @property
    def key(self) -> str:
        """The engine's name in :data:`ENGINES`."""
        return self.name.lower()

    def algorithms(self) -> set[str]:
        return {b.algorithm for b in self.backends}

    def fuses_shared_experts(self, model: ModelConfig, gpu_model: str) -> bool:
        """Whether this engine, on its defaults, runs ``model``'s shared expert as one more
        expert of the fused MoE on a ``gpu_model`` GPU (module docstring): a DeepSeek-V3
        layout (MLA, 256 routed experts, one shared) on a listed generation.

        >>> v3 = ModelConfig.from_name("deepseek-v3")
        >>> [ENGINES[e].fuses_shared_experts(v3, g) for e in ("sglang", "vllm")
        ...  for g in ("H200", "B200")]
        [True, False, False, False]
        """
        deepseek_v3 = (model.is_mla and model.n_routed_experts == 256
                       and model.n_shared_experts == 1)
        return deepseek_v3 and generation(gpu_model) in self.shared_expert_fusion

    def runs(self) -> dict[str, tuple[str, ...] | str]:
        """What this engine runs a TP × DCP step on, as :func:`treeattn.sim.deploy.token.
        predict_token` takes it: the DCP merge's ``algorithms`` and ``transports`` (its
        backends'), the ``tp_transports`` of its TP all-reduce, and the ``engine`` whose
        model code the step's kernels and weight reads follow."""
        merge = dict.fromkeys(t for b in self.backends for t in b.transports)
        return {"algorithms": tuple(sorted(self.algorithms())), "transports": tuple(merge),
                "tp_transports": tuple(self.tp_all_reduce), "engine": self.key}


_VLLM_SYMM = (("VLLM_USE_NCCL_SYMM_MEM=1", "NCCL_NVLS_ENABLE=1", "NCCL_CUMEM_ENABLE=1"), ())
_SGLANG_SYMM = ((), ("--enable-symm-mem",))
_PLAIN = ((), ())
ENGINES = {
    "vllm": Engine(
        "vLLM", "vLLM main (DCP since v0.11; dcp-comm-backend a2a from PR #34883; direct "
        "symmetric-memory a2a from PR #50484)",
        "https://docs.vllm.ai/en/latest/serving/context_parallel_deployment.html",
        "--decode-context-parallel-size",
        (Backend("ag_rs", "dcp", {"nccl": _PLAIN, "nccl-symm": _VLLM_SYMM}),
         Backend("a2a", "helix", {"nccl": _PLAIN,
                                  "symm_mem": (("VLLM_USE_DIRECT_DCP_A2A=1",), ())})),
        mla_only=False, extra=("--cp-kv-cache-interleave-size", "1"),
        tp_all_reduce={"nccl": _PLAIN, "symm_mem": _PLAIN, "nccl-symm": _VLLM_SYMM}),
    "sglang": Engine(
        "SGLang", "SGLang main (DCP page, issue #19436, PRs #21637 and #32560)",
        "https://docs.sglang.io/docs/advanced_features/dcp.md", "--dcp-size",
        (Backend("ag_rs", "dcp", {"nccl": _PLAIN, "nccl-symm": _SGLANG_SYMM}),
         Backend("a2a", "helix", {"nccl": _PLAIN}),
         Backend("fi_a2a", "helix", {"mnnvl_ll128": _PLAIN})),
        mla_only=True, extra=("--dcp-replicate-q-proj",),
        tp_all_reduce={"nccl": _PLAIN, "nccl-symm": _SGLANG_SYMM,
                       "symm_mem": ((), ("--enable-torch-symm-mem",))},
        shared_expert_fusion=SHARED_EXPERT_FUSION),
}
EMIT_TARGETS = tuple(ENGINES)


def check_constraints(engine: Engine, world: int, dcp: int, kv_heads: int,
                      mla: bool = False) -> None:
    """Raise SimError naming the first documented constraint this configuration breaks.

    >>> check_constraints(ENGINES["vllm"], 8, 2, 4)
    >>> check_constraints(ENGINES["vllm"], 8, 4, 8)
    Traceback (most recent call last):
    ...
    treeattn.schedule.payloads.SimError: vLLM cannot express this plan: tp // num_kv_heads >= dcp \
is violated (tensor-parallel-size 8 // 8 KV heads = 1 < decode-context-parallel-size 4)
    """
    flag = engine.dcp_flag.lstrip("-")
    if engine.mla_only and not mla:
        raise SimError(f"{engine.name} cannot express this plan: its decode context "
                       f"parallelism serves MLA attention only ({engine.docs}), and this "
                       "model has grouped-query attention")
    if world % dcp:
        raise SimError(f"{engine.name} cannot express this plan: tp % dcp == 0 is violated "
                       f"(tensor-parallel-size {world} % {flag} {dcp} = {world % dcp})")
    if not mla and world // kv_heads < dcp:
        raise SimError(f"{engine.name} cannot express this plan: tp // num_kv_heads >= dcp is "
                       f"violated (tensor-parallel-size {world} // {kv_heads} KV heads = "
                       f"{world // kv_heads} < {flag} {dcp})")


def emit(target: str, topology, workload, overrides: dict | None = None,
         transports: tuple[str, ...] = TRANSPORTS) -> dict:
    """The engine's flags for ``workload`` on ``topology`` (``workload.tp`` sets the DCP
    size), the prediction of each backend, and treeattn's own pick beside the best of them,
    all on ``transports``."""
    if target not in ENGINES:
        raise SimError(f"unknown --emit target {target!r} (known: {', '.join(ENGINES)})")
    engine, overrides = ENGINES[target], overrides or {}
    world = topology.num_gpus
    if world % workload.tp:
        raise SimError(f"--tp {workload.tp} does not divide the {world} GPUs")
    dcp = world // workload.tp
    check_constraints(engine, world, dcp, workload.model.n_kv_heads, workload.model.is_mla)
    sharded = replace(workload, layout="head_sharded")
    pick = plan_workload(topology, sharded, transports=transports, **overrides)
    rows, unoffered = [], []
    for backend in engine.backends:
        allowed = tuple(t for t in backend.transports if t in transports)
        if not allowed:
            unoffered.append(f"{backend.choice}: runs on {', '.join(backend.transports)}, "
                             "none of the transports allowed")
            continue
        try:
            chosen = plan_workload(topology, sharded, algorithms=(backend.algorithm,),
                                   transports=allowed, **overrides)
        except SimError as exc:  # this backend cannot run here (transport, head split)
            unoffered.append(f"{backend.choice}: {exc}")
            continue
        env, flags = backend.transports[chosen.winner.transport]
        rows.append({"backend": backend.choice, "algorithm": backend.algorithm,
                     "latency_s": chosen.latency_s, "transport": chosen.winner.transport,
                     "method": chosen.prediction.method, "env": list(env),
                     "flags": list(flags)})
    if not rows:
        raise SimError(f"{engine.name} cannot run this plan: " + "; ".join(unoffered))
    best = min(rows, key=lambda r: r["latency_s"])
    flags = ["--tensor-parallel-size", str(world), engine.dcp_flag, str(dcp),
             "--dcp-comm-backend", best["backend"], *engine.extra, *best["flags"]]
    return {"engine": engine.name, "version": engine.version, "docs": engine.docs,
            "flags": flags, "env": best["env"], "dcp": dcp, "tensor_parallel_size": world,
            "backends": rows, "not_offered": unoffered,
            "best": best, "pick": pick.name, "pick_algorithm": pick.algorithm,
            "pick_latency_s": pick.latency_s,
            "pick_backend": next((r["backend"] for r in rows
                                  if (r["algorithm"], r["transport"])
                                  == (pick.algorithm, pick.winner.transport)), None),
            "ratio": best["latency_s"] / pick.latency_s}


def describe(record: dict) -> list[str]:
    """The lines ``treeattn plan --emit`` prints."""
    def us(s: float) -> str:
        return f"{s * 1e6:,.1f} µs" if s < 1e-2 else f"{s * 1e3:,.2f} ms"

    best = record["best"]
    lines = [f"{record['engine']} flags ({record['version']}; {record['docs']}):",
             "  " + " ".join(record["env"] + record["flags"])]
    for r in record["backends"]:
        lines.append(f"  --dcp-comm-backend {r['backend']:<6} = treeattn {r['algorithm']} on "
                     f"{r['transport']}: {us(r['latency_s'])} per layer ({r['method']})")
    for why in record["not_offered"]:
        lines.append(f"  not priced: {why}")
    if record["pick_backend"] is not None:
        lines.append(f"treeattn's pick (head-sharded output), {record['pick']}, is what "
                     f"{record['engine']} runs with --dcp-comm-backend "
                     f"{record['pick_backend']}.")
    else:
        lines.append(f"treeattn's pick (head-sharded output), {record['pick']} "
                     f"({us(record['pick_latency_s'])} per layer), cannot be expressed in "
                     f"{record['engine']}; the best it can run, "
                     f"{best['backend']} ({us(best['latency_s'])}), takes "
                     f"{record['ratio']:.2f}× the pick's time.")
    return lines
