"""Execute one rank's part of a :class:`~treeattn.schedule.ir.Schedule` with torch.distributed.

The semantics are those of ``treeattn/schedule/ir.py``, step for step:

- ``Compute``: local work through :mod:`treeattn.kernels` (``attention``, ``attention_block``)
  or small fp32 arithmetic (``init_max``, ``rescale``, ``finalize``);
- ``Send``: ``isend`` of the payload buffer (or a chunk of it) with the step's tag. Buffers are
  never changed in place, so the tensor in flight *is* the snapshot;
- ``Recv``: wait (with a timeout that names the peer) for a receive posted ahead: the next
  receive is posted as soon as the previous one completed, so at most one is in flight ahead.
  For ring this puts the next KV block on the wire while the current one is attended to.
  Messages go through :mod:`treeattn.runtime.transport`: ``isend``/``irecv`` (gloo) or
  ``batch_isend_irecv`` (NCCL, which needs its point-to-point calls grouped), or a local
  channel where one is plugged in (the CPU test bed's mailboxes for small ones);
- ``Merge``: the log-sum-exp merge (``treeattn.kernels.merge``), a max, a sum or a
  log-sum-exp, of a received message or of what a collective kept;
- ``Collective``: one library collective on a subgroup made once per run setup
  (:mod:`treeattn.runtime.collectives`).

Each run records a per-step timeline (same step indices and names as the simulator's), the
bytes this rank sent, and the peak tensor bytes it held (CPU: storages the runtime holds,
including its KV shard; CUDA: ``torch.cuda.max_memory_allocated``).

Per-step host cost is kept low (``benchmarks/executor_overhead.py``): each step is bound to
its handler once per :class:`Executor`; receive buffers of non-KV messages are allocated once
per executor and reused by every run (KV blocks come from the executor's pool); the timeline
is stamped into a preallocated list; the empty shard's identity partial is made once; and the
CPU memory walk, whose result is the same on every run of one executor with the same inputs,
runs on the first run only (``memory=True`` forces it on every run).

Where a local transport is plugged in (:func:`treeattn.runtime.transport.compile_program`:
the CPU test bed's mailboxes), a rank whose steps are its attention followed by whole-partial
sends, receives and merges (tree, all-gather, butterfly at powers of two) may run them, the
attention included, as one compiled call on every run that does not walk memory. Its results
and timeline are the Python steps'.
"""

from __future__ import annotations

import dataclasses
import math
import time

import torch

from treeattn.runtime import passq
from treeattn.runtime.collectives import Groups
from treeattn.runtime.errors import RuntimeFailure
from treeattn.runtime.group import RankContext
from treeattn.runtime.run_state import KVPool, RunState, RunStats, attend_packed, handler_for
from treeattn.runtime.transport import compile_program, transport_for
from treeattn.runtime.wire import (
    AttnDims,
    identity_partial,
    kv_message_lengths,
    message_numel,
    unpack_partial,
)
from treeattn.schedule.ir import (
    Recv,
    Schedule,
    step_name,
)


class Executor:
    """Runs ``schedule.steps[ctx.rank]`` against this rank's KV shard.

    Parameters
    ----------
    ctx
        This rank's place in the group.
    schedule
        The plan's schedule; every rank holds the same one.
    lengths
        Every rank's shard length (tokens), used to size the KV messages.
    dims
        Batch, heads, head dim and KV dtype.
    scale
        Score scale, default ``1 / sqrt(D)``.
    compiled
        Run a plain reduction of partials as one compiled call where the plugged-in local
        transport can (:func:`~treeattn.runtime.transport.compile_program`); False keeps the
        Python steps (calibration measures both).
    """

    def __init__(
        self,
        ctx: RankContext,
        schedule: Schedule,
        lengths: list[int],
        dims: AttnDims,
        scale: float | None = None,
        compiled: bool = True,
    ) -> None:
        if schedule.world != ctx.world:
            raise RuntimeFailure(f"schedule is for {schedule.world} ranks, group has {ctx.world}")
        self.ctx, self.schedule = ctx, schedule
        self.dims = dataclasses.replace(dims, world=schedule.world)  # sizes pass-Q buffers
        self.steps = schedule.steps[ctx.rank]
        self.scale = scale if scale is not None else 1.0 / math.sqrt(dims.head_dim)
        self.kv_lengths = kv_message_lengths(schedule, lengths)
        self.recv_order = [i for i, s in enumerate(self.steps) if isinstance(s, Recv)]
        largest = max((n for (r, _), n in self.kv_lengths.items() if r == ctx.rank), default=0)
        self.kv_pool = KVPool(dims.kv_dtype, ctx.device, dims.numel("kv", largest))
        self.passq = passq.uses_passq(self.steps)
        # Once per executor, not per step: names, handlers, receive buffers.
        self.names = [step_name(s) for s in self.steps]
        self.handlers = [handler_for(s) for s in self.steps]
        self.transport = transport_for(ctx)  # collective the first time, as Groups is
        # every rank makes every subgroup, in one order; a local channel may take small ones
        self.groups = Groups(ctx, schedule, self.transport.channel)
        self.on_cuda = ctx.device.type == "cuda"
        self.recv_buffers: dict[int, torch.Tensor] = {}  # step index -> reused buffer (not KV)
        for index in self.recv_order:
            step = self.steps[index]
            if step.payload != "kv":
                numel = message_numel(self.dims, step.payload, step.chunk, 0)
                self.recv_buffers[index] = torch.empty(
                    numel, dtype=self.dims.dtype(step.payload), device=ctx.device)
        # The empty shard's partial, shared by every run (nothing writes a buffer in place)
        self.identity = identity_partial(self.dims, ctx.device)  # (B*Hq*(D+1),) packed
        # Buffers a run must not hand out as its result: reused receive buffers, the identity
        self.owned = {b.untyped_storage().data_ptr()
                      for b in [*self.recv_buffers.values(), self.identity]}
        self.peaks: dict[tuple, int] = {}  # input signature -> CPU memory peak of a run
        # A partial-only reduction over a local channel may run as one compiled call; it
        # moves fp32 partials, so a bf16 wire format keeps the Python steps
        plain = compiled and not self.on_cuda and schedule.partial_dtype == "fp32"
        self.program = None if not plain else compile_program(
            self.steps, self.names, ctx.rank, self.transport.channel, self.dims)

    # -- public ----------------------------------------------------------------------------
    def run(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        resident: list[torch.Tensor] | None = None,
        memory: bool | None = None,
    ) -> tuple[tuple[torch.Tensor, torch.Tensor], RunStats]:
        """Execute the schedule once; ``q`` (B, Hq, D), ``kv`` (2, B, Hkv, T, D) this shard.

        ``resident`` lists tensors to count in the memory peak (the KV cache storage).
        ``memory``: walk the held tensors at every step boundary for the CPU memory peak;
        ``None`` (default) walks on the first run with these input shapes and resident bytes
        and reports that peak on later ones (the buffers, hence the peak, are the same).
        Returns the final partial ``(o (B, Hq, D), lse (B, Hq))`` and the run's stats.
        """
        resident = resident or [kv]
        key = None
        if not self.on_cuda and memory is not True:
            key = (tuple(q.shape), tuple(kv.shape),
                   sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                        for t in resident}.values()))
        cached = None if memory else self.peaks.get(key)
        sample = not self.on_cuda and cached is None and memory is not False
        if (self.program is not None and not sample
                and not self.transport.channel.deferred):  # FIFO behind those: Python path
            result = self._program_partial(q, kv)
            return result, RunStats(timeline=self.program.timeline(self.ctx.rank),
                                    bytes_sent=self.program.bytes_sent, peak_bytes=cached or 0)
        state = RunState(self, q, kv, resident)
        if self.on_cuda:
            torch.cuda.reset_peak_memory_stats(self.ctx.device)
        n = len(self.steps)
        stamps = [0.0] * (2 * n)
        clock, steps, handlers = time.perf_counter, self.steps, self.handlers
        t0 = clock()
        state.post_next_recv()
        for index in range(n):
            stamps[2 * index] = clock()
            handlers[index](state, index, steps[index])
            if self.on_cuda:
                torch.cuda.synchronize(self.ctx.device)
            stamps[2 * index + 1] = clock()
            if sample:
                state.sample_memory()
        state.finish_sends()
        rank, names = self.ctx.rank, self.names
        state.stats.timeline = [(rank, i, names[i], stamps[2 * i] - t0, stamps[2 * i + 1] - t0)
                                for i in range(n)]
        if self.on_cuda:
            state.stats.peak_bytes = int(torch.cuda.max_memory_allocated(self.ctx.device))
        elif sample:
            if key is not None:
                self.peaks[key] = state.stats.peak_bytes
        elif cached is not None:
            state.stats.peak_bytes = cached
        final = state.bufs["partial"]
        if final.untyped_storage().data_ptr() in self.owned:  # a reused receive buffer
            final = final.clone()
        return unpack_partial(final, self.dims), state.stats

    def decode(self, q: torch.Tensor, kv: torch.Tensor
               ) -> tuple[tuple[torch.Tensor, torch.Tensor], int]:
        """The final partial ``(o (B, Hq, D), lse (B, Hq))`` and the bytes this rank sent,
        without the timeline or the memory peak: for generation, which runs a schedule per
        layer per token and needs neither. Through the program where there is one (with no
        deferred sends ahead of it); otherwise :meth:`run`."""
        if self.program is not None and not self.transport.channel.deferred:
            return self._program_partial(q, kv), self.program.bytes_sent
        result, stats = self.run(q, kv)
        return result, stats.bytes_sent

    def _program_partial(self, q: torch.Tensor, kv: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """The final partial through the compiled program: attention and steps in one C
        call."""
        final = self.program.run(q, kv, self.scale, lambda: attend_packed(self, q, kv),
                                 self.ctx.rank, self.ctx.timeout_s)
        return unpack_partial(final, self.dims)
