"""``ShardedAttention``: one decode step of attention over a sequence-sharded KV cache, as a
library call inside the caller's own model.

Every rank of a ``torch.distributed`` group holds a shard of the keys and values along the
sequence (any lengths, empty included). ``attn(q, k_shard, v_shard)`` returns, on every rank,
exact attention of the query over all shards together, reduced by the plan's schedule (the
very schedule ``treeattn plan`` predicts and ``treeattn run`` measures), through
:class:`~treeattn.runtime.executor.Executor`: gloo on CPU, NCCL on CUDA.

The caller's tensors are never copied. A shard whose ``k`` and ``v`` are the two halves of
one (2, B, Hkv, T, D) tensor (as :class:`treeattn.hf.ShardedCache` stores them) goes to the
executor as that tensor, so CPU ranks on one host take the compiled path where the test bed's
transport is plugged in (:func:`treeattn.runtime.transport.compile_program`); otherwise this
rank's partial is computed from the two tensors (:func:`treeattn.kernels.partial_attention`,
which also takes ``kv_len``) and the executor reduces it as the partial of its own shard. The
two algorithms that put KV or queries on the wire (``ring``, ``ring-passq``) need the
one-tensor form: they stack the shard into a new send buffer if it is not, and take no
``kv_len``.

Agreement: every rank must run the same schedule on the same shapes. At set-up, and the
first time a new shape is seen, the ranks exchange a digest of the algorithm, the schedule,
the shapes and the dtype; if they differ, every rank raises one
:class:`ShardedAttentionError` naming the ranks on each side, instead of deadlocking in
mismatched messages. Every exchange and every wait of the reduction has the timeout
``timeout_s``: a rank that does not make the same call in time is named in the error
(:func:`treeattn.runtime.agreement.gather_named`) rather than waited for forever.

Which schedule: a :class:`~treeattn.sim.planning.planner.Plan` (``treeattn.plan``), a
plan file's ``schedule``, or an ``algorithm`` name built for each new shape. ``"auto"``
(the default) plans on the topology of the group's devices: the CPU ranks of this host for a
gloo group; for a CUDA group, the ``topology`` the caller gives (its GPUs are not a CPU
topology, and the group cannot tell which GPUs they are).

LSE: the log-sum-exp returned with ``return_lse=True`` is natural-log (see
:mod:`treeattn.kernels.lse`); :meth:`ShardedAttention.reduce` takes a caller's partial and
requires its base to be named.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from numbers import Real

import torch
import torch.distributed as dist

from treeattn.errors import TreeattnError
from treeattn.kernels import partial_attention
from treeattn.kernels.lse import natural_lse
from treeattn.runtime.agreement import gather_named
from treeattn.runtime.collectives import make_subgroups_everywhere, schedule_subgroups
from treeattn.runtime.errors import RuntimeFailure
from treeattn.runtime.executor import Executor
from treeattn.runtime.group import RankContext, all_gather_objects, held_weakly, host_name
from treeattn.runtime.plans import ALGORITHMS, build, dtype_name, local_topology, workload_for
from treeattn.runtime.wire import AttnDims, pack_partial, unpack_partial
from treeattn.schedule.algorithms import ALIASES
from treeattn.schedule.ir import Compute, Schedule, Send
from treeattn.schedule.workload import DecodeWorkload
from treeattn.sim.files.export import schedule_to_json
from treeattn.sim.planning.planner import Plan

DEFAULT_TIMEOUT_S = 60.0
MAX_TIMEOUT_S = 7 * 24 * 3600.0  # a week: beyond it a wait is a hang by another name
KV_PAYLOADS = ("kv", "qblock", "outbox")  # payloads that carry KV or queries, not partials


class ShardedAttentionError(RuntimeFailure):
    """Bad input to :class:`ShardedAttention`, or ranks that do not agree on it."""


def check_timeout(timeout_s) -> float:
    """``timeout_s`` as seconds, if a finite positive number up to :data:`MAX_TIMEOUT_S`."""
    if (isinstance(timeout_s, bool) or not isinstance(timeout_s, Real)
            or not 0 < timeout_s <= MAX_TIMEOUT_S):  # NaN fails every comparison
        raise ShardedAttentionError(f"timeout_s must be a number of seconds in (0, "
                                    f"{MAX_TIMEOUT_S:g}], got {timeout_s!r:.40}")
    return float(timeout_s)


def group_context(group=None, timeout_s: float = DEFAULT_TIMEOUT_S) -> RankContext:
    """This rank's :class:`RankContext` in ``group`` (None: the default group). A subgroup
    (``dist.new_group``, e.g. one context-parallel group beside tensor-parallel ones) gives
    ranks within it, and the global rank of each member for addressing peers."""
    timeout_s = check_timeout(timeout_s)
    if not dist.is_available() or not dist.is_initialized():
        raise ShardedAttentionError("torch.distributed is not initialised: call "
                                    "dist.init_process_group first (gloo on CPU, nccl on CUDA)")
    whole = group is None or group is dist.group.WORLD
    if not whole and dist.get_rank(group) < 0:  # before anything else asks the group
        raise ShardedAttentionError(f"rank {dist.get_rank()} is not a member of the group it "
                                    "was given")
    backend = str(dist.get_backend(group))
    cuda = "nccl" in backend
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if whole or dist.get_world_size(group) == dist.get_world_size():
        rank = dist.get_rank()
        return RankContext(rank, dist.get_world_size(), rank, device, backend,
                           float(timeout_s))
    rank = dist.get_rank(group)
    size = dist.get_world_size(group)
    members = tuple(dist.get_global_rank(group, r) for r in range(size))
    return RankContext(rank, size, rank, device, backend, float(timeout_s),
                       group_ref=held_weakly(group), ranks=members)


def agree(ctx: RankContext, what: str, value: str) -> list:
    """Raise :class:`ShardedAttentionError` on every rank unless all ranks hold the same
    ``value`` (a short digest); ``what`` names it in the message."""
    seen = gather_named(ctx, value, what)
    if len(set(seen)) == 1:
        return seen
    sides: dict[str, list[int]] = {}
    for rank, v in enumerate(seen):
        sides.setdefault(v, []).append(rank)
    parts = [f"ranks {', '.join(map(str, ranks))} have {v[:12]}" for v, ranks in sides.items()]
    raise ShardedAttentionError(f"rank {ctx.rank}: the ranks disagree on {what}: "
                                + "; ".join(parts))


def digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def partial_only(schedule: Schedule) -> bool:
    """Whether no rank's steps need the KV itself beyond its own attention."""
    for steps in schedule.steps:
        for s in steps:
            if isinstance(s, Compute) and s.label.startswith("attention") \
                    and s.label != "attention":
                return False
            if isinstance(s, Send) and s.payload in KV_PAYLOADS:
                return False
    return True


def stacked_view(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
    """``k`` and ``v`` (B, Hkv, T, D) as one (2, B, Hkv, T, D) view of their storage when
    they are its two halves (same storage, strides and dtype); else None. No copy."""
    if (k.dtype != v.dtype or k.shape != v.shape or k.stride() != v.stride()
            or k.device != v.device
            or k.untyped_storage().data_ptr() != v.untyped_storage().data_ptr()):
        return None
    gap = v.storage_offset() - k.storage_offset()
    if gap <= 0 or k.numel() == 0:
        return None
    kv = k.as_strided((2, *k.shape), (gap, *k.stride()), k.storage_offset())
    return kv if kv[1].data_ptr() == v.data_ptr() else None


class _Reducer(Executor):
    """An executor whose own shard's partial is given rather than computed.

    The schedules of partial-only algorithms start with the rank's ``attention`` of its own
    shard and never touch the KV again. Handed an empty shard, the executor's attention is the
    shared empty partial (:attr:`Executor.identity`); here that partial is, for one run, the
    caller's. Nothing else reads it in these schedules (checked by :func:`partial_only`).
    """

    def reduce(self, q: torch.Tensor, packed: torch.Tensor, empty: torch.Tensor) -> torch.Tensor:
        if self.program is not None and not self.transport.channel.deferred:
            return self.program.run(q, empty, self.scale, lambda: packed, self.ctx.rank,
                                    self.ctx.timeout_s)
        identity, self.identity = self.identity, packed
        try:
            (o, lse), _ = self.run(q, empty, memory=False)
        finally:
            self.identity = identity
        return pack_partial(o, lse)


class ShardedAttention:
    """Exact decode attention over the KV shards of every rank of ``group``.

    Give at most one of: ``plan``, a :class:`~treeattn.sim.planning.planner.Plan`
    (``treeattn.plan(...)``), whose schedule runs as planned; ``schedule``, a plan file's
    :class:`~treeattn.schedule.ir.Schedule`; or ``algorithm``, a name (``"tree"``,
    ``"butterfly"``, ``"dcp"``, ...) built for each new shape, or ``"auto"`` (the default),
    the planner's pick for each new shape on ``topology``: a spec, file or
    :class:`~treeattn.topo.Topology` of the group's GPUs, required on a CUDA group; the
    local CPU ranks of a gloo group by default. ``group``: the default group (None) or a
    subgroup (``dist.new_group``). ``scale``: the score scale (default ``1/sqrt(D)``).
    ``timeout_s``: the longest any rank waits on another, in every call. Constructing it is
    collective.

    ``"hier"`` reads each rank's host (:func:`~treeattn.runtime.group.host_name`: the
    machine, or ``$TREEATTN_HOST``) and runs node then rail all-gathers on subgroups made
    once, here. On a process subgroup, constructing it (or a plan whose collectives need
    subgroups) is collective over the whole world, since torch makes process groups so:
    every context-parallel group constructs its own at the same point.
    """

    def __init__(self, plan: Plan | None = None, group=None, *, algorithm: str | None = None,
                 schedule: Schedule | None = None, topology=None, scale: float | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        given = [name for name, v in (("plan", plan), ("schedule", schedule),
                                      ("algorithm", algorithm)) if v is not None]
        if len(given) > 1:
            raise ShardedAttentionError(f"give one of plan, schedule and algorithm, not "
                                        f"{' and '.join(given)}")
        if scale is not None and (isinstance(scale, bool) or not isinstance(scale, Real)
                                  or not 0 < scale < math.inf):
            raise ShardedAttentionError(f"scale must be a finite positive number, got "
                                        f"{scale!r:.40}")
        self.ctx = group_context(group, timeout_s)
        self.scale = scale
        self.plan, self.schedule, self.topology = None, None, None
        if plan is not None:
            if not isinstance(plan, Plan):
                hint = (f"; for an algorithm name, pass algorithm={plan!r}"
                        if isinstance(plan, str) else "")
                raise ShardedAttentionError(f"plan must be a Plan from treeattn.plan, got "
                                            f"{type(plan).__name__}{hint}")
            self.plan, self.schedule = plan, plan.schedule
            self.algorithm, world = plan.algorithm, self.schedule.world
            described = schedule_to_json(self.schedule)
        elif schedule is not None:  # a plan file's schedule, shapes unchecked
            if not isinstance(schedule, Schedule):
                raise ShardedAttentionError(f"schedule must be a Schedule, got "
                                            f"{type(schedule).__name__}")
            self.schedule = schedule
            self.algorithm, world = schedule.algorithm, schedule.world
            described = schedule_to_json(schedule)
        else:
            name = "auto" if algorithm is None else algorithm
            if not isinstance(name, str) or ALIASES.get(name, name) not in ALGORITHMS:
                raise ShardedAttentionError(f"unknown algorithm {name!r:.40} "
                                            f"(known: {', '.join(ALGORITHMS)})")
            name = ALIASES.get(name, name)
            self.topology = self._topology(topology) if name == "auto" else None
            self.algorithm, world, described = name, self.ctx.world, name
        if topology is not None and self.topology is None:
            raise ShardedAttentionError("topology is what algorithm='auto' plans on; a plan, "
                                        "a schedule or a named algorithm takes none")
        if self.schedule is not None and self.schedule.output_layout != "replicated":
            raise ShardedAttentionError(
                f"the plan leaves its output {self.schedule.output_layout}; ShardedAttention "
                "returns the whole output on every rank (plan with layout='replicated')")
        if world != self.ctx.world:
            raise ShardedAttentionError(f"the plan is for {world} ranks, the group has "
                                        f"{self.ctx.world}")
        agree(self.ctx, "the plan", digest([self.algorithm, world, described, scale]))
        self.hosts = None  # each rank's host, where the schedule depends on the hosts
        if self.schedule is None and self.algorithm == "hier":
            self.hosts = [str(h) for h in all_gather_objects(self.ctx, host_name())]
        self._make_subgroups()
        self._executors: dict[tuple, tuple[_Reducer, bool, list[int]]] = {}
        self._empty: dict[tuple, torch.Tensor] = {}
        self.calls, self.elapsed_s = 0, 0.0  # calls made and their wall time, for reports

    def _make_subgroups(self) -> None:
        """On a process subgroup, make the subgroups the schedule's collectives run on, with
        every rank of the world (``dist.new_group`` is collective over it): ``hier`` by
        name, ``"auto"`` on a topology of several hosts, or a plan whose collectives need
        them. Every context-parallel group then
        constructs its ``ShardedAttention`` at the same point."""
        if self.ctx.group is None:
            return
        if self.schedule is not None:
            needed = schedule_subgroups(self.ctx, self.schedule)
            if not needed:
                return
        elif self.algorithm == "hier" or (self.algorithm == "auto"
                                          and len(self.topology.hosts) > 1):
            # hier by name, or the planner's pick on several hosts, which may be hier: its
            # node and rail groups depend only on the hosts
            topology = self.topology or local_topology(self.world, self.hosts)
            shape = build("hier", topology, DecodeWorkload("debug", self.world))
            needed = schedule_subgroups(self.ctx, shape)
        else:
            return
        make_subgroups_everywhere(self.ctx, needed)

    def _topology(self, topology):
        """What ``"auto"`` plans on: the given topology of the group's devices, or the local
        CPU ranks of a CPU group. A CUDA group's GPUs need to be described by the caller."""
        from treeattn.topo import Topology

        if topology is None:
            if self.ctx.device.type != "cpu":
                raise ShardedAttentionError(
                    f"algorithm='auto' on a {self.ctx.backend} group plans on its GPUs' "
                    "topology: pass topology= (a spec such as 'dgx-h100:nodes=1', or a file "
                    "from `treeattn topo`), or a plan from treeattn.plan")
            return local_topology(self.ctx.world)
        try:
            found = topology if isinstance(topology, Topology) else Topology.load(topology)
        except (TreeattnError, TypeError, OSError) as exc:
            raise ShardedAttentionError(f"topology: {exc}") from None
        if found.num_gpus != self.ctx.world:
            raise ShardedAttentionError(f"the topology has {found.num_gpus} GPUs, the group "
                                        f"{self.ctx.world} ranks")
        return found

    @property
    def world(self) -> int:
        return self.ctx.world

    @property
    def rank(self) -> int:
        return self.ctx.rank

    # -- checks ---------------------------------------------------------------------------
    def _check(self, q, k, v, kv_len) -> AttnDims:
        for name, t, dims in (("q", q, 3), ("k_shard", k, 4), ("v_shard", v, 4)):
            if not isinstance(t, torch.Tensor) or t.dim() != dims:
                shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                want = "(B, Hq, D)" if dims == 3 else "(B, Hkv, T, D)"
                raise ShardedAttentionError(f"{name} must be {want}, got {shape}")
            if t.device != self.ctx.device:
                raise ShardedAttentionError(f"{name} is on {t.device}, this rank's group runs on "
                                            f"{self.ctx.device}")
        b, hq, d = q.shape
        if k.shape != v.shape or k.shape[0] != b or k.shape[3] != d or hq % max(k.shape[1], 1):
            raise ShardedAttentionError(f"shards k {tuple(k.shape)} and v {tuple(v.shape)} do "
                                        f"not fit q {tuple(q.shape)} (B, Hq % Hkv == 0, D)")
        if k.dtype != v.dtype:
            raise ShardedAttentionError(f"k_shard is {k.dtype} and v_shard {v.dtype}")
        if self.plan is not None:
            m = self.plan.workload.model
            if (hq, k.shape[1], d) != (m.n_heads, m.n_kv_heads, m.head_dim):
                raise ShardedAttentionError(
                    f"shapes Hq={hq}, Hkv={k.shape[1]}, D={d} do not match the plan's "
                    f"{m.n_heads} query / {m.n_kv_heads} KV heads of dimension {m.head_dim}")
        if kv_len is not None:
            self._check_kv_len(kv_len, b, k.shape[2])
        try:
            dtype_name(k.dtype)
        except RuntimeFailure as exc:
            raise ShardedAttentionError(f"KV dtype {k.dtype} is not supported") from exc
        return AttnDims(b, hq, k.shape[1], d, k.dtype)

    def _check_kv_len(self, kv_len, batch: int, tokens: int) -> None:
        """``kv_len`` (B,) integers within this rank's shard: ``0 <= kv_len <= T``."""
        if (not isinstance(kv_len, torch.Tensor) or tuple(kv_len.shape) != (batch,)
                or kv_len.dtype.is_floating_point or kv_len.dtype.is_complex
                or kv_len.dtype == torch.bool):
            shown = (f"{kv_len.dtype} {tuple(kv_len.shape)}" if isinstance(kv_len, torch.Tensor)
                     else type(kv_len).__name__)
            raise ShardedAttentionError(f"kv_len must be an integer tensor of shape ({batch},), "
                                        f"got {shown}")
        if batch and (int(kv_len.min()) < 0 or int(kv_len.max()) > tokens):
            raise ShardedAttentionError(f"kv_len {kv_len.tolist()[:8]} must lie within this "
                                        f"rank's shard of {tokens} tokens")

    # -- executors ------------------------------------------------------------------------
    def _schedule(self, dims: AttnDims, lengths: list[int]) -> Schedule:
        if self.schedule is not None:
            return self.schedule
        lengths = lengths if sum(lengths) >= len(lengths) else [1] * len(lengths)
        topology = self.topology or local_topology(self.world, self.hosts)  # a named one's
        return build(self.algorithm, topology, workload_for(dims, lengths))

    def _executor(self, dims: AttnDims, scale: float, length: int):
        """The executor for these shapes, made collectively the first time each is seen.
        A schedule that sends KV blocks sizes them from every rank's shard length, so for
        those the lengths are exchanged on every call (and the executor remade if they
        changed)."""
        key = (dims, scale)
        found = self._executors.get(key)
        if found is not None and found[1]:
            return found
        shape = [dims.batch, dims.n_heads, dims.n_kv_heads, dims.head_dim, str(dims.kv_dtype),
                 scale]
        seen = gather_named(self.ctx, [digest(shape), length], "the first call of this shape"
                            if found is None else "a call")
        if len({s for s, _ in seen}) > 1:
            agree(self.ctx, f"the shapes (this rank: B, Hq, Hkv, D, dtype, scale = {shape})",
                  digest(shape))
        lengths = [n for _, n in seen]
        if found is not None and found[2] == lengths:
            return found
        schedule = self._schedule(dims, lengths)
        made = (_Reducer(self.ctx, schedule, lengths, dims, scale), partial_only(schedule),
                lengths)
        self._executors[key] = made
        return made

    # -- public ---------------------------------------------------------------------------
    def __call__(self, q: torch.Tensor, k_shard: torch.Tensor, v_shard: torch.Tensor,
                 kv_len: torch.Tensor | None = None, return_lse: bool = False):
        """Attention of ``q`` (B, Hq, D) over every rank's shard, on every rank.

        ``k_shard``, ``v_shard``: this rank's (B, Hkv, T, D), any T (0 included); GQA when
        ``Hq % Hkv == 0``. ``kv_len`` (B,): valid tokens of each sequence in this shard.
        Returns ``o`` (B, Hq, D) in ``q``'s dtype, and with ``return_lse`` also the
        natural-log LSE (B, Hq) fp32 of the scores over all shards. Collective.
        """
        t0 = time.perf_counter()
        dims = self._check(q, k_shard, v_shard, kv_len)
        scale = self.scale if self.scale is not None else 1.0 / math.sqrt(dims.head_dim)
        ex, simple, _ = self._executor(dims, scale, k_shard.shape[2])
        kv = stacked_view(k_shard, v_shard)
        if not simple:
            if kv_len is not None:
                raise ShardedAttentionError(f"{ex.schedule.algorithm} passes KV or queries "
                                            "between ranks and takes no kv_len")
            if kv is None:  # the ring's own send buffer: K and V stacked (a copy)
                kv = torch.stack([k_shard, v_shard])  # (2, B, Hkv, T, D)
            (o, lse), _ = ex.decode(q, kv)
        elif kv is not None and kv_len is None:
            (o, lse), _ = ex.decode(q, kv)
        else:
            o, lse = partial_attention(q, k_shard, v_shard, scale=scale, kv_len=kv_len)
            o, lse = unpack_partial(ex.reduce(q, pack_partial(o, lse), self._empty_kv(dims)),
                                    dims)
        out = o.to(q.dtype)  # (B, Hq, D)
        self.calls += 1
        self.elapsed_s += time.perf_counter() - t0
        return (out, lse) if return_lse else out

    def reduce(self, o: torch.Tensor, lse: torch.Tensor, *, lse_base: str,
               scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Merge every rank's own partial ``(o (B, Hq, D), lse (B, Hq))`` by the plan's
        schedule; returns the merged ``o`` fp32 and its natural-log ``lse`` on every rank.

        ``lse_base`` must be named: ``"e"`` (natural) or ``"2"`` (FlashInfer's base 2).
        Only the partial-merging algorithms take a partial (not ``ring``, ``ring-passq``).
        """
        if not isinstance(o, torch.Tensor) or o.dim() != 3 or not isinstance(lse, torch.Tensor) \
                or tuple(lse.shape) != tuple(o.shape[:2]):
            raise ShardedAttentionError("reduce takes o (B, Hq, D) and lse (B, Hq)")
        b, hq, d = o.shape
        kv_heads = self.plan.workload.model.n_kv_heads if self.plan is not None else 1
        dims = AttnDims(b, hq, kv_heads, d, torch.float32)
        scale = scale if scale is not None else 1.0 / math.sqrt(d)
        ex, simple, _ = self._executor(dims, scale, 0)
        if not simple:
            raise ShardedAttentionError(f"{ex.schedule.algorithm} does not merge partials")
        packed = pack_partial(o, natural_lse(lse, lse_base))
        q = torch.zeros(b, hq, d, device=o.device)  # unused by a partial-only schedule
        return unpack_partial(ex.reduce(q, packed, self._empty_kv(dims)), dims)

    def _empty_kv(self, dims: AttnDims) -> torch.Tensor:
        key = (dims.batch, dims.n_kv_heads, dims.head_dim, dims.kv_dtype)
        if key not in self._empty:
            self._empty[key] = torch.empty(2, dims.batch, dims.n_kv_heads, 0, dims.head_dim,
                                           dtype=dims.kv_dtype, device=self.ctx.device)
        return self._empty[key]
