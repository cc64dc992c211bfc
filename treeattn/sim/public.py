"""``treeattn.plan(...)``: the planner as a library call, no torch needed.

The CLI's ``treeattn plan`` reads a topology spec, a model name and a few flags; this is the
same thing for Python callers, who often have their own model and know only its attention
shape. It returns the planner's :class:`~treeattn.sim.planning.planner.Plan`, which
:class:`treeattn.ShardedAttention` runs (its ``schedule``) and whose prediction, candidates
and explanation are the CLI's.

>>> p = plan("dgx-h100:nodes=1", q_heads=32, kv_heads=8, head_dim=128, seq_len=65536)
>>> p.topology.num_gpus, p.workload.model.n_heads
(8, 32)
>>> plan("dgx-h100:nodes=1", "llama-3.1-8b", seq_len=8192).algorithm in ALGORITHM_NAMES
True
"""

from __future__ import annotations

from treeattn.schedule.algorithms import ALGORITHM_NAMES
from treeattn.schedule.payloads import SimError
from treeattn.schedule.workload import DTYPE_BYTES, DecodeWorkload, ModelConfig
from treeattn.sim.files.profiles import plan_overrides
from treeattn.sim.planning.planner import Plan
from treeattn.sim.planning.planner import plan as plan_workload

__all__ = ["ALGORITHM_NAMES", "attention_model", "plan"]


def attention_model(q_heads: int, kv_heads: int, head_dim: int, dtype: str = "bfloat16",
                    n_layers: int = 1) -> ModelConfig:
    """A :class:`ModelConfig` that has only an attention shape (for models the planner's
    catalogue does not name). The rest of the model is sized from it, which matters only with
    ``include_model``.

    >>> attention_model(8, 2, 64, "float32").name
    'attn-8x2x64-float32'
    """
    for name, value in (("q_heads", q_heads), ("kv_heads", kv_heads), ("head_dim", head_dim),
                        ("n_layers", n_layers)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise SimError(f"{name} must be a positive integer, got {value!r}")
    if q_heads % kv_heads:
        raise SimError(f"q_heads {q_heads} must be a multiple of kv_heads {kv_heads}")
    if dtype not in DTYPE_BYTES:
        raise SimError(f"unknown dtype {dtype!r} (known: {', '.join(DTYPE_BYTES)})")
    dim = q_heads * head_dim
    return ModelConfig(name=f"attn-{q_heads}x{kv_heads}x{head_dim}-{dtype}", n_layers=n_layers,
                       n_heads=q_heads, n_kv_heads=kv_heads, head_dim=head_dim, dim=dim,
                       ffn_dim=4 * dim, vocab_size=1, dtype=dtype)


def _topology(topology):
    from treeattn.topo import Topology

    if isinstance(topology, Topology):
        return topology
    if not isinstance(topology, str):
        raise SimError(f"topology must be a spec string, a file path or a Topology, "
                       f"got {type(topology).__name__}")
    return Topology.load(topology)


def plan(topology, model: str | ModelConfig | None = None, *, seq_len: int,
         q_heads: int | None = None, kv_heads: int | None = None, head_dim: int | None = None,
         dtype: str = "bfloat16", n_layers: int = 1, batch: int = 1, tp: int = 1,
         layout: str = "replicated", profile=None, include_model: bool = False,
         algorithms: tuple[str, ...] | None = None) -> Plan:
    """The planner's pick for decoding ``batch`` sequences of ``seq_len`` cached tokens.

    ``topology``: a spec (``"dgx-h100:nodes=2"``, ``"local:ranks=4"``), a topology file or a
    :class:`~treeattn.topo.Topology`. ``model``: a catalogue name or a
    :class:`ModelConfig`; or leave it out and give the attention shape (``q_heads``,
    ``kv_heads``, ``head_dim``, ``dtype`` of the KV cache). ``tp``, ``layout``, ``profile``
    (a calibration profile path or dict) and ``algorithms`` are the CLI's ``--tp``,
    ``--layout``, ``--profile`` and a restriction of the search to these algorithms. A
    profile of CPU ranks (``treeattn calibrate``'s) is read by the CPU test bed: call
    ``treeattn.testbed.plug_in_profiles()`` first, as the CLI does.
    """
    shape = (q_heads, kv_heads, head_dim)
    if model is None:
        if None in shape:
            raise SimError("give a model name, or all of q_heads, kv_heads and head_dim")
        model = attention_model(q_heads, kv_heads, head_dim, dtype, n_layers)
    elif any(x is not None for x in shape):
        raise SimError("give a model name or an attention shape, not both")
    if algorithms is not None:
        unknown = [a for a in algorithms if a not in ALGORITHM_NAMES]
        if unknown:
            raise SimError(f"unknown algorithm(s) {', '.join(map(str, unknown))} "
                           f"(known: {', '.join(ALGORITHM_NAMES)})")
    topo = _topology(topology)
    if topo.num_gpus < 2:
        raise SimError("the topology has one GPU: there is no reduction to plan")
    workload = DecodeWorkload(model, int(seq_len), batch=int(batch), layout=layout, tp=int(tp),
                              include_model=include_model)
    return plan_workload(topo, workload, algorithms=algorithms,
                         **plan_overrides(profile, topo))
