"""The executor's own host cost per message step, measured against raw ``isend``/``irecv``.

The ping-pong latency that calibration measures is raw gloo: ``dist.isend``/``irecv`` of a
preallocated buffer and a wait. The executor does more per step: it looks up the step's
buffers, slices payloads, posts receives ahead, records its timeline. That fixed cost is
invisible in the ping-pong and matters wherever messages are tiny (a tree's partials).

:func:`time_variants` runs one schedule's messages three ways in the same process group,
interleaved within every repetition (the order rotates), so each ratio compares runs that saw
the same machine load:

- ``executor``: :meth:`treeattn.runtime.executor.Executor.run` with its Python steps, the
  whole step;
- ``program``: the same with the rank's steps run as one C call
  (:mod:`treeattn.testbed.transport.shm_program`), where the group can (CPU ranks of one host,
  shared memory, a C compiler); otherwise it repeats ``executor``;
- ``raw``: the same messages (sizes, order, peers, tags) as plain ``isend``/``irecv`` of
  preallocated buffers through the executor's transport (:mod:`treeattn.runtime.transport`:
  shared memory for small messages between CPU ranks of one host), the sends waited for at
  the end: the floor any executor pays;
- ``raw+kernels``: ``raw`` plus the same kernel calls (``partial_attention`` per attention
  Compute, ``merge`` per partial Merge) on preallocated tensors: the floor with the work;
- ``raw-gloo``: ``raw`` through ``torch.distributed`` directly, what a hand-written gloo
  loop pays (the transport's gain, for the record).

:func:`measure_step_overhead` turns that into the profile key the simulator charges on every
Send and Recv step (``executor.step_overhead_s``, read by
:func:`treeattn.testbed.host.profiles.executor_step_overhead`), and the program's own, which may be
below the raw messages' (``executor.program_step_s``, for ranks that run as a program, see
:mod:`treeattn.testbed.host.partial_reduction`); ``treeattn calibrate`` records both, and
``benchmarks/executor_overhead.py`` reports the full comparison.
"""

from __future__ import annotations

import time

import numpy as np
import torch
import torch.distributed as dist

from treeattn.kernels import merge_packed, partial_attention
from treeattn.runtime.executor import Executor
from treeattn.runtime.group import RankContext, all_gather_objects, wait_work
from treeattn.runtime.plans import build, local_topology, workload_for
from treeattn.runtime.wire import AttnDims, kv_message_lengths, message_numel
from treeattn.schedule.ir import Compute, Merge, Recv, Send
from treeattn.testbed.transport.shm import MAX_TAGS, SLOT_BYTES, max_world

VARIANTS = ("executor", "program", "raw", "raw+kernels", "raw-gloo")
TINY = AttnDims(1, 1, 1, 8)  # data costs nothing: what is left is the per-step host cost
TINY_TOKENS = 4  # per shard
INNER = 10  # back-to-back runs per timed sample
WARMUP_REPS = 5
CALIBRATION_REPS = 40  # about a second at world 2 on a CPU


def raw_plan(ctx: RankContext, schedule, dims: AttnDims, lengths: list[int]) -> list[tuple]:
    """This rank's steps as ``(kind, peer, tag, buffer)``: kind True for a send, False for a
    receive, or ``"attention"``/``"merge"`` for the kernel steps."""
    kv_lengths = kv_message_lengths(schedule, list(lengths))
    plan = []
    for index, step in enumerate(schedule.steps[ctx.rank]):
        if isinstance(step, (Send, Recv)):
            n = message_numel(dims, step.payload, step.chunk, kv_lengths.get((ctx.rank, index), 0))
            buf = torch.zeros(n, dtype=dims.dtype(step.payload))
            peer = step.dst if isinstance(step, Send) else step.src
            plan.append((isinstance(step, Send), peer, step.tag, buf))
        elif isinstance(step, Compute) and step.label == "attention":
            plan.append(("attention", None, None, None))
        elif isinstance(step, Merge) and step.op == "partial":
            plan.append(("merge", None, None, None))
    return plan


def raw_runner(ctx: RankContext, plan: list[tuple], dims: AttnDims, q: torch.Tensor,
               kv: torch.Tensor, kernels: bool, p2p=dist):
    """A callable that sends and receives ``plan``'s messages raw (and runs its kernels),
    through ``p2p`` (``torch.distributed`` or a :class:`~treeattn.runtime.transport.Transport`:
    anything with ``isend(tensor, peer, tag=)`` and ``irecv``). Every wait has the
    context's timeout and names the peer."""
    rows = dims.batch * dims.n_heads
    packed = torch.zeros(rows * (dims.head_dim + 1))  # a partial as the executor holds it

    def run() -> None:
        sends = []
        for kind, peer, tag, buf in plan:
            if kind is True:
                sends.append((p2p.isend(buf, peer, tag=tag), peer))
            elif kind is False:
                wait_work(p2p.irecv(buf, peer, tag=tag), ctx, peer, "raw receive")
            elif kernels and kind == "attention":
                partial_attention(q, kv[0], kv[1])
            elif kernels and kind == "merge":  # the executor's merge of a whole partial
                merge_packed(packed, packed, rows)
        for work, peer in sends:
            wait_work(work, ctx, peer, "raw send")
    return run


def time_variants(ctx: RankContext, algorithm: str, reps: int) -> dict:
    """Seconds per run of each variant, one sample per repetition (max over ranks), for the
    tiny-payload schedule of ``algorithm`` at this group's world size; every rank returns it."""
    lengths = [TINY_TOKENS] * ctx.world
    dims = TINY
    g = torch.Generator().manual_seed(ctx.rank)
    q = torch.randn(dims.batch, dims.n_heads, dims.head_dim, generator=g)  # (B, Hq, D)
    kv = torch.randn(2, dims.batch, dims.n_kv_heads, TINY_TOKENS, dims.head_dim,
                     generator=g)  # (2, B, Hkv, T, D)
    schedule = build(algorithm, local_topology(ctx.world), workload_for(dims, lengths))
    executor = Executor(ctx, schedule, lengths, dims, compiled=False)
    compiled = Executor(ctx, schedule, lengths, dims)
    programs = all(all_gather_objects(ctx, compiled.program is not None))
    plan = raw_plan(ctx, schedule, dims, lengths)
    runners = {"executor": lambda: executor.run(q, kv),  # as `run` calls it
               "program": lambda: compiled.run(q, kv),  # as `run` and `generate` call it
               "raw": raw_runner(ctx, plan, dims, q, kv, False, executor.transport),
               "raw+kernels": raw_runner(ctx, plan, dims, q, kv, True, executor.transport),
               "raw-gloo": raw_runner(ctx, plan, dims, q, kv, kernels=False)}
    line_up = torch.zeros(1)
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for rep in range(reps + WARMUP_REPS):
        for i in range(len(VARIANTS)):
            variant = VARIANTS[(rep + i) % len(VARIANTS)]
            dist.all_reduce(line_up)  # line the ranks up; not timed
            run = runners[variant]
            t0 = time.perf_counter()
            for _ in range(INNER):
                run()
            if rep >= WARMUP_REPS:
                times[variant].append((time.perf_counter() - t0) / INNER)
    everyone = all_gather_objects(ctx, times)
    return {
        "programs": programs,
        "steps_busiest_rank": max(len(s) for s in schedule.steps),
        "messages_busiest_rank": max(sum(isinstance(x, (Send, Recv)) for x in s)
                                     for s in schedule.steps),
        "per_run_s": {v: np.max([r[v] for r in everyone], axis=0).tolist() for v in VARIANTS},
    }  # fmt: skip


def overhead_per_message(result: dict, variant: str = "executor") -> np.ndarray:
    """Per repetition: (``variant`` − raw+kernels) / messages of the busiest rank, seconds."""
    runs = {v: np.asarray(t) for v, t in result["per_run_s"].items()}
    return (runs[variant] - runs["raw+kernels"]) / max(1, result["messages_busiest_rank"])


def measure_step_overhead(ctx: RankContext, reps: int = CALIBRATION_REPS) -> dict:
    """The profile section ``executor`` from the tree schedule at this world size:

    - ``step_overhead_s``: the Python steps' median extra host time per Send/Recv step
      (never below zero), and ``ratio_executor_raw``, their median time over raw, for the
      record;
    - where the ranks ran as a program: ``program_step_s``, the program's median host time
      per message step beyond raw+kernels (signed: the C call can beat Python's raw
      messages, which the ping-pong α is measured with), and the mailboxes' limits
      ``program_message_bytes``, ``program_tags`` and ``program_max_world``."""
    result = time_variants(ctx, "tree", reps)
    runs = {v: np.asarray(t) for v, t in result["per_run_s"].items()}
    section = {"step_overhead_s": max(0.0, float(np.median(overhead_per_message(result)))),
               "ratio_executor_raw": float(np.median(runs["executor"] / runs["raw"])),
               "schedule": "tree", "reps": reps}  # fmt: skip
    if result["programs"]:
        section.update(program_step_s=float(np.median(overhead_per_message(result, "program"))),
                       program_message_bytes=SLOT_BYTES, program_tags=MAX_TAGS,
                       program_max_world=max_world())
    return section
