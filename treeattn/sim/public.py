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

import os
from numbers import Integral

from treeattn.schedule.algorithms import ALGORITHM_NAMES
from treeattn.schedule.payloads import SimError
from treeattn.schedule.workload import DTYPE_BYTES, DecodeWorkload, ModelConfig
from treeattn.sim.files.plan_file import MAX_BATCH, MAX_SEQ_LEN
from treeattn.sim.files.profiles import plan_overrides
from treeattn.sim.planning.plan_size import MAX_PLAN_GPUS, check_planning_size
from treeattn.sim.planning.planner import Plan, plan_workload

__all__ = ["ALGORITHM_NAMES", "attention_model", "plan"]

# Bounds on an attention shape, far above any model's (128 query heads, a 576-wide MLA head,
# 126 layers) and low enough that every size computed from them stays exact and finite.
MAX_HEADS = 1 << 14
MAX_HEAD_DIM = 1 << 14
MAX_LAYERS = 1 << 14


def count(name: str, value, high: int, low: int = 1) -> int:
    """``value`` as an int in ``[low, high]``, else :class:`SimError` naming ``name``.

    Only integers pass (``numpy`` ones too): not a bool, a float such as 4096.0 or NaN, nor a
    string such as ``"32k"`` (the CLI's spelling).

    >>> count("seq_len", 4096, MAX_SEQ_LEN)
    4096
    """
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise SimError(f"{name} must be an integer, got {type(value).__name__} {value!r:.40}")
    if not low <= value <= high:
        shown = f"{value}" if abs(value) < 10**30 else f"an integer of {len(str(value))} digits"
        raise SimError(f"{name} must be between {low} and {high:,}, got {shown}")
    return int(value)


def attention_model(q_heads: int, kv_heads: int, head_dim: int, dtype: str = "bfloat16",
                    n_layers: int = 1) -> ModelConfig:
    """A :class:`ModelConfig` that has only an attention shape (for models the planner's
    catalogue does not name); ``n_layers`` scales the per-token latency.

    >>> attention_model(8, 2, 64, "float32").name
    'attn-8x2x64-float32'
    """
    q_heads, kv_heads = count("q_heads", q_heads, MAX_HEADS), count("kv_heads", kv_heads, MAX_HEADS)
    head_dim, n_layers = count("head_dim", head_dim, MAX_HEAD_DIM), count("n_layers", n_layers,
                                                                          MAX_LAYERS)
    if q_heads % kv_heads:
        raise SimError(f"q_heads {q_heads} must be a multiple of kv_heads {kv_heads}")
    if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:
        raise SimError(f"unknown dtype {dtype!r} (known: {', '.join(DTYPE_BYTES)})")
    dim = q_heads * head_dim
    return ModelConfig(name=f"attn-{q_heads}x{kv_heads}x{head_dim}-{dtype}", n_layers=n_layers,
                       n_heads=q_heads, n_kv_heads=kv_heads, head_dim=head_dim, dim=dim,
                       ffn_dim=4 * dim, vocab_size=1, dtype=dtype)


def _topology(topology):
    """The topology, refused past :data:`MAX_PLAN_GPUS` before it is built (as the CLI)."""
    from treeattn.topo import Topology
    from treeattn.topo.fabric import build_limits

    if not isinstance(topology, Topology):
        if not isinstance(topology, str | os.PathLike) or not str(topology).strip():
            raise SimError(f"topology must be a spec string, a file path or a Topology, "
                           f"got {type(topology).__name__} {topology!r:.40}")
        with build_limits(MAX_PLAN_GPUS, "the planner"):
            topology = Topology.load(str(topology))
    check_planning_size(topology.num_gpus, "the topology")
    return topology


def _algorithms(algorithms) -> tuple[str, ...] | None:
    if algorithms is None:
        return None
    if isinstance(algorithms, str) or not isinstance(algorithms, tuple | list | set | frozenset):
        raise SimError(f"algorithms must be a tuple of algorithm names, got "
                       f"{type(algorithms).__name__} {algorithms!r:.40}")
    unknown = [a for a in algorithms if not isinstance(a, str) or a not in ALGORITHM_NAMES]
    if unknown or not algorithms:
        raise SimError(f"unknown algorithm(s) {', '.join(map(repr, unknown)) or '(none given)'} "
                       f"(known: {', '.join(ALGORITHM_NAMES)})")
    return tuple(algorithms)


def plan(topology, model: str | ModelConfig | None = None, *, seq_len: int,
         q_heads: int | None = None, kv_heads: int | None = None, head_dim: int | None = None,
         dtype: str = "bfloat16", n_layers: int = 1, batch: int = 1, tp: int = 1,
         layout: str = "replicated", profile=None,
         algorithms: tuple[str, ...] | None = None) -> Plan:
    """The planner's pick for decoding ``batch`` sequences of ``seq_len`` cached tokens.

    ``topology``: a spec (``"dgx-h100:nodes=2"``, ``"local:ranks=4"``), a topology file or a
    :class:`~treeattn.topo.Topology`. ``model``: a catalogue name or a
    :class:`ModelConfig`; or leave it out and give the attention shape (``q_heads``,
    ``kv_heads``, ``head_dim``, ``dtype`` of the KV cache). ``tp``, ``layout``, ``profile``
    (a calibration profile path or dict) and ``algorithms`` are the CLI's ``--tp``,
    ``--layout``, ``--profile`` and a restriction of the search to these algorithms.

    Every argument is checked before any work, and a bad one raises :class:`SimError` (a
    :class:`treeattn.TreeattnError`) naming it: counts are integers within bounds (``seq_len``
    up to 2**40, not ``"32k"``), and a topology past the planner's bound (``MAX_PLAN_GPUS``) is
    refused before it is built.
    A profile of CPU ranks (``treeattn calibrate``'s) is read by the CPU test bed: call
    ``treeattn.testbed.plug_in_profiles()`` first, as the CLI does.
    """
    shape = (q_heads, kv_heads, head_dim)
    if model is None:
        if None in shape:
            raise SimError("give a model name, or all of q_heads, kv_heads and head_dim")
        model = attention_model(q_heads, kv_heads, head_dim, dtype, n_layers)
    elif any(x is not None for x in shape):
        raise SimError("give a model name or an attention shape, not both")
    elif not isinstance(model, str | ModelConfig):
        raise SimError(f"model must be a catalogue name or a ModelConfig, got "
                       f"{type(model).__name__}")
    seq_len, batch = count("seq_len", seq_len, MAX_SEQ_LEN), count("batch", batch, MAX_BATCH)
    tp = count("tp", tp, MAX_PLAN_GPUS)
    if not isinstance(layout, str):
        raise SimError(f"layout must be 'replicated' or 'head_sharded', got {layout!r:.40}")
    if profile is not None and (not isinstance(profile, str | os.PathLike | dict)
                                or not str(profile).strip() or profile == {}):
        raise SimError(f"profile must be a profile file's path or a profile dict, got "
                       f"{type(profile).__name__} {profile!r:.40}")
    algorithms = _algorithms(algorithms)
    topo = _topology(topology)
    if topo.num_gpus < 2:
        raise SimError("the topology has one GPU: there is no reduction to plan")
    workload = DecodeWorkload(model, seq_len, batch=batch, layout=layout, tp=tp)
    return plan_workload(topo, workload, algorithms=algorithms,
                         **plan_overrides(os.fspath(profile) if isinstance(profile, os.PathLike)
                                          else profile, topo))
