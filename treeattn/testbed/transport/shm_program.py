"""A rank's reduction of partials, run in one C call over the shared-memory mailboxes.

Why: on CPU ranks the attention kernel streams the shard through the caches, and every
Python step after it runs cold. For SmolLM2 at 32k on 2 ranks, the tree's send, wait, merge
and step dispatch cost about 275 µs per layer next to a 2.4 ms kernel, for 2.3 KiB of data,
and that capped generation at 1.7x one process. ``native/shm_program.c`` runs the same steps
(send the running partial, wait for a peer's and merge it, or take a broadcast one) in one
call, on the same mailboxes and protocol as :mod:`treeattn.testbed.transport.shm`, with the merge
reading the peer's partial straight from its mailbox.

Which schedules: :func:`compile_program` takes a rank's steps when they are a plain
reduction of partials (:func:`treeattn.testbed.host.partial_reduction.reduction_ops`, the rule the
simulator prices by: the attention, then whole-partial sends, receives, and merges right after
the receive they merge; tree and all-gather at every world size, butterfly at powers of two)
and every message fits a mailbox. Anything else (KV blocks, chunks, collectives, messages over
a slot) returns None and the executor keeps its Python steps, as it does with
``TREEATTN_SHM_PROGRAM=0``. The executor also keeps them for a run that walks memory
(:meth:`Executor.run`'s first run of a shape), so both paths run in every executor's life,
and for any run that starts with mailbox sends still deferred by an earlier Python run.

The timeline keeps the schedule's step indices: a fused receive-and-merge reports the
receive up to the message's arrival and the merge from there, timed by the C code with the
clock Python's ``perf_counter`` reads (``CLOCK_MONOTONIC``).

The attention itself runs inside the same call where the C kernel takes the shard, so the
first step after the kernel starts without a trip through Python (measured: 56–71 µs per
layer between the kernel's end and the program's start when they were two calls).

Built like the kernels (:func:`treeattn.testbed.kernels.cpu_native.build`), from this file's C and
the kernels' own decode kernel and merge, so the values are the Python path's bit for bit;
where no compiler is present the executor runs its Python steps, and
:func:`unavailable_reason` says why.
"""

from __future__ import annotations

import ctypes
import functools
import os
import subprocess
import time
from pathlib import Path

import numpy as np
import torch

from treeattn.kernels import partial_attention_path
from treeattn.kernels.checks import check_partial_inputs
from treeattn.kernels.dispatch import choose_backend
from treeattn.runtime.errors import RankTimeout, RuntimeFailure
from treeattn.runtime.group import silent_ranks_text
from treeattn.runtime.wire import message_numel
from treeattn.testbed.host.partial_reduction import RECV_MERGE, SEND, reduction_ops
from treeattn.testbed.kernels import cpu_native
from treeattn.testbed.transport.shm import SLOT_BYTES

SOURCES = (Path(__file__).with_name("native") / "shm_program.c", *cpu_native.SOURCES)
ABI_VERSION = 5
OP_SEND, OP_RECV_MERGE, OP_RECV_REPLACE = 0, 1, 2  # the C file's op kinds
OK, TIMED_OUT, WRONG_SIZE = 0, 1, 2  # its return codes (anything else: a bad program)
SPIN_S = 0.3e-3  # busy-wait before sleeping, as the Python channel's 2000 checks do
ENV_SWITCH = "TREEATTN_SHM_PROGRAM"  # "0": keep the Python steps (for A/B measurements)


@functools.lru_cache(maxsize=1)
def _load() -> tuple[ctypes.CDLL | None, str]:
    try:
        lib = ctypes.CDLL(str(cpu_native.build_cached(SOURCES, "treeattn-shm-program")))
        if lib.treeattn_shm_program_abi() != ABI_VERSION:
            return None, "the shared-memory program library has another ABI version"
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"the shared-memory program library is unavailable: {exc}"
    fn = lib.treeattn_shm_program
    fn.restype = ctypes.c_int
    # fixed per program: ops, n_ops, scratch, rows, d, spin_s, stamps, failed, bounds
    # (segment start, end, slot bytes, scratch partials); per call: attention (kernel
    # arguments or NULL), scale, running, out, timeout_s
    fn.argtypes = ([ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p] + [ctypes.c_int64] * 2
                   + [ctypes.c_double] + [ctypes.c_void_p] * 4 + [ctypes.c_float]
                   + [ctypes.c_void_p] * 2 + [ctypes.c_double])
    return lib, ""


def unavailable_reason() -> str:
    """Why no program can run here, or ``""`` when the library is loaded."""
    return _load()[1]


class ShmProgram:
    """One rank's schedule as C ops over fixed mailboxes, the attention included."""

    def __init__(self, channel, ops: list[tuple[int, object, int, int]], names: list[str],
                 rows: int, head_dim: int) -> None:
        """``ops``: (kind, mailbox, first step index, peer) per op; ``names``: the steps'
        names; ``rows`` = B·Hq."""
        self.rows, self.head_dim = rows, head_dim
        self.numel = rows * (head_dim + 1)  # one packed partial
        nbytes = self.numel * 4
        n = len(ops)
        self.table = np.array([(kind, box.ctrl.ctypes.data, box.payload_at, nbytes)
                               for kind, box, _, _ in ops], dtype=np.int64)  # (n, 4)
        self.peers = [peer for _, _, _, peer in ops]
        sends = sum(kind == OP_SEND for kind, _, _, _ in ops)
        self.bytes_sent = nbytes * sends
        receives = n - sends
        self.running = torch.empty(self.numel, dtype=torch.float32)  # the attention's partial
        # a partial per receive
        self.scratch = torch.empty(max(1, receives) * self.numel, dtype=torch.float32)
        self.plans: dict[tuple, tuple | bool] = {}  # input signature -> _kernel_plan
        # attention start, end; each op's start, end; each receive's arrival (the C file's)
        self.stamps = np.zeros(2 + 3 * n)
        self.failed = ctypes.c_int64(0)
        seg = channel.seg  # the C code refuses any op outside it (and past a slot)
        self.bounds = np.array([seg.ctypes.data, seg.ctypes.data + seg.nbytes, SLOT_BYTES,
                                max(1, receives)], dtype=np.int64)
        spin_s = SPIN_S if channel.spin_checks > 0 else 0.0
        # The arguments that never change, as plain ints made once: a decode step calls
        # this per layer with cold caches, where every attribute lookup costs.
        self.call = _load()[0].treeattn_shm_program
        self.fixed = (self.table.ctypes.data, n, self.scratch.data_ptr(), rows, head_dim, spin_s,
                      self.stamps.ctypes.data, ctypes.addressof(self.failed),
                      self.bounds.ctypes.data)
        # The timeline's rows as (step index, name, start stamp, end stamp), made once.
        self.template = [(0, names[0], 0, 1)]
        for k, (kind, _, index, _) in enumerate(ops):
            begin, finish, arrival = 2 + 2 * k, 3 + 2 * k, 2 + 2 * n + k
            if kind == OP_RECV_MERGE:
                self.template += [(index, names[index], begin, arrival),
                                  (index + 1, names[index + 1], arrival, finish)]
            else:
                self.template.append((index, names[index], begin, finish))

    def run(self, q: torch.Tensor, kv: torch.Tensor, scale: float, attend, rank: int,
            timeout_s: float) -> torch.Tensor:
        """This rank's attention over ``kv`` (2, B, Hkv, T, D) and its ops; returns the final
        packed partial as a new tensor. The C kernel runs inside the call where it takes the
        shard (as :func:`treeattn.kernels.partial_attention_packed` would choose it);
        otherwise ``attend()`` computes the partial first."""
        attention, running, python_span = 0, self.running, None
        key = (q.shape, q.stride(), q.dtype, kv.shape, kv.stride(), kv.dtype,
               torch.get_num_threads())
        plan = self.plans.get(key)
        if plan is None:
            plan = self.plans[key] = self._kernel_plan(q, kv, scale)
        if plan:
            scale, fp32_query, v_offset, args = plan
            q32 = q if fp32_query else q.to(torch.float32).contiguous()  # alive past the call
            args[0], args[1], args[2] = q32.data_ptr(), kv.data_ptr(), kv.data_ptr() + v_offset
            # what this call's buffer holds from k and from v, for the kernel's own check
            args[15] = cpu_native.elements_after(kv)
            args[16] = args[15] - v_offset // kv.element_size()
            attention = args.ctypes.data
        else:
            begin = time.perf_counter()
            running = attend()  # (B·Hq·(D+1),) fp32
            python_span = (begin, time.perf_counter())
            if (running.numel() != self.numel or running.dtype != torch.float32
                    or not running.is_contiguous()):  # the C code reads numel floats
                raise RuntimeFailure(f"rank {rank}: a partial of {running.numel()} "
                                     f"{running.dtype} values for a program of {self.numel}")
        out = torch.empty(self.numel, dtype=torch.float32)  # (B·Hq·(D+1),)
        status = self.call(*self.fixed, attention, scale, running.data_ptr(), out.data_ptr(),
                           timeout_s)
        if python_span is not None:
            self.stamps[:2] = python_span
        if status != OK:
            raise self._failure(status, rank, timeout_s)
        return out

    def _kernel_plan(self, q: torch.Tensor, kv: torch.Tensor, scale: float):
        """For inputs of this shape, layout and dtype: ``(scale, whether q is already fp32
        and contiguous, v's byte offset from k, the kernel's arguments)`` where the C kernel
        takes them, else False. The arguments (an int64 array: q's address, then
        :func:`~treeattn.testbed.kernels.cpu_native.decode_arguments`) get their three addresses
        filled per call.

        Checked once per signature, not per call: the checks and the path choice are a dozen
        Python calls, which a decode step makes with cold caches (83 µs per layer measured,
        SmolLM2 at 32k)."""
        k, v = kv[0], kv[1]
        if kv.shape[3] == 0:
            return False  # the empty shard's partial is the executor's shared identity
        scale = check_partial_inputs(q, k, v, scale, None)  # errors as the Python path's
        if q.shape[0] * q.shape[1] != self.rows or q.shape[2] != self.head_dim:
            # the kernel writes q's rows into a buffer sized by the schedule's dims
            raise RuntimeFailure(f"query of shape {tuple(q.shape)} for a schedule of "
                                 f"{self.rows} rows of {self.head_dim}")
        if partial_attention_path(q, k, v, None) != "native":
            return False
        q32, args = cpu_native.decode_arguments(q, k, v)
        return (scale, q32 is q, v.data_ptr() - k.data_ptr(),
                np.array([0, *args], dtype=np.int64))

    def timeline(self, rank: int) -> list[tuple[int, int, str, float, float]]:
        """The last run's timeline in the executor's form (times from its attention's
        start), steps in schedule order."""
        s = self.stamps.tolist()
        t0 = s[0]
        return [(rank, index, name, s[a] - t0, s[b] - t0) for index, name, a, b in self.template]

    def _failure(self, status: int, rank: int, timeout_s: float) -> RuntimeFailure:
        op = self.failed.value
        if op >= len(self.peers):
            return RankTimeout(f"rank {rank}: timed out after {timeout_s:g}s pushing its sends "
                               f"of 'partial'{silent_ranks_text()}")
        if op < 0:
            return RuntimeFailure(f"rank {rank}: the C attention kernel refused the shard's "
                                  f"shape (status {status})")
        peer = self.peers[op]
        if status == TIMED_OUT:
            return RankTimeout(f"rank {rank}: timed out after {timeout_s:g}s waiting for rank "
                               f"{peer} (receive of 'partial'){silent_ranks_text()}")
        if status == WRONG_SIZE:
            return RuntimeFailure(f"rank {rank}: shared-memory message from rank {peer} has "
                                  "the wrong size: the ranks disagree on the schedule")
        return RuntimeFailure(f"rank {rank}: the shared-memory program refused op {op} "
                              f"(status {status})")


def compile_program(steps, names: list[str], rank: int, channel, dims) -> ShmProgram | None:
    """The program for ``steps`` (a rank's schedule), or None where it does not apply or the
    library is unavailable (module docstring). Which steps qualify is
    :func:`treeattn.testbed.host.partial_reduction.reduction_ops`, the rule the simulator prices
    by."""
    if channel is None or dims.dtype("partial") != torch.float32:
        return None
    if choose_backend(torch.device("cpu")) != "native":
        return None  # merge_packed would not take the C merge: results would differ
    if os.environ.get(ENV_SWITCH, "1").strip() == "0":
        return None
    ops = reduction_ops(steps)
    nbytes = message_numel(dims, "partial", None, 0) * 4
    if ops is None or not all(channel.carries(nbytes, tag) for _, _, _, tag, _ in ops):
        return None
    if _load()[0] is None:
        return None
    mailboxes = []
    for kind, index, peer, tag, _ in ops:
        if kind == SEND:
            mailboxes.append((OP_SEND, channel.box(rank, peer, tag), index, peer))
        else:
            mailboxes.append((OP_RECV_MERGE if kind == RECV_MERGE else OP_RECV_REPLACE,
                              channel.box(peer, rank, tag), index, peer))
    return ShmProgram(channel, mailboxes, names, dims.batch * dims.n_heads, dims.head_dim)
