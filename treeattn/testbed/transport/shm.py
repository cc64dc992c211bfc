"""Small messages between CPU ranks on one host, through shared memory instead of gloo.

Why: a decode step's messages are partials of a few KiB, and on CPU ranks gloo makes each
one a socket write, a wake-up of gloo's I/O thread in the receiver and a wake-up of the
waiting rank. With as many busy ranks as cores, those threads have to preempt a rank to
run, and each message measured 0.1-0.5 ms where the copy takes a microsecond
(``docs/design.md``, section 6). Serving stacks that run tensor parallelism on CPUs move small
messages through shared memory for the same reason.

How: one shared file in ``/dev/shm`` holds a *mailbox* per (sender, receiver, tag), each a
128-byte header and a :data:`SLOT_BYTES` payload. A header holds two counters on separate
cache lines: messages *written* (only the sender stores it) and messages *read* (only the
receiver stores it). A send waits for ``read == written`` (the slot is free), copies the
payload, then stores ``written + 1``; a receive waits for ``written > read``, copies the
payload out, then stores ``read + 1``. Each counter has one writer, so no lock is needed;
on x86-64 (TSO) stores become visible in program order, so a receiver that sees the new
count sees the payload. Other architectures keep gloo (no fences from Python). A process
reads its own counter back from the segment instead of keeping a copy, so this path and the
C one of :mod:`treeattn.testbed.transport.shm_program` can take turns on a mailbox.

Matching is FIFO per (sender, receiver, tag), as gloo's is. A send whose slot is still
full (the previous message with that tag not yet read) is kept and pushed by any later
wait of this process (:meth:`ShmChannel.progress`), so a rank that moves on to receive
cannot deadlock a peer that waits for it. Waiting spins (only when every rank has a core
of its own: a spinning rank would otherwise hold the core its peer needs to make the
message), then sleeps on the counter it waits for (a futex, :mod:`treeattn.testbed.transport.futex`)
until the peer's store wakes it; every store is followed by that wake. While this rank has
deferred sends to push, or where futexes are unavailable, it naps 50 µs at a time instead.
Every wait has the run's timeout.

Messages over :data:`SLOT_BYTES` or with a tag of :data:`MAX_TAGS` or more go through gloo
(:mod:`treeattn.runtime.transport` decides, from the size, identically on both sides), and
so does everything in groups of more than 8 ranks (:data:`MAX_SEGMENT_BYTES`). A wait on a
gloo message keeps this rank's deferred mailbox sends moving too. Each ordered pair has one
more mailbox, :data:`COLLECTIVE_TAG`, which only :mod:`treeattn.testbed.transport.shm_collectives`
uses, so a collective never takes a point-to-point message still waiting in a tagged one.
``TREEATTN_SHM=0`` turns shared memory off.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import platform
import re
import socket
import time
import uuid
from datetime import timedelta

import numpy as np
import torch

from treeattn.runtime.errors import RuntimeFailure
from treeattn.runtime.group import RankContext, all_gather_objects
from treeattn.testbed.transport import futex
from treeattn.testbed.transport.binding import group_cores

ENV_SWITCH = "TREEATTN_SHM"
SLOT_BYTES = 64 << 10  # a partial of B*Hq*(D+1) fp32 up to 64 KiB (B=1, Hq=128, D=127)
MAX_TAGS = 8  # schedules tag rounds 0..p-2; higher tags take gloo
COLLECTIVE_TAG = MAX_TAGS  # one more mailbox per ordered pair, for the collectives only
HEADER_BYTES = 128  # written at byte 0, nbytes at 8, read at 64: two cache lines
SHM_DIR = "/dev/shm"
# The whole segment is reserved up front (world² · (MAX_TAGS + 1) mailboxes): 36.1 MiB at
# 8 ranks, 45.7 MiB at 9. Larger groups keep gloo rather than take most of a container's
# /dev/shm (64 MiB by default in Docker).
MAX_SEGMENT_BYTES = 37 << 20
_SPIN = 2000  # checks before sleeping (about 0.3 ms of polling on this repository's CPU box)
_NAP_S = 50e-6  # between checks where a futex cannot be used
_SLEEP_S = 0.01  # longest futex sleep before the deadline is checked again
# Segment names carry their creator's pid. A segment is unlinked once every rank has mapped
# it, so one is left only by a run killed in that window (SIGKILL); the next run removes
# those of dead creators that are older than STALE_AFTER_S (a run in another pid namespace
# that reuses the pid would lose only its shared memory: its ranks then fall back to gloo).
_NAME = re.compile(r"treeattn-(\d+)-[0-9a-f]{32}")
STALE_AFTER_S = 60.0


def _box_bytes() -> int:
    return HEADER_BYTES + SLOT_BYTES


def segment_bytes(world: int) -> int:
    """Size of the shared file for ``world`` ranks: one mailbox per ordered pair and tag,
    and the collectives' one per pair."""
    return world * world * (MAX_TAGS + 1) * _box_bytes()


def max_world() -> int:
    """The largest group that gets mailboxes (:data:`MAX_SEGMENT_BYTES`): 8.

    >>> max_world()
    8
    """
    world = 1
    while segment_bytes(world + 1) <= MAX_SEGMENT_BYTES:
        world += 1
    return world


class _Mailbox:
    """One (sender, receiver, tag) slot: numpy views of its counters and its payload."""

    def __init__(self, seg: np.ndarray, offset: int) -> None:
        # [0] messages written, [1] bytes of the last one, [8] messages read
        self.ctrl = seg[offset : offset + HEADER_BYTES].view(np.int64)
        self.written_at = self.ctrl.ctypes.data  # the receiver sleeps on it (futex)
        self.payload = torch.from_numpy(seg[offset + HEADER_BYTES : offset + _box_bytes()])
        self.payload_at = self.payload.data_ptr()


class ShmChannel:
    """This rank's end of every mailbox of the shared segment."""

    def __init__(self, ctx: RankContext, seg: np.ndarray) -> None:
        self.ctx, self.seg = ctx, seg
        self.boxes: dict[tuple[int, int, int], _Mailbox] = {}
        self.deferred: list[_SendWork] = []  # sends whose mailbox was still full
        # Busy-poll only when the ranks (all on this host) do not outnumber its cores.
        self.spin_checks = _SPIN if ctx.world <= group_cores() else 0

    def carries(self, nbytes: int, tag: int) -> bool:
        """Whether a message of ``nbytes`` with ``tag`` goes through shared memory."""
        return nbytes <= SLOT_BYTES and 0 <= tag < MAX_TAGS

    def box(self, src: int, dst: int, tag: int) -> _Mailbox:
        key = (src, dst, tag)
        found = self.boxes.get(key)
        if found is None:
            index = (src * self.ctx.world + dst) * (MAX_TAGS + 1) + tag
            found = self.boxes[key] = _Mailbox(self.seg, index * _box_bytes())
        return found

    def _check_fits(self, tensor: torch.Tensor) -> None:
        # The copies are raw memmoves: a message past the slot would overwrite the next
        # mailbox. Callers decide by size first (carries()); this guards the mechanism.
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes > SLOT_BYTES:
            raise RuntimeFailure(f"rank {self.ctx.rank}: a {nbytes}-byte message does not fit "
                                 f"a {SLOT_BYTES}-byte shared-memory slot")

    def isend(self, tensor: torch.Tensor, dst: int, tag: int) -> _SendWork:
        self._check_fits(tensor)
        work = _SendWork(self, self.box(self.ctx.rank, dst, tag), tensor)
        queued = any(w.box is work.box for w in self.deferred)  # keep FIFO behind it
        if queued or not work.try_push():
            self.deferred.append(work)
        return work

    def irecv(self, buf: torch.Tensor, src: int, tag: int) -> _RecvWork:
        if not buf.is_contiguous():  # a flattened copy would receive the data and drop it
            raise RuntimeFailure(f"rank {self.ctx.rank}: receive buffer must be contiguous")
        self._check_fits(buf)
        return _RecvWork(self, self.box(src, self.ctx.rank, tag), buf)

    def progress(self) -> None:
        """Push the deferred sends whose mailbox has been read meanwhile: in order within a
        mailbox, independently across mailboxes (one full mailbox must not hold up the
        others, whose receiver may be waiting for them)."""
        if not self.deferred:
            return
        blocked: set[_Mailbox] = set()
        still = []
        for work in self.deferred:
            if work.box in blocked or not work.try_push():
                blocked.add(work.box)
                still.append(work)
        self.deferred = still

    def spin(self, done, timeout: timedelta | None, word=None) -> bool:
        """Poll ``done()`` (pushing deferred sends) until it is true or the timeout passes.

        ``word()`` gives ``(address, value)``: the shared counter whose change can make
        ``done()`` true, and the value it held when ``done()`` last failed. After the busy
        phase the wait sleeps on it until it changes. Not while deferred sends are pending:
        those wait on other counters, which this sleep would not notice."""
        limit = timeout.total_seconds() if timeout is not None else self.ctx.timeout_s
        deadline = time.perf_counter() + limit
        checks = 0
        while not done():
            self.progress()
            checks += 1
            if checks > self.spin_checks:
                now = time.perf_counter()
                if now > deadline:
                    return False
                if word is not None and futex.AVAILABLE and not self.deferred:
                    address, seen = word()
                    futex.wait(address, seen, min(_SLEEP_S, deadline - now))
                else:
                    time.sleep(_NAP_S)
        return True


class _SendWork:
    """An ``isend`` through a mailbox, with the ``wait``/``is_completed`` of a gloo Work."""

    def __init__(self, channel: ShmChannel, box: _Mailbox, tensor: torch.Tensor) -> None:
        self.channel, self.box = channel, box
        # the snapshot to send, held until pushed (a strided tensor is copied once here)
        self.data = tensor if tensor.is_contiguous() else tensor.contiguous()
        self.nbytes = self.data.numel() * self.data.element_size()
        self.done = False

    def try_push(self) -> bool:
        box = self.box
        written = int(box.ctrl[0])  # only this process stores it: no copy to keep in step
        if self.done or box.ctrl[8] != written:  # the previous message is still unread
            return self.done
        n = self.nbytes  # at most SLOT_BYTES: carries() admitted it
        # A plain memmove, not a torch copy: a decode step sends right after its attention
        # has streamed the KV through the caches, where torch's slice-and-copy measured
        # 51 µs and this 15 µs (warm: 3.7 and 1.0 µs).
        ctypes.memmove(box.payload_at, self.data.data_ptr(), n)
        box.ctrl[1] = n
        box.ctrl[0] = written + 1  # publish last: the payload is visible before the count
        futex.wake(box.written_at)
        self.done = True
        return True

    def is_completed(self) -> bool:
        self.channel.progress()
        return self.done

    def wait(self, timeout: timedelta | None = None) -> bool:
        # naps, not a futex: progress() inside the wait pushes this send once the slot has
        # been read, and a rare full slot is not worth a wake on every read
        return self.channel.spin(lambda: self.done, timeout)


class _RecvWork:
    """An ``irecv`` into ``buf`` from a mailbox, with the Work interface."""

    def __init__(self, channel: ShmChannel, box: _Mailbox, buf: torch.Tensor) -> None:
        self.channel, self.box = channel, box
        self.out = buf  # contiguous (irecv checks), kept alive until the copy
        self.nbytes = buf.numel() * buf.element_size()
        self.done = False

    def try_pull(self) -> bool:
        box = self.box
        read = int(box.ctrl[8])  # only this process stores it
        if self.done or box.ctrl[0] == read:  # nothing new written yet
            return self.done
        n = int(box.ctrl[1])
        if n != self.nbytes:
            raise RuntimeFailure(f"rank {self.channel.ctx.rank}: shared-memory message of {n} "
                                 f"bytes for a {self.nbytes}-byte receive: the ranks "
                                 "disagree on the schedule")
        ctypes.memmove(self.out.data_ptr(), box.payload_at, n)  # as in try_push, not torch
        box.ctrl[8] = read + 1  # hand the slot back after the copy
        self.done = True
        return True

    def is_completed(self) -> bool:
        self.channel.progress()
        return self.try_pull()

    def wait(self, timeout: timedelta | None = None) -> bool:
        return self.channel.spin(self.try_pull, timeout,
                                 lambda: (self.box.written_at, int(self.box.ctrl[8])))


def _eligible(ctx: RankContext) -> bool:
    return (ctx.world >= 2 and ctx.device.type == "cpu" and ctx.backend == "gloo"
            and segment_bytes(ctx.world) <= MAX_SEGMENT_BYTES
            and os.environ.get(ENV_SWITCH, "1").strip() != "0"
            and platform.machine().lower() in ("x86_64", "amd64")
            and os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK))


def _host_id() -> str:
    """This machine, as ranks on it see it: hostname plus boot id (containers share it)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def remove_stale_segments(directory: str = SHM_DIR) -> list[str]:
    """Remove this user's segments whose creating process is gone and that are older than
    :data:`STALE_AFTER_S`; return their names. Anything unlike our names is left alone."""
    removed = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(directory):
            match = _NAME.fullmatch(entry.name)
            if match is None or _alive(int(match.group(1))):
                continue
            with contextlib.suppress(OSError):
                info = entry.stat(follow_symlinks=False)
                if (info.st_uid == os.getuid() and entry.is_file(follow_symlinks=False)
                        and time.time() - info.st_mtime > STALE_AFTER_S):
                    os.unlink(entry.path)
                    removed.append(entry.name)
    return removed


def _create(path: str, nbytes: int) -> None:
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)  # fails cleanly on a full /dev/shm (no SIGBUS later)
    except OSError:
        os.unlink(path)
        raise
    finally:
        os.close(fd)


def open_channel(ctx: RankContext) -> ShmChannel | None:
    """Map one shared segment on every rank, or return None everywhere (collective).

    All ranks must be CPU gloo ranks on one x86-64 host with a writable ``/dev/shm``. Rank 0
    creates the file; once every rank has mapped it, it is unlinked, so nothing is left
    behind however the run ends.
    """
    votes = all_gather_objects(ctx, (_eligible(ctx), _host_id()))
    if not all(ok for ok, _ in votes) or len({host for _, host in votes}) != 1:
        return None
    path, nbytes = None, segment_bytes(ctx.world)
    if ctx.rank == 0:
        remove_stale_segments()
        path = os.path.join(SHM_DIR, f"treeattn-{os.getpid()}-{uuid.uuid4().hex}")
        try:
            _create(path, nbytes)
        except OSError:
            path = None
    try:  # rank 0 unlinks however this ends (a peer lost here, an interrupt)
        path = all_gather_objects(ctx, path)[0]
        if path is None:
            return None
        try:  # a plain ndarray view: memmap's own __getitem__ costs ~0.5 µs per counter read
            seg = np.memmap(path, dtype=np.uint8, mode="r+", shape=(nbytes,)).view(np.ndarray)
        except OSError:
            seg = None
        mapped = all_gather_objects(ctx, seg is not None)
    finally:
        if ctx.rank == 0 and path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
    if not all(mapped):
        return None
    return ShmChannel(ctx, seg)
