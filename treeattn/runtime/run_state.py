"""The state of one execution of a rank's schedule: its buffers, the messages in flight, and
what each step does to them (the semantics of ``treeattn/schedule/ir.py``, in torch).

:class:`~treeattn.runtime.executor.Executor` owns what lives across runs (bound steps,
reused receive buffers, the KV pool, process subgroups) and makes one :class:`RunState` per
run. Split from the executor so each file holds one concept.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from treeattn.kernels import (
    finalize_sums,
    merge,
    merge_packed,
    partial_attention_packed,
    rescale_to_max,
)
from treeattn.runtime import passq
from treeattn.runtime.collectives import fold_kept, run_collective
from treeattn.runtime.errors import RuntimeFailure
from treeattn.runtime.group import wait_work
from treeattn.runtime.wire import (
    chunk_bounds,
    message_numel,
    pack_partial,
    put_slice,
    round_wire,
    take_slice,
    unpack_heads,
    unpack_partial,
)
from treeattn.schedule.ir import (
    Collective,
    Compute,
    Merge,
    Recv,
    Send,
    Step,
    sent_bytes,
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


class KVPool:
    """Receive buffers for KV blocks, kept across steps and reused once nothing holds them.

    A fresh 64 MiB buffer costs ~10x a reused one on CPU (first-touch page faults), and a
    real ring keeps persistent buffers too. Pooled buffers count toward the memory peak.
    """

    def __init__(self, dtype: torch.dtype, device: torch.device, block_numel: int = 0) -> None:
        self.dtype, self.device = dtype, device
        self.block_numel = block_numel  # the largest KV block this rank receives
        self.buffers: list[torch.Tensor] = []

    def take(self, numel: int, in_use: set[int]) -> torch.Tensor:
        if numel == 0:  # an empty block (an empty shard): every empty storage sits at address
            # 0, so pooled empties would all look in use and pile up; one costs nothing anyway
            return torch.empty(0, dtype=self.dtype, device=self.device)
        free = [b for b in self.buffers
                if b.numel() >= numel and b.untyped_storage().data_ptr() not in in_use]
        if free:
            return min(free, key=torch.Tensor.numel)[:numel]
        # Every buffer fits the largest block, so uneven shards (blocks one token apart)
        # reuse buffers instead of piling up new ones.
        buf = torch.empty(max(numel, self.block_numel), dtype=self.dtype, device=self.device)
        self.buffers.append(buf)
        return buf[:numel]


def attend_packed(ex, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """The executor's partial of ``kv`` (2, B, Hkv, T, D), packed: (B·Hq·(D + 1),), o then
    lse, written in place by the C kernel on CPU ranks; the shared identity when T = 0."""
    if kv.shape[3] == 0:
        return ex.identity
    return partial_attention_packed(q, kv[0], kv[1], scale=ex.scale)


def handler_for(step: Step):
    """The ``RunState`` method that runs ``step``, as ``fn(state, index, step)``."""
    if isinstance(step, Compute):
        return lambda state, _index, s: state.compute(s)
    if isinstance(step, Send):
        return RunState.send
    if isinstance(step, Recv):
        return RunState.recv
    if isinstance(step, Merge):
        return lambda state, _index, s: state.merge_step(s)
    if isinstance(step, Collective):
        return lambda state, _index, s: state.collective(s)
    return RunState.execute  # anything else: the general dispatch (and its error)


class RunState:
    """The buffers and in-flight messages of one execution."""

    def __init__(self, ex, q: torch.Tensor, kv: torch.Tensor, resident: list) -> None:
        self.ex, self.q, self.own_kv = ex, q, kv
        self.bufs: dict[str, torch.Tensor | None] = {
            "partial": ex.identity,  # shared by every run: buffers are never written in place
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
        simulator's memory model counts (``sim.memory.peak_memory``). A completed send leaves
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
        work = self.ex.transport.irecv(buf, step.src, step.tag)
        self.posted[index] = (work, buf)
        self.next_recv += 1
        return True

    def _payload_flat(self, payload: str) -> torch.Tensor:
        buf = self.bufs[payload]
        if buf is None:
            raise RuntimeFailure(f"rank {self.ex.ctx.rank}: sends {payload!r} before it is set")
        return buf.reshape(-1)  # a view when contiguous; a copy (the snapshot) otherwise

    def _wire_rounded(self, payload: str, chunk) -> torch.Tensor:
        """The payload's flat buffer with what it is about to move rounded to the wire
        format; the sender keeps the rounded buffer (replicas stay bit-identical)."""
        flat = self._payload_flat(payload)
        rounded = round_wire(flat, self.ex.dims, payload, chunk, self.ex.schedule.partial_dtype)
        if rounded is not flat:
            self.bufs[payload] = rounded
        return rounded

    def send(self, index: int, step: Send) -> None:
        flat = self._wire_rounded(step.payload, step.chunk)
        tensor = take_slice(flat, self.ex.dims, step.payload, step.chunk)
        self.stats.bytes_sent += tensor.numel() * tensor.element_size()
        work = self.ex.transport.isend(tensor, step.dst, step.tag)
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
        ex.transport.progress()  # a collective's wait does not push deferred mailbox sends
        if step.payload == "query":
            flat = self.q.reshape(-1)
        else:
            flat = self._wire_rounded(step.payload, None)
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
        return attend_packed(self.ex, self.q, kv)

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
            self._merge_partial(msg, recv.chunk, recv.src)
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

    def _merge_partial(self, other: torch.Tensor, chunk: tuple[int, int] | None = None,
                       src: int | None = None) -> None:
        """``partial ← partial ⊕ other``. On a bf16 wire, with the sender ``src`` known, the
        lower rank's partial goes first, so two ranks that merge each other's partials (a
        butterfly round) run the same floating-point operations and keep the same bits (the
        merge kernels fuse a multiply-add, so operand order shows in the last bit). An fp32
        wire keeps (mine, theirs), the order the compiled program
        (:mod:`treeattn.testbed.transport.shm_program`) merges in, bit for bit."""
        dims, mine = self.ex.dims, self.bufs["partial"]
        first = (src is None or self.ex.schedule.partial_dtype == "fp32"
                 or self.ex.ctx.rank < src)
        if chunk is None:
            pair = (mine, other) if first else (other, mine)
            self.bufs["partial"] = merge_packed(*pair, dims.batch * dims.n_heads)
            return
        h0, h1 = chunk_bounds(dims.n_heads, chunk)  # this message holds heads h0..h1
        o, lse = unpack_partial(mine, dims)
        ours = (o[:, h0:h1], lse[:, h0:h1])  # (B, h, D), (B, h)
        theirs = unpack_heads(other, dims, h1 - h0)  # (B, h, D), (B, h)
        merged = pack_partial(*(merge(ours, theirs) if first else merge(theirs, ours)))
        self.bufs["partial"] = put_slice(mine, dims, "partial", chunk, merged)

    # -- bookkeeping -----------------------------------------------------------------------
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
