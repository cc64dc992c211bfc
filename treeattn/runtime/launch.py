"""Run one job on every rank: spawn ``N`` local ranks, or join a torchrun group.

A *job* is a picklable callable ``job(ctx) -> result``. :func:`launch` starts ``world``
processes on this machine with the same environment torchrun would give them, watches them,
and returns rank 0's result. If any rank exits with an error or is killed, the launcher kills
the rest of the group at once and raises :class:`RuntimeFailure` naming that rank; a global
deadline guards against anything that still hangs. :func:`run_in_group` is what each rank runs,
and what a torchrun-started ``treeattn run`` calls directly.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import signal
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import wait as wait_sentinels
from pathlib import Path
from typing import Any

from treeattn.runtime.errors import RankLost, RankTimeout, RuntimeFailure
from treeattn.runtime.group import DEFAULT_TIMEOUT_S, RankContext, destroy_group, init_group

MAX_LOCAL_WORLD = 64
FAULT_ENV = "TREEATTN_FAULT_KILL"  # "RANK:SECONDS": that rank SIGKILLs itself (tests only)


@dataclass(frozen=True)
class LaunchOptions:
    """How to start and guard the ranks."""

    timeout_s: float = DEFAULT_TIMEOUT_S  # per wait on a peer
    deadline_s: float = 1800.0  # whole job, as a last resort
    threads: int | None = 1  # torch threads per rank
    device: str = "auto"
    port: int | None = None  # None: pick a free one


def free_port() -> int:
    """A TCP port on the loopback that nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def check_port(port: int) -> None:
    """Raise :class:`RuntimeFailure` if ``port`` is out of range or already in use."""
    if not 1 <= port <= 65535:
        raise RuntimeFailure(f"port {port} is out of range 1..65535")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError as exc:
            raise RuntimeFailure(f"port {port} is in use ({exc.strerror})") from exc


def check_world(world: int) -> None:
    """Raise :class:`RuntimeFailure` unless ``1 <= world <= MAX_LOCAL_WORLD``."""
    if not 1 <= world <= MAX_LOCAL_WORLD:
        raise RuntimeFailure(f"--nproc must be between 1 and {MAX_LOCAL_WORLD}, got {world}")


def _arm_fault(rank: int) -> None:
    """Test hook: if ``TREEATTN_FAULT_KILL=RANK:SECONDS`` names this rank, die by SIGKILL."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    victim, _, delay = spec.partition(":")
    if int(victim) != rank:
        return
    import threading

    def die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    timer = threading.Timer(float(delay or 0), die)
    timer.daemon = True
    timer.start()


def run_in_group(
    job: Callable[[RankContext], Any], options: LaunchOptions
) -> tuple[RankContext, Any]:
    """Join the group from the environment, run ``job`` on this rank, leave the group."""
    ctx = init_group(options.timeout_s, options.threads, options.device)
    _arm_fault(ctx.rank)
    try:
        return ctx, job(ctx)
    finally:
        destroy_group()


def _child(local_rank: int, world: int, port: int, job, options: LaunchOptions, out: str) -> None:
    os.environ.update(
        RANK=str(local_rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
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


def _kind(exc: BaseException) -> str:
    """``lost`` (a peer died or timed out), ``user`` (bad input) or ``bug``."""
    if isinstance(exc, (RankLost, RankTimeout)):
        return "lost"
    from treeattn.errors import user_error_types

    if isinstance(exc, user_error_types()):
        return "user"
    return "bug"


def launch(job: Callable[[RankContext], Any], world: int, options: LaunchOptions | None = None):
    """Spawn ``world`` local ranks that each run ``job(ctx)``; return rank 0's result.

    Raises
    ------
    RuntimeFailure
        Bad world size or port, a rank that failed or died (named), or the deadline passed.
    """
    options = options or LaunchOptions()
    check_world(world)
    if options.port is not None:
        check_port(options.port)
        return _launch_once(job, world, options, options.port)
    for attempt in range(3):  # a free port can be taken before rank 0 binds it: pick another
        try:
            return _launch_once(job, world, options, free_port())
        except RuntimeFailure as exc:
            if attempt == 2 or not _port_taken(exc):
                raise
    raise AssertionError("unreachable")


def _port_taken(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "eaddrinuse" in text or "address already in use" in text


def _launch_once(job, world: int, options: LaunchOptions, port: int):
    spawn = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="treeattn-launch-") as out:
        procs = [
            spawn.Process(target=_child, args=(r, world, port, job, options, out), daemon=True)
            for r in range(world)
        ]
        for proc in procs:
            proc.start()
        try:
            _watch(procs, options.deadline_s, out)
        finally:
            _kill_all(procs)
        result_file = Path(out, "result.pkl")
        if not result_file.exists():
            raise RankLost("rank 0 finished without a result")
        return pickle.loads(result_file.read_bytes())


def _watch(procs: list, deadline_s: float, out: str) -> None:
    """Wait for every rank; on the first failure or at the deadline raise naming the rank."""
    end = time.monotonic() + deadline_s
    alive = {proc.sentinel: rank for rank, proc in enumerate(procs)}
    while alive:
        left = end - time.monotonic()
        if left <= 0:
            ranks = ", ".join(str(r) for r in sorted(alive.values()))
            message = f"deadline of {deadline_s:g}s passed; rank(s) {ranks} still running"
            raise RuntimeFailure(message)
        for sentinel in wait_sentinels(list(alive), timeout=min(left, 1.0)):
            rank = alive.pop(sentinel)
            procs[rank].join()
            if procs[rank].exitcode != 0:
                time.sleep(0.2)  # let peers that noticed first write their reports
                raise _failure(procs, rank, out)


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
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    end = time.monotonic() + 5.0
    for proc in procs:
        proc.join(timeout=max(0.0, end - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5.0)
