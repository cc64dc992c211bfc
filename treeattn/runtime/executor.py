"""Execute one rank's part of a :class:`~treeattn.sim.schedule.Schedule` with torch.distributed.

The semantics are those of ``treeattn/sim/schedule.py``, step for step:

- ``Compute``: local work through :mod:`treeattn.kernels` (``attention``, ``attention_block``)
  or small fp32 arithmetic (``init_max``, ``rescale``, ``finalize``);
- ``Send``: ``isend`` of the payload buffer (or a chunk of it) with the step's tag. Buffers are
  never changed in place, so the tensor in flight *is* the snapshot;
- ``Recv``: wait (with a timeout that names the peer) for a receive posted ahead: the next
  receive is posted as soon as the previous one completed, so at most one is in flight ahead.
  For ring this puts the next KV block on the wire while the current one is attended to.
  On NCCL every send and receive goes through ``batch_isend_irecv`` (NCCL groups it); on
  gloo, which posts a batch of one op as is, through plain ``isend``/``irecv``;
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
is stamped into a preallocated list; and the CPU memory walk, whose result is the same on
every run of one executor with the same inputs, runs on the first run only (``memory=True``
forces it on every run).
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from treeattn.kernels import finalize_sums, merge, partial_attention, rescale_to_max
from treeattn.runtime import passq
from treeattn.runtime.collectives import Groups, fold_kept, run_collective
from treeattn.runtime.errors import RuntimeFailure
from treeattn.runtime.group import RankContext, wait_work
from treeattn.runtime.wire import (
    AttnDims,
    chunk_bounds,
    identity_partial,
    kv_message_lengths,
    message_numel,
    pack_partial,
    put_slice,
    take_slice,
    unpack_heads,
    unpack_partial,
)
from treeattn.sim.schedule import (
    Collective,
    Compute,
    Merge,
    Recv,
    Schedule,
    Send,
    Step,
    sent_bytes,
    step_name,
)


@dataclass
class RunStats:
    """What one execution of the schedule cost this rank."""

    timeline: list[tuple[int, int, str, float, float]] = field(default_factory=list)
    bytes_sent: int = 0
    peak_bytes: int = 0


class TensorMemory:
    """Peak bytes of the distinct tensor storages held at step boundaries (CPU accounting)."""

    def __init__(self, resident: list[torch.Tensor]) -> None:
        self.resident, self.peak = resident, 0

    def sample(self, tensors: list[torch.Tensor]) -> None:
        seen: dict[int, int] = {}
        for t in self.resident + tensors:
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        self.peak = max(self.peak, sum(seen.values()))


class _KVPool:
    """Receive buffers for KV blocks, kept across steps and reused once nothing holds them.

    A fresh 64 MiB buffer costs ~10x a reused one on CPU (first-touch page faults), and a
    real ring keeps persistent buffers too. Pooled buffers count toward the memory peak.
    """

    def __init__(self, dtype: torch.dtype, device: torch.device, block_numel: int = 0) -> None:
        self.dtype, self.device = dtype, device
        self.block_numel = block_numel  # the largest KV block this rank receives
        self.buffers: list[torch.Tensor] = []

    def take(self, numel: int, in_use: set[int]) -> torch.Tensor:
        free = [b for b in self.buffers
                if b.numel() >= numel and b.untyped_storage().data_ptr() not in in_use]
        if free:
            return min(free, key=torch.Tensor.numel)[:numel]
        # Every buffer fits the largest block, so uneven shards (blocks one token apart)
        # reuse buffers instead of piling up new ones.
        buf = torch.empty(max(numel, self.block_numel), dtype=self.dtype, device=self.device)
        self.buffers.append(buf)
        return buf[:numel]


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
    """

    def __init__(
        self,
        ctx: RankContext,
        schedule: Schedule,
        lengths: list[int],
        dims: AttnDims,
        scale: float | None = None,
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
        self.kv_pool = _KVPool(dims.kv_dtype, ctx.device, dims.numel("kv", largest))
        self.groups = Groups(ctx, schedule)  # every rank makes every subgroup, in one order
        self.passq = passq.uses_passq(self.steps)
        # Once per executor, not per step: names, handlers, receive buffers.
        self.names = [step_name(s) for s in self.steps]
        self.handlers = [_handler(s) for s in self.steps]
        self.batch_p2p = ctx.backend != "gloo"  # NCCL needs batch_isend_irecv (groups)
        self.on_cuda = ctx.device.type == "cuda"
        self.recv_buffers: dict[int, torch.Tensor] = {}  # step index -> reused buffer (not KV)
        for index in self.recv_order:
            step = self.steps[index]
            if step.payload != "kv":
                numel = message_numel(self.dims, step.payload, step.chunk, 0)
                self.recv_buffers[index] = torch.empty(
                    numel, dtype=self.dims.dtype(step.payload), device=ctx.device)
        self.owned = {b.untyped_storage().data_ptr() for b in self.recv_buffers.values()}
        self.peaks: dict[tuple, int] = {}  # input signature -> CPU memory peak of a run

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
        state = _RunState(self, q, kv, resident)
        key = None
        if not self.on_cuda and memory is not True:
            key = (tuple(q.shape), tuple(kv.shape),
                   sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                        for t in resident}.values()))
        cached = None if memory else self.peaks.get(key)
        sample = not self.on_cuda and cached is None and memory is not False
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


def _handler(step: Step):
    """The ``_RunState`` method that runs ``step``, as ``fn(state, index, step)``."""
    if isinstance(step, Compute):
        return lambda state, _index, s: state.compute(s)
    if isinstance(step, Send):
        return _RunState.send
    if isinstance(step, Recv):
        return _RunState.recv
    if isinstance(step, Merge):
        return lambda state, _index, s: state.merge_step(s)
    if isinstance(step, Collective):
        return lambda state, _index, s: state.collective(s)
    return _RunState.execute  # anything else: the general dispatch (and its error)


class _RunState:
    """The buffers and in-flight messages of one execution."""

    def __init__(self, ex: Executor, q: torch.Tensor, kv: torch.Tensor, resident: list) -> None:
        self.ex, self.q, self.own_kv = ex, q, kv
        dev = ex.ctx.device
        self.bufs: dict[str, torch.Tensor | None] = {
            "partial": identity_partial(ex.dims, dev),
            "kv": kv,  # (2, B, Hkv, T, D), the own shard until a KV Recv replaces it
            "max": None,
            "num": None,
            "den": None,
            "residue": None,  # a second running partial (butterfly, p not a power of two)
            "numden": None,  # num and den packed like a partial (allreduce2)
        }
        if ex.passq:  # the own query block and the identity outbox (runtime/passq.py)
            self.bufs.update(passq.initial_buffers(q, ex.ctx.rank, ex.dims))
        self.passq_steps = 0  # attention_qblock steps run (they give the block's origin)
        self.kept: dict[int, tuple[str, tuple]] = {}  # collective tag -> (payload, kept)
        self.block: torch.Tensor | None = None  # packed block partial of attention_block
        self.pending: dict[int, list[tuple[Recv, torch.Tensor]]] = {}  # tag -> received
        self.posted: dict[int, tuple[object, torch.Tensor]] = {}  # step index -> (work, buf)
        self.next_recv = 0  # position in ex.recv_order of the next receive to post
        self.sends: list[tuple[object, torch.Tensor, int]] = []  # (work, tensor, dst)
        self.stats = RunStats()
        self.memory = TensorMemory(resident + ex.kv_pool.buffers)

    # -- receives and sends ----------------------------------------------------------------
    def _recv_buffer(self, index: int, step: Recv) -> torch.Tensor:
        if step.payload == "kv":
            kv_len = self.ex.kv_lengths.get((self.ex.ctx.rank, index), 0)
            numel = message_numel(self.ex.dims, step.payload, step.chunk, kv_len)
            self._finish_pooled_sends()
            return self.ex.kv_pool.take(numel, self._kv_in_use())
        # Reused by every run: each receive has its own, and the previous run's messages
        # are dead (its sends were waited for, its result cloned off a reused buffer).
        return self.ex.recv_buffers[index]

    def _finish_pooled_sends(self) -> None:
        """Complete the sends of forwarded KV blocks before posting a new KV receive, so a
        pooled buffer is reused instead of a third one allocated: a ring rank then holds its
        shard plus two blocks (the one it attends, the one arriving), which is what the
        simulator's memory model counts (``sim.engine.peak_memory``). A completed send leaves
        ``self.sends``: gloo must not be waited on twice for one send."""
        pooled = {b.untyped_storage().data_ptr() for b in self.ex.kv_pool.buffers}
        still = []
        for work, tensor, dst in self.sends:
            if tensor.untyped_storage().data_ptr() in pooled:
                wait_work(work, self.ex.ctx, dst, "send of a KV block")
            else:
                still.append((work, tensor, dst))
        self.sends = still

    def _kv_in_use(self) -> set[int]:
        """Storages a new KV receive must not overwrite: the block held, posted, in flight."""
        held = [self.bufs["kv"]] + [buf for _, buf in self.posted.values()]
        held += [t for work, t, _ in self.sends if not work.is_completed()]
        held += [m for queue in self.pending.values() for _, m in queue]
        return {t.untyped_storage().data_ptr() for t in held if t is not None}

    def post_next_recv(self) -> bool:
        """Post the next receive in step order; False when none is left."""
        order = self.ex.recv_order
        if self.next_recv >= len(order):
            return False
        index = order[self.next_recv]
        step = self.ex.steps[index]
        buf = self._recv_buffer(index, step)
        if self.ex.batch_p2p:
            op = dist.P2POp(dist.irecv, buf, step.src, tag=step.tag)
            work = dist.batch_isend_irecv([op])[0]
        else:
            work = dist.irecv(buf, step.src, tag=step.tag)
        self.posted[index] = (work, buf)
        self.next_recv += 1
        return True

    def _payload_flat(self, payload: str) -> torch.Tensor:
        buf = self.bufs[payload]
        if buf is None:
            raise RuntimeFailure(f"rank {self.ex.ctx.rank}: sends {payload!r} before it is set")
        return buf.reshape(-1)  # a view when contiguous; a copy (the snapshot) otherwise

    def send(self, index: int, step: Send) -> None:
        flat = self._payload_flat(step.payload)
        tensor = take_slice(flat, self.ex.dims, step.payload, step.chunk)
        self.stats.bytes_sent += tensor.numel() * tensor.element_size()
        if self.ex.batch_p2p:
            op = dist.P2POp(dist.isend, tensor, step.dst, tag=step.tag)
            work = dist.batch_isend_irecv([op])[0]
        else:
            work = dist.isend(tensor, step.dst, tag=step.tag)
        self.sends.append((work, tensor, step.dst))

    def recv(self, index: int, step: Recv) -> None:
        if index not in self.posted:  # not posted ahead (e.g. right after the start)
            while index not in self.posted:
                if not self.post_next_recv():
                    raise RuntimeFailure(f"rank {self.ex.ctx.rank}: receive {index} was skipped")
        work, msg = self.posted.pop(index)
        wait_work(work, self.ex.ctx, step.src, f"receive of {step.payload!r} tag {step.tag}")
        if step.reduce:
            self.pending.setdefault(step.tag, []).append((step, msg))
        else:
            self._replace(index, step, msg)
        self.post_next_recv()  # after the message is in place, so the pool sees it in use

    def _replace(self, index: int, step: Recv, msg: torch.Tensor) -> None:
        if step.payload == "kv" and step.chunk is None:
            d = self.ex.dims
            t = self.ex.kv_lengths[(self.ex.ctx.rank, index)]
            self.bufs["kv"] = msg.view(2, d.batch, d.n_kv_heads, t, d.head_dim)
            return
        if step.chunk is None:
            self.bufs[step.payload] = msg
            return
        flat = self._payload_flat(step.payload)
        self.bufs[step.payload] = put_slice(flat, self.ex.dims, step.payload, step.chunk, msg)

    def finish_sends(self) -> None:
        for work, _, dst in self.sends:
            wait_work(work, self.ex.ctx, dst, "send")
        self.sends.clear()

    # -- steps -----------------------------------------------------------------------------
    def execute(self, index: int, step: Step) -> None:
        if isinstance(step, Compute):
            self.compute(step)
        elif isinstance(step, Send):
            self.send(index, step)
        elif isinstance(step, Recv):
            self.recv(index, step)
        elif isinstance(step, Merge):
            self.merge_step(step)
        elif isinstance(step, Collective):
            self.collective(step)
        else:
            raise RuntimeFailure(f"unknown step {step!r}")

    def collective(self, step: Collective) -> None:
        ex = self.ex
        if step.payload == "query":
            flat = self.q.reshape(-1)
        else:
            flat = self._payload_flat(step.payload)
        if step.payload == "outbox":
            how, value = passq.run_collective(ex.ctx, ex.groups[step.group], step, flat,
                                              ex.dims)
        else:
            how, value = run_collective(ex.ctx, ex.groups, step, flat, ex.dims)
        self.stats.bytes_sent += sent_bytes(step)
        if how == "keep":
            self.kept[step.tag] = (step.payload, value)
        elif step.payload == "query":
            self.q = value.view_as(self.q)
        else:
            self.bufs[step.payload] = value

    def _attend(self, kv: torch.Tensor) -> torch.Tensor:
        if kv.shape[3] == 0:
            return identity_partial(self.ex.dims, self.ex.ctx.device)
        o, lse = partial_attention(self.q, kv[0], kv[1], scale=self.ex.scale)  # (B,Hq,D),(B,Hq)
        return pack_partial(o, lse)

    def compute(self, step: Compute) -> None:
        bufs = self.bufs
        if step.label == "attention":
            bufs["partial"] = self._attend(self.own_kv)
        elif step.label == "attention_block":
            self.block = self._attend(bufs["kv"])
        elif step.label == "init_max":
            bufs["max"] = unpack_partial(bufs["partial"], self.ex.dims)[1].reshape(-1).clone()
        elif step.label == "rescale":
            o, lse = unpack_partial(bufs["partial"], self.ex.dims)
            num, den = rescale_to_max(o, lse, bufs["max"].view_as(lse))
            bufs["num"], bufs["den"] = num.reshape(-1), den.reshape(-1)
        elif step.label == "finalize":
            self._finalize()
        elif step.label in passq.LABELS:
            self.passq_steps = passq.compute(self, step.label)
        elif step.label == "rescale_packed":
            o, lse = unpack_partial(bufs["partial"], self.ex.dims)
            num, den = rescale_to_max(o, lse, bufs["max"].view_as(lse))
            bufs["numden"] = pack_partial(num, den)  # num then den, packed
        elif step.label == "finalize_packed":
            num, den = unpack_partial(bufs["numden"], self.ex.dims)
            bufs["num"], bufs["den"] = num.reshape(-1), den.reshape(-1)
            self._finalize()
        elif step.label == "finalize_global":  # o = the reduced num, lse = the global lse
            d = self.ex.dims
            bufs["partial"] = pack_partial(bufs["num"].view(d.batch, d.n_heads, d.head_dim),
                                           bufs["max"].view(d.batch, d.n_heads))
        else:
            raise RuntimeFailure(f"unknown compute label {step.label!r}")

    def _finalize(self) -> None:
        d = self.ex.dims
        den = self.bufs["den"].view(d.batch, d.n_heads)  # (B, Hq)
        num = self.bufs["num"].view(d.batch, d.n_heads, d.head_dim)  # (B, Hq, D)
        m = self.bufs["max"].view(d.batch, d.n_heads)  # (B, Hq)
        self.bufs["partial"] = pack_partial(*finalize_sums(num, den, m))

    def merge_step(self, step: Merge) -> None:
        if step.tag in self.kept:  # what a collective kept: fold every piece in
            payload, kept = self.kept.pop(step.tag)
            flat = self._payload_flat(payload)  # folded into the collective's payload
            self.bufs[payload] = (passq.fold_slots(flat, kept, self.ex.dims)
                                  if payload == "outbox" else
                                  fold_kept(flat, payload, step.op, kept, self.ex.dims))
            return
        if step.op == "residue":  # residue <- partial (+) the message, or a copy of partial
            self._set_residue(step.tag)
            return
        if step.tag is None:
            if self.block is None:
                raise RuntimeFailure(f"rank {self.ex.ctx.rank}: merge without a block partial")
            self._merge_partial(self.block)
            self.block = None
            return
        queue = self.pending.get(step.tag)
        if not queue:
            raise RuntimeFailure(f"rank {self.ex.ctx.rank}: merge of tag {step.tag} before recv")
        recv, msg = queue.pop(0)
        if step.op == "partial":
            self._merge_partial(msg, recv.chunk)
            return
        flat = self._payload_flat(recv.payload).clone()
        lo, hi = chunk_bounds(flat.numel(), recv.chunk)
        if step.op == "max":
            flat[lo:hi] = torch.maximum(flat[lo:hi], msg)
        elif step.op == "sum":
            flat[lo:hi] += msg
        else:
            raise RuntimeFailure(f"unknown merge op {step.op!r}")
        self.bufs[recv.payload] = flat

    def _set_residue(self, tag: int | None) -> None:
        mine = self.bufs["partial"]
        if tag is None:
            self.bufs["residue"] = mine.clone()
            return
        queue = self.pending.get(tag)
        if not queue:
            raise RuntimeFailure(f"rank {self.ex.ctx.rank}: merge of tag {tag} before recv")
        _, msg = queue.pop(0)
        dims = self.ex.dims
        merged = merge(unpack_partial(mine, dims), unpack_partial(msg, dims))
        self.bufs["residue"] = pack_partial(*merged)

    def _merge_partial(self, other: torch.Tensor, chunk: tuple[int, int] | None = None) -> None:
        dims, mine = self.ex.dims, self.bufs["partial"]
        if chunk is None:
            a, b = unpack_partial(mine, dims), unpack_partial(other, dims)
            self.bufs["partial"] = pack_partial(*merge(a, b))
            return
        h0, h1 = chunk_bounds(dims.n_heads, chunk)  # this message holds heads h0..h1
        o, lse = unpack_partial(mine, dims)
        theirs = unpack_heads(other, dims, h1 - h0)  # (B, h, D), (B, h)
        merged = pack_partial(*merge((o[:, h0:h1], lse[:, h0:h1]), theirs))
        self.bufs["partial"] = put_slice(mine, dims, "partial", chunk, merged)

    # -- bookkeeping -----------------------------------------------------------------------
    def sync_device(self) -> None:
        if self.ex.ctx.device.type == "cuda":
            torch.cuda.synchronize(self.ex.ctx.device)

    def sample_memory(self) -> None:
        live = [t for t in self.bufs.values() if t is not None]
        live += [m for queue in self.pending.values() for _, m in queue]
        live += [t for _, kept in self.kept.values() for t in kept[-1]]
        live += [buf for _, buf in self.posted.values()]
        live += [t for work, t, _ in self.sends if not work.is_completed()]
        if self.block is not None:
            live.append(self.block)
        self.memory.sample(live)
        self.stats.peak_bytes = self.memory.peak
