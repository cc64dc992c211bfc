"""Run one job on every rank: spawn ``N`` local ranks, or join a torchrun group.

A *job* is a picklable callable ``job(ctx) -> result``. :func:`launch` starts ``world``
processes on this machine with the same environment torchrun would give them, watches them,
and returns rank 0's result. If any rank exits with an error or is killed, the launcher kills
the rest of the group at once and raises :class:`RuntimeFailure` naming that rank; a global
deadline guards against anything that still hangs. :func:`run_in_group` is what each rank runs,
and what a torchrun-started ``treeattn run`` calls directly.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing as mp
import os
import pickle
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import wait as wait_sentinels
from pathlib import Path
from typing import Any

import torch.distributed as dist

from treeattn.errors import TreeattnError
from treeattn.runtime.errors import RankLost, RankTimeout, RuntimeFailure
from treeattn.runtime.group import (
    DEFAULT_TIMEOUT_S,
    STORE_HOSTED_ENV,
    RankContext,
    destroy_group,
    heartbeat_key,
    init_group,
)
from treeattn.runtime.transport import LocalPlugin, plug_in, plugged_in

MAX_LOCAL_WORLD = 64
MIN_TIMEOUT_S = 1.0  # below this a busy machine's scheduling jitter reads as a lost peer
MAX_TIMEOUT_S = 7 * 24 * 3600.0  # a week: past it a wait is a hang (and overflows timedelta)
WATCH_POLL_S = 0.25  # how often the launcher looks at its ranks and their heartbeats


@dataclass(frozen=True)
class LaunchOptions:
    """How to start and guard the ranks."""

    timeout_s: float = DEFAULT_TIMEOUT_S  # per wait on a peer
    deadline_s: float = 1800.0  # whole job, as a last resort
    threads: int | None = 1  # torch threads per rank
    device: str = "auto"
    port: int | None = None  # the store's loopback port; None: pick a free one
    # pin ranks to cores: "auto" (when they outnumber them), "cores", "none"; what a
    # plugged-in local transport does with it (treeattn.runtime.transport.LocalPlugin)
    bind: str = "auto"


def free_port() -> int:
    """A TCP port on the loopback that nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def check_world(world: int) -> None:
    """Raise :class:`RuntimeFailure` unless ``1 <= world <= MAX_LOCAL_WORLD``."""
    if not 1 <= world <= MAX_LOCAL_WORLD:
        raise RuntimeFailure(f"--nproc must be between 1 and {MAX_LOCAL_WORLD}, got {world}")


def check_timeout(timeout_s: float) -> float:
    """Return ``timeout_s`` if it is a sane per-wait timeout, else raise RuntimeFailure.

    NaN, infinity, huge and tiny values would either never fire or fire on every wait.
    """
    if not math.isfinite(timeout_s) or not MIN_TIMEOUT_S <= timeout_s <= MAX_TIMEOUT_S:
        raise RuntimeFailure(
            f"--timeout must be a finite number of seconds >= {MIN_TIMEOUT_S:g}, at most "
            f"{MAX_TIMEOUT_S:g}, got {timeout_s}")
    return float(timeout_s)


def run_in_group(
    job: Callable[[RankContext], Any], options: LaunchOptions
) -> tuple[RankContext, Any]:
    """Join the group from the environment, run ``job`` on this rank, leave the group."""
    ctx = init_group(options.timeout_s, options.threads, options.device)
    try:
        return ctx, job(ctx)
    finally:
        destroy_group()


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this rank when the launcher dies, however it dies.

    Without this a SIGKILLed launcher leaves its ranks spinning until their own deadline.
    """
    if sys.platform != "linux":
        return
    import ctypes

    pr_set_pdeathsig = 1
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    if os.getppid() == 1:  # the launcher died before the request took effect
        os._exit(1)


def _child(local_rank: int, world: int, port: int, job, options: LaunchOptions, out: str,
           cpus: list[int], plugin: LocalPlugin | None) -> None:
    _die_with_parent()
    plug_in(plugin)  # the launcher's local transport, if any, on this rank too
    if plugin is not None:
        plugin.start_rank(local_rank, world, options.threads, options.bind, cpus)
    _quiet_native_stderr(Path(out, f"rank{local_rank}.log"))
    os.environ.update(
        RANK=str(local_rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        **{STORE_HOSTED_ENV: "1"},
    )
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        _, result = run_in_group(job, options)
    except BaseException as exc:  # report, then exit non-zero
        text = str(exc).strip().splitlines()
        line = text[0] if text else type(exc).__name__
        Path(out, f"rank{local_rank}.err").write_text(
            f"{_kind(exc)}\n{line}\n{traceback.format_exc()}"
        )
        os._exit(1)
    if local_rank == 0:
        Path(out, "result.pkl").write_bytes(pickle.dumps(result))
    # Done, and the group is left: skip the interpreter's teardown, where C++ destructors
    # of gloo and the store client have aborted a finished rank (SIGABRT, "terminate called
    # without an active exception") about once in ten 2-rank runs.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _quiet_native_stderr(log: Path) -> None:
    """Send this rank's file descriptor 2 to a log file in the run's folder.

    gloo and NCCL write their own C++ log lines straight to fd 2; left alone they land after
    (or before) the launcher's one-line ``error:``. Our own failures are reported through the
    ``rank*.err`` files instead. ``TREEATTN_RANK_STDERR=inherit`` keeps the terminal.
    """
    if os.environ.get("TREEATTN_RANK_STDERR") == "inherit":
        return
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 2)
    os.close(fd)


def _kind(exc: BaseException) -> str:
    """``lost`` (a peer died or timed out), ``user`` (bad input) or ``bug``."""
    if isinstance(exc, (RankLost, RankTimeout)):
        return "lost"
    if isinstance(exc, TreeattnError):
        return "user"
    return "bug"


def launch(job: Callable[[RankContext], Any], world: int, options: LaunchOptions | None = None):
    """Spawn ``world`` local ranks that each run ``job(ctx)``; return rank 0's result.

    The rendezvous store is hosted here, in the launcher, on a socket bound to the loopback
    interface only: nothing on the network can read it, write keys or forge the heartbeats.
    SIGTERM and SIGINT stop the whole rank group (and remove its temporary folder), and each
    rank asks the kernel to kill it if the launcher dies, even by SIGKILL.

    Raises
    ------
    RuntimeFailure
        Bad world size or port, a rank that failed or died (named), or the deadline passed.
    """
    options = options or LaunchOptions()
    check_world(world)
    if plugged_in() is not None:
        plugged_in().check_launch(world, options.threads, options.bind)
    with _loopback_listener(options.port) as (listener, port):
        store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                              master_listen_fd=listener.fileno(),
                              timeout=timedelta(seconds=options.timeout_s))
        listener.detach()  # the store owns (and closes) the descriptor now
        try:
            with _stop_on_signals():
                return _launch_once(job, world, options, port, store)
        finally:
            del store


@contextlib.contextmanager
def _loopback_listener(port: int | None):
    """A listening TCP socket on 127.0.0.1 (``port``, or a free one) for the store."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        if port is not None and not 1 <= port <= 65535:
            raise RuntimeFailure(f"port {port} is out of range 1..65535")
        try:
            sock.bind(("127.0.0.1", port or 0))
        except OSError as exc:
            raise RuntimeFailure(f"port {port} is in use ({exc.strerror})") from exc
        sock.listen(128)
        yield sock, int(sock.getsockname()[1])
    finally:
        sock.close()


class _Stopped(KeyboardInterrupt):
    """The launcher was asked to stop (SIGTERM); unwinds like Ctrl-C so the ranks are killed."""


@contextlib.contextmanager
def _stop_on_signals():
    """Turn SIGTERM into an exception while the ranks run, so the ``finally`` that kills the
    group and removes its folder runs (the default SIGTERM action would skip it)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise _Stopped(f"stopped by {signal.Signals(signum).name}")

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _launch_once(job, world: int, options: LaunchOptions, port: int, store=None):
    spawn = mp.get_context("spawn")
    plugin = plugged_in()
    cpus = plugin.launcher_cpus() if plugin is not None else []
    with tempfile.TemporaryDirectory(prefix="treeattn-launch-") as out:
        procs = [
            spawn.Process(target=_child, args=(r, world, port, job, options, out, cpus, plugin),
                          daemon=True)
            for r in range(world)
        ]
        try:
            for proc in procs:
                proc.start()
            _watch(procs, options.deadline_s, out, _Watchdog(store, world, options.timeout_s))
        finally:
            _kill_all(procs)
        result_file = Path(out, "result.pkl")
        if not result_file.exists():
            raise RankLost("rank 0 finished without a result")
        return pickle.loads(result_file.read_bytes())


class _Watchdog:
    """The launcher's view of the ranks' heartbeats in the store it hosts.

    A rank whose counter has moved once and then stood still for ``timeout_s`` is hung (or
    stopped): its peers would only notice after their own wait times out, plus the time to
    check who fell silent, so the launcher names it itself, within ``timeout_s`` + a poll.
    Counters are compared on the launcher's own clock, so no clocks need to agree.
    """

    def __init__(self, store, world: int, timeout_s: float) -> None:
        self.store, self.world, self.timeout_s = store, world, timeout_s
        self.seen: dict[int, tuple[int, float]] = {}  # rank -> (count, when it last moved)

    def hung_rank(self, alive: set[int]) -> int | None:
        if self.store is None:
            return None
        now = time.monotonic()
        for rank in sorted(alive):
            try:
                count = int(self.store.add(heartbeat_key(rank), 0))
            except Exception:  # the store is ours; if it fails, the ranks report it
                return None
            if count == 0:  # not beating yet: the rendezvous timeout covers start-up
                continue
            last = self.seen.get(rank)
            if last is None or last[0] != count:
                self.seen[rank] = (count, now)
            elif now - last[1] > self.timeout_s:
                return rank
        return None


def _watch(procs: list, deadline_s: float, out: str, watchdog: _Watchdog | None = None) -> None:
    """Wait for every rank; on the first failure, hang or the deadline raise naming the rank."""
    end = time.monotonic() + deadline_s
    alive = {proc.sentinel: rank for rank, proc in enumerate(procs)}
    while alive:
        left = end - time.monotonic()
        if left <= 0:
            ranks = ", ".join(str(r) for r in sorted(alive.values()))
            message = f"deadline of {deadline_s:g}s passed; rank(s) {ranks} still running"
            raise RuntimeFailure(message)
        for sentinel in wait_sentinels(list(alive), timeout=min(left, WATCH_POLL_S)):
            rank = alive.pop(sentinel)
            procs[rank].join()
            if procs[rank].exitcode != 0:
                time.sleep(0.2)  # let peers that noticed first write their reports
                raise _failure(procs, rank, out)
        hung = watchdog.hung_rank(set(alive.values())) if watchdog else None
        if hung is not None:
            raise RankTimeout(
                f"rank {hung} stopped answering for {watchdog.timeout_s:g}s (hung or stopped); "
                "the group was stopped")


def _failure(procs: list, first: int, out: str) -> Exception:
    """Name the rank that failed: a killed rank first, then one that reported an error."""
    for rank, proc in enumerate(procs):
        code = proc.exitcode
        if code is not None and code < 0:
            name = signal.Signals(-code).name if -code in signal.valid_signals() else str(-code)
            return RankLost(f"rank {rank} died (killed by {name}); the group was stopped")
    err = Path(out, f"rank{first}.err")
    if err.exists():
        kind, line = (err.read_text().splitlines() + ["", ""])[:2]
        if kind == "bug":  # a bug, not bad input: keep the rank's traceback visible
            return RuntimeError(f"rank {first} crashed: {line}\n{err.read_text()}")
        return RankLost(line) if kind == "lost" else RuntimeFailure(line)
    return RankLost(f"rank {first} exited with status {procs[first].exitcode}")


def _kill_all(procs: list) -> None:
    """Terminate every rank still running, then kill the stubborn ones."""
    procs = [p for p in procs if p.pid is not None]  # a failed start() leaves later ranks unborn
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
            with contextlib.suppress(OSError):  # a stopped rank acts on SIGTERM once resumed
                os.kill(proc.pid, signal.SIGCONT)
    end = time.monotonic() + 5.0
    for proc in procs:
        proc.join(timeout=max(0.0, end - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5.0)
