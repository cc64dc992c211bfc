"""``treeattn run`` on every rank: (calibrate,) predict, then measure, and compare.

Order matters and is fixed: the profile comes from microbenchmarks only (calibration in this
group, or a file), rank 0 builds each schedule and predicts it with the simulator, and only
then do the ranks measure it. The prediction is never fitted to the measurement it is
checked against.

Data: the query and every rank's shard are drawn from seeded generators (one per rank), so
rank 0 can rebuild the global KV cache afterwards and compute the single-process reference
for ``max_abs_diff`` without any rank holding more than its shard during the measurement.

Error of one point: ``max(p/m, m/p) − 1``. Over a grid:
``geo_mean_error = exp(mean |ln(predicted / measured)|) − 1``.

Bands, because one number is not an answer on a shared host: each point reports the measured
median with its p10–p90 over the timed steps, and the predicted value with the band the
calibration's own spread implies (the simulation repeated with every calibrated cost at its
p10, then at its p90: :meth:`treeattn.sim.files.profiles.HostProfiles.bound`). A point passes
(:func:`within_band`) when the prediction lies in the measured band widened by
``--max-error`` on both sides.

Several algorithms at one ``seq_len`` are timed interleaved (A B, B A, ...:
:func:`~treeattn.runtime.measure.timing.time_interleaved`), so their ratios survive a
drifting machine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from treeattn.kernels import partial_attention
from treeattn.kernels.reference import naive_attention
from treeattn.runtime.agreement import agree_at_setup
from treeattn.runtime.errors import RuntimeFailure
from treeattn.runtime.group import RankContext, all_gather_objects, broadcast_object
from treeattn.runtime.measure.timing import time_interleaved
from treeattn.runtime.plans import (
    ALGORITHMS,
    DTYPES,
    build,
    check_fits,
    local_schedule,
    local_topology,
    shard_lengths,
    step_runner,
    uses_cuda,
    workload_for,
)
from treeattn.runtime.transport import plugged_in
from treeattn.runtime.wire import AttnDims
from treeattn.schedule.ir import Send

NAIVE_LIMIT_BYTES = 256 << 20  # float64 oracle only while its (B, Hq, T, D) copy is this small


@dataclass(frozen=True)
class RunRequest:
    """Everything a ``treeattn run`` does, as one picklable job (``job(ctx)``)."""

    seq_lens: tuple[int, ...]
    algorithms: tuple[str, ...] = ("auto",)
    batch: int = 1
    n_heads: int = 32
    n_kv_heads: int = 8
    head_dim: int = 128
    dtype: str = "float32"
    warmup: int = 2
    steps: int = 10  # the floor on timed steps per point
    min_time_s: float = 1.0  # and more steps until this much was timed per point
    check: bool = False
    profile: dict | None = None
    native: bool = False
    reference: bool = True
    ref_limit_bytes: int = 2 << 30  # skip the reference above this much global KV
    seed: int = 0
    params: dict = field(default_factory=dict)  # generator parameters (tree shape, ...)
    topology: str | None = None  # predict on this topology (spec or file) instead
    # A plan file's schedule (``run --plan``): executed as it is, under the name "plan", on
    # the plan's own shard lengths.
    plan: dict | None = None
    plan_lengths: tuple[int, ...] | None = None
    partial_dtype: str | None = None  # how partials travel (None: each algorithm's own)

    @property
    def dims(self) -> AttnDims:
        return AttnDims(self.batch, self.n_heads, self.n_kv_heads, self.head_dim,
                        DTYPES[self.dtype], partial_dtype=self.partial_dtype)

    def __call__(self, ctx: RankContext) -> list[dict] | None:
        return run_points(ctx, self)


def bytes_needed(req: RunRequest, world: int, local_ranks: int | None = None) -> int:
    """Memory the ranks on this machine need at the largest ``seq_len``, with headroom.

    Each rank holds its KV shard and, in the worst schedule (ring), two more blocks of that
    size in flight; rank 0 also rebuilds the global KV for the reference when it is asked
    for and small enough. With CUDA each rank has its own GPU, so count one rank.
    """
    element = torch.empty((), dtype=DTYPES[req.dtype]).element_size()
    per_token = 2 * req.batch * req.n_kv_heads * req.head_dim * element
    seq = max(req.seq_lens)
    # a plan file's own shards (one may hold far more than an even split would)
    longest = max(req.plan_lengths) if req.plan_lengths else -(-seq // world)
    shard = per_token * longest
    total = (local_ranks or world) * 3 * shard
    if req.reference and per_token * seq <= req.ref_limit_bytes:
        total += 2 * per_token * seq
    return total


def validate(req: RunRequest, world: int, device: str = "cpu",
             local_ranks: int | None = None) -> None:
    """Raise :class:`RuntimeFailure` for a request that cannot run on ``world`` ranks,
    including one whose KV cache cannot fit in this machine's memory (``device``: the
    ``--device`` choice; ``local_ranks``: how many of the ranks run here, default all)."""
    for name in req.algorithms:
        if name not in ALGORITHMS and not (name == PLAN and req.plan is not None):
            raise RuntimeFailure(f"unknown algorithm {name!r} (known: {', '.join(ALGORITHMS)})")
    if req.plan is not None and len(req.plan_lengths or ()) != world:
        raise RuntimeFailure(f"the plan is for {len(req.plan_lengths or ())} ranks, the group "
                             f"has {world}")
    for seq_len in req.seq_lens:
        if seq_len < world:
            raise RuntimeFailure(f"seq_len {seq_len} is smaller than the world size {world}")
    if req.dtype not in DTYPES:
        raise RuntimeFailure(f"unknown dtype {req.dtype!r} (known: {', '.join(DTYPES)})")
    if min(req.batch, req.n_heads, req.n_kv_heads, req.head_dim) < 1:
        raise RuntimeFailure("batch, heads and head dim must be positive")
    if req.n_heads % req.n_kv_heads:
        raise RuntimeFailure(f"--heads {req.n_heads} is not a multiple of --kv-heads")
    if req.dtype in DTYPES:
        check_fits(bytes_needed(req, world, local_ranks), "this run",
                   uses_cuda(device))
    if req.check and world < 2:
        raise RuntimeFailure("--check needs at least 2 ranks (there is nothing to predict)")
    if req.steps < 1 or req.warmup < 0:
        raise RuntimeFailure("--steps must be at least 1 and --warmup at least 0")
    if req.topology is not None and world >= 2:
        predictor(None, world, req.topology)  # readable, and the right size
    if world >= 2:  # let the generators reject bad parameters before any rank starts
        workload = workload_for(req.dims, shard_lengths(max(req.seq_lens), world))
        for name in req.algorithms:
            if name not in ("auto", PLAN):
                build(name, local_topology(world), workload, **params_for(req, name))


def params_for(req: RunRequest, algorithm: str) -> dict:
    """Generator parameters for ``algorithm``: ``req.params`` apply to ``tree`` only."""
    return dict(req.params) if algorithm == "tree" else {}


def largest_message_bytes(req: RunRequest, world: int) -> int:
    """The largest point-to-point message any of the run's schedules sends, in bytes (what
    the calibration must cover); ``auto`` counts as ring (a whole shard), its worst case."""
    if world < 2:
        return 0
    workload = workload_for(req.dims, shard_lengths(max(req.seq_lens), world))
    largest = 0
    for name in req.algorithms:
        name = "ring" if name == "auto" else name
        schedule = (planned_schedule(req) if name == PLAN else
                    build(name, local_topology(world), workload, **params_for(req, name)))
        largest = max([largest] + [s.nbytes for steps in schedule.steps for s in steps
                                   if isinstance(s, Send)])
    return largest


def make_query(seed: int, dims: AttnDims, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(dims.batch, dims.n_heads, dims.head_dim, generator=g)  # (B, Hq, D)
    return q.to(device=device, dtype=dims.kv_dtype)


def make_shard(seed: int, rank: int, tokens: int, dims: AttnDims, device) -> torch.Tensor:
    """Rank ``rank``'s KV shard, (2, B, Hkv, tokens, D), reproducible from the seed alone."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + rank + 1)
    shape = (2, dims.batch, dims.n_kv_heads, tokens, dims.head_dim)
    return torch.randn(shape, generator=g).to(device=device, dtype=dims.kv_dtype)


def point_error(predicted: float, measured: float) -> float:
    """How far off one prediction is, symmetric in over- and under-prediction:
    ``max(p/m, m/p) − 1`` (0.25 means 25% too slow or too fast).

    >>> round(point_error(1.0, 1.25), 6), round(point_error(1.25, 1.0), 6)
    (0.25, 0.25)
    """
    ratio = predicted / measured
    return max(ratio, 1.0 / ratio) - 1.0


def within_band(predicted: float, p10: float, p90: float, max_error: float) -> bool:
    """Whether ``predicted`` lies in the measured ``[p10, p90]`` widened by ``max_error``:
    ``p10 / (1 + e) <= predicted <= p90 · (1 + e)`` (the widening is symmetric in the same
    sense as :func:`point_error`).

    >>> within_band(1.2, 0.9, 1.0, 0.25), within_band(1.3, 0.9, 1.0, 0.25)
    (True, False)
    >>> within_band(0.72, 0.9, 1.0, 0.25), within_band(0.71, 0.9, 1.0, 0.25)
    (True, False)
    """
    if not (p10 > 0 and p90 >= p10 and max_error >= 0):
        raise ValueError(f"bad band: p10={p10}, p90={p90}, max_error={max_error}")
    return p10 / (1.0 + max_error) <= predicted <= p90 * (1.0 + max_error)


def mark_bands(points: list[dict], max_error: float) -> list[dict]:
    """Set ``within_band`` on every point (None where nothing was predicted); the points."""
    for p in points:
        p["within_band"] = (within_band(p["predicted_s"], p["measured_p10_s"],
                                        p["measured_p90_s"], max_error)
                            if p.get("predicted_s") else None)
    return points


def geo_mean_error(points: list[dict]) -> float | None:
    """``exp(mean |ln(predicted/measured)|) − 1`` over points that have a prediction: the
    geometric mean of ``1 + point_error`` minus one, so it is on the per-point scale."""
    logs = [abs(math.log(p["predicted_s"] / p["measured_s"]))
            for p in points if p.get("predicted_s") and p.get("measured_s")]
    return math.exp(sum(logs) / len(logs)) - 1 if logs else None


def predictor(profile: dict | None, world: int, topology: str | None = None):
    """``(topology, hardware, backend)`` for the simulator.

    With a topology spec (a multi-node GPU cluster, say) the simulator uses that topology and
    its devices' datasheet models, and the cluster's collectives calibration when the profile
    is one (``calibrate --nccl-tests``); otherwise the calibrated ``local`` topology and
    ``cpu`` model from the profile; with neither, the uncalibrated ``local`` defaults.
    """
    from treeattn.sim.files.profiles import host_profiles, is_gpu_profile

    gpu_profile = profile is not None and is_gpu_profile(profile)
    if topology is not None:
        from treeattn.topo import Topology

        topo = Topology.load(topology)
        if topo.num_gpus != world:
            raise RuntimeFailure(f"topology {topology} has {topo.num_gpus} GPUs, world is {world}")
        if profile is not None and not gpu_profile and cpu_ranks(topo):
            # CPU ranks laid out as hosts: the calibrated local model on that layout
            return host_profiles().models(profile, world, _host_index(topo))
        if gpu_profile:
            from treeattn.sim.files.profiles import gpu_backend

            if profile["world"] != world:
                raise RuntimeFailure(f"the profile was calibrated on {profile['world']} GPUs, "
                                     f"world is {world}")
            return topo, None, gpu_backend(profile)
        return topo, None, None
    if gpu_profile:
        raise RuntimeFailure("an nccl-tests profile describes a GPU cluster: give --topology "
                             "with it")
    if profile is None:
        return local_topology(world), None, None
    return host_profiles().models(profile, world)


def cpu_ranks(topology) -> bool:
    """Whether ``topology`` is CPU ranks (``local``, any host layout): what this machine
    runs, so its calibration prices it."""
    return all(topology.gpu_model(r) == "cpu" for r in range(topology.num_gpus))


def _host_index(topology) -> list[int]:
    index = {h: i for i, h in enumerate(topology.hosts)}
    return [index[topology.host_of(r)] for r in range(topology.num_gpus)]


def calibrates(req: RunRequest) -> bool:
    """Whether a ``--check`` run calibrates in the group first: with no profile, on this
    machine's ranks (no topology, or CPU ranks laid out as hosts)."""
    if not req.check or req.profile is not None:
        return False
    if req.topology is None:
        return True
    from treeattn.topo import Topology

    return cpu_ranks(Topology.load(req.topology))


def _plan_point(req: RunRequest, algorithm: str, lengths: list[int], profile, world: int):
    """Rank 0: the schedule and (with --check) its prediction and predicted band, before any
    measurement: ``(schedule, predicted, timeline, (lo, hi))``."""
    dims = req.dims
    if world == 1:
        return local_schedule(dims, lengths[0]), None, [], (None, None)
    from treeattn.sim import simulate

    topology, hardware, backend = predictor(profile, world, req.topology)
    workload = workload_for(dims, lengths)
    if algorithm == PLAN:
        schedule = planned_schedule(req)
    else:
        schedule = build(algorithm, topology, workload, (hardware, backend),
                         **params_for(req, algorithm))
    if not req.check:
        return schedule, None, [], (None, None)
    sim = simulate(schedule, topology, workload, hardware, backend)
    band = [sim.makespan_s]
    if profile is not None and hardware is not None:  # calibrated CPU ranks: their band
        from treeattn.sim.files.profiles import host_profiles

        for side in ("lo", "hi"):
            topo, hw, be = predictor(host_profiles().bound(profile, side), world, req.topology)
            band.append(simulate(schedule, topo, workload, hw, be, timeline=False).makespan_s)
    return schedule, sim.makespan_s, sim.timeline, (min(band), max(band))


PLAN = "plan"  # the algorithm name of a plan file's schedule


def planned_schedule(req: RunRequest):
    """The schedule of ``req.plan``, validated."""
    from treeattn.sim.files.export import schedule_from_json

    return schedule_from_json(req.plan, "the plan file")


def run_points(ctx: RankContext, req: RunRequest) -> list[dict] | None:
    """Every rank: measure each (seq_len, algorithm); rank 0 returns one dict per point.

    At each ``seq_len`` the algorithms are timed interleaved, one step of each per round.
    """
    dims = req.dims
    agree_at_setup(ctx, plan=req.plan, shard_lengths=req.plan_lengths,
                   shapes=(req.batch, req.n_heads, req.n_kv_heads, req.head_dim),
                   dtype=req.dtype, seq_lens=req.seq_lens, algorithms=req.algorithms,
                   params=req.params, native=req.native)
    profile = req.profile
    if calibrates(req):
        plugin = plugged_in()  # the same on every rank
        if plugin is None:
            raise RuntimeFailure("--check without --profile calibrates this host's ranks, "
                                 "which needs the CPU test bed plugged in "
                                 "(treeattn.testbed.plug_in())")
        profile = broadcast_object(ctx, plugin.calibrate(
            ctx, dims, largest_message_bytes(req, ctx.world)))
    q = make_query(req.seed, dims, ctx.device)  # (B, Hq, D)
    points, outputs = [], []
    for seq_len in req.seq_lens:
        lengths = list(req.plan_lengths) if req.plan else shard_lengths(seq_len, ctx.world)
        kv = make_shard(req.seed, ctx.rank, lengths[ctx.rank], dims, ctx.device)
        plans, steps, lasts = [], [], []
        for algorithm in req.algorithms:
            plan = None
            if ctx.rank == 0:
                plan = _plan_point(req, algorithm, lengths, profile, ctx.world)
            plan = broadcast_object(ctx, plan)
            native = req.native and plan[0].algorithm == "allreduce3"
            run = step_runner(ctx, plan[0], lengths, dims, q, kv, [kv], native)
            last: list = []

            def step(run=run, last=last):
                out, stats = run()
                last[:] = [out]
                return stats

            plans.append((algorithm, native, plan))
            steps.append(step)
            lasts.append(last)
        measured = time_interleaved(ctx, steps, req.warmup, req.steps, req.min_time_s)
        for (algorithm, native, plan), m, last in zip(plans, measured, lasts, strict=True):
            outputs.append(all_gather_objects(ctx, last[0][0].cpu()))
            points.append(_point(algorithm, plan, seq_len, ctx, m, native))
        del kv, steps, lasts
    if ctx.rank != 0:
        return None
    _add_reference(req, points, outputs, ctx.world)
    if profile is not None:
        for p in points:
            p["profile"] = _profile_summary(profile, p)
    return points


def _profile_summary(profile: dict, point: dict) -> dict:
    """What of the profile a point's prediction rests on, and whether its largest message
    was beyond the calibrated sizes (then the bandwidth is extrapolated, and says so)."""
    if profile.get("kind") == "nccl-tests":  # a GPU cluster's collectives calibration
        return {"kind": "nccl-tests", "scales": profile["nccl_tests"]["scales"],
                "world": profile["world"]}
    exchange = profile.get("exchange") or {}
    top = max(exchange.get("sizes") or [0])
    return {"p2p_latency_s": profile["p2p"]["latency_s"],
            "attention_bandwidth_Bps": profile["attention"]["bandwidth_Bps"],
            "exchange_bandwidth_Bps": exchange.get("bandwidth_Bps"),
            "calibrated_up_to_bytes": top,
            "extrapolated": point.get("largest_message_bytes", 0) > top}


def _point(requested, plan, seq_len, ctx, m, native) -> dict:
    schedule, predicted, sim_timeline, (lo, hi) = plan
    measured = m.median_s
    error = point_error(predicted, measured) if predicted else None
    return {
        "algorithm": schedule.algorithm + ("+native" if native else ""),
        "requested": requested,
        "params": {k: v for k, v in schedule.params.items() if k != "tree"},
        "world": ctx.world,
        "seq_len": seq_len,
        "measured_s": measured,
        "p90_s": m.p90_s,
        "measured_p10_s": m.p10_s,
        "measured_p90_s": m.p90_s,
        "steps_timed": len(m.step_s),
        "predicted_s": predicted,
        "predicted_lo_s": lo,
        "predicted_hi_s": hi,
        "error": error,
        "within_band": None,  # set by mark_bands, which knows --max-error
        "largest_message_bytes": max([0] + [s.nbytes for steps in schedule.steps
                                            for s in steps if isinstance(s, Send)]),
        "max_abs_diff": None,
        "bytes_sent": m.bytes_sent,
        "peak_memory_bytes": m.peak_memory_bytes,
        "timeline": [list(e) for e in m.timeline],
        "predicted_timeline": [list(e) for e in sim_timeline],
        "backend": ctx.backend,
    }


def _add_reference(req: RunRequest, points: list[dict], outputs: list, world: int) -> None:
    """Rank 0, after all measurement: single-process attention on the rebuilt global KV."""
    if not req.reference:
        return
    dims, q = req.dims, make_query(req.seed, req.dims, "cpu")
    per_len = len(req.algorithms)
    for i, seq_len in enumerate(req.seq_lens):
        kv_bytes = 2 * dims.batch * dims.n_kv_heads * seq_len * dims.head_dim * 4
        if kv_bytes > req.ref_limit_bytes:
            continue
        lengths = shard_lengths(seq_len, world)
        kv = torch.cat([make_shard(req.seed, r, n, dims, "cpu") for r, n in enumerate(lengths)],
                       dim=3)  # (2, B, Hkv, T, D)
        naive_bytes = 8 * dims.batch * dims.n_heads * seq_len * dims.head_dim
        oracle = naive_attention if naive_bytes <= NAIVE_LIMIT_BYTES else partial_attention
        ref_o = oracle(q, kv[0], kv[1])[0]  # (B, Hq, D)
        del kv
        for j in range(per_len):
            rank_outs = outputs[i * per_len + j]
            diff = max(float((o.float() - ref_o).abs().max()) for o in rank_outs)
            points[i * per_len + j]["max_abs_diff"] = diff
