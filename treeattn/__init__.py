"""treeattn: topology-aware Tree Attention decoding.

Model the cluster (``treeattn.topo``), predict each reduction plan (``treeattn.sim``), run the
chosen plan for real (``treeattn.runtime``) with local attention kernels (``treeattn.kernels``),
decode with a real model on a sharded KV cache (``treeattn.llm``), and check the measurement
against the prediction.

The public library API (``docs/api.md``) is imported lazily from here, so that
``import treeattn; treeattn.plan(...)`` needs neither torch nor the runtime:

- :func:`plan` (``treeattn.sim.public``): the planner's pick, no torch;
- :class:`ShardedAttention` (``treeattn.runtime.sharded_attention``): decode attention over
  the KV shards of a ``torch.distributed`` group, by the plan's schedule;
- :func:`merge_partials` (``treeattn.kernels.lse``): merge partials, natural-log LSE;
- ``treeattn.hf``: the Hugging Face transformers integration (the ``[hf]`` extra);
- :class:`TreeattnError` (``treeattn.errors``): the base of every error treeattn raises on
  purpose (bad input, a refused plan, a rank that failed), so one ``except`` catches them.
"""

__version__ = "0.1.0"

# name -> the module that defines it; looked up on first use (PEP 562), never at import
_EXPORTS = {
    "TreeattnError": "treeattn.errors",
    "SimError": "treeattn.schedule.payloads",
    "plan": "treeattn.sim.public",
    "attention_model": "treeattn.sim.public",
    "Plan": "treeattn.sim.planning.planner",
    "ShardedAttention": "treeattn.runtime.sharded_attention",
    "ShardedAttentionError": "treeattn.runtime.sharded_attention",
    "merge_partials": "treeattn.kernels.lse",
    "LSE_BASES": "treeattn.kernels.lse",
}
__all__ = ["__version__", *_EXPORTS, "hf"]


def __getattr__(name: str):
    import importlib

    if name == "hf":
        return importlib.import_module("treeattn.hf")
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'treeattn' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
