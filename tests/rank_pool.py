"""Warm process groups for the tests: ``world`` gloo ranks started once, running job after job.

Each :func:`treeattn.runtime.launch.launch` starts ``world`` fresh Pythons that import torch
(and the test module that defines the job) and join a new group: about 3 s at world 2 and
5 s at world 4 on two busy cores before any work, more than most jobs of the suite take. The
``warm_ranks`` fixture of ``tests/conftest.py`` (on for every test but those marked
``fresh_ranks``) lets ``launch`` do everything it does up to starting the ranks (checking
the world, options and port, hosting a store) and then hands the job to this session's group
of that size instead, which runs it exactly as a launched rank would: ``job(ctx)`` on every
rank with the options' per-wait timeout and the caller's working directory, rank 0's
result returned, a failure raised as the launcher raises it (a rank's bad input as
``RuntimeFailure``, a lost peer as ``RankLost``, a bug as ``RuntimeError`` with the rank's
traceback), and the options' deadline. Ranks keep what they cache per process (a group's
transport, compiled kernels), as the ranks of one ``treeattn run`` do across its points;
what they read from the environment is the caller's: a launch from a changed environment
(a test's ``monkeypatch.setenv``) gets a group started in it.

A launch it could not serve identically starts fresh ranks as before: more than one torch
thread per rank, pinning asked for (``bind="cores"``), a CUDA device, the launcher's fault
hooks in the environment, or a launch while another runs (from a thread). A failure, a
dead rank or a job past its deadline closes the group (the survivors may be stuck in a
collective); the next job starts a fresh one, so a failing test never poisons the next.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing as mp
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import wait

START_DEADLINE_S = 120.0  # every rank imported torch and joined the group
GROUP_TIMEOUT_S = 60.0  # the process group's own timeout (each job's waits use its own)
VOLATILE_ENV = ("PYTEST_CURRENT_TEST",)  # changes every test, read by no rank


def environment() -> dict[str, str]:
    """The environment a group started now would inherit, less what changes every test."""
    return {k: v for k, v in os.environ.items() if k not in VOLATILE_ENV}


def _die_with_parent() -> None:
    """SIGKILL this rank when the test process dies, however it dies (Linux)."""
    if sys.platform == "linux":
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() == 1:
            os._exit(1)


def _serve(rank: int, world: int, port: int, conn, plugin) -> None:
    """One rank: join the group, then run each job received until told to stop.

    ``plugin`` is the launcher's local transport (the CPU test bed's, when the suite plugs it
    in), set up on this rank as the launcher's ranks set it up, without pinning."""
    _die_with_parent()
    from treeattn.runtime.transport import plug_in

    plug_in(plugin)
    if plugin is not None:
        plugin.start_rank(rank, world, 1, "none", plugin.launcher_cpus())
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), TREEATTN_STORE_HOSTED="1")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    from treeattn.runtime.group import destroy_group, init_group
    from treeattn.runtime.launch import _kind  # the launcher's own user/lost/bug rule

    ctx = init_group(GROUP_TIMEOUT_S, threads=1, device="cpu")
    conn.send_bytes(pickle.dumps(("ok", None)))
    while message := conn.recv_bytes():
        try:
            job, timeout_s, cwd = pickle.loads(message)
            os.chdir(cwd)
            result = job(dataclasses.replace(ctx, timeout_s=timeout_s))
            reply = ("ok", result if rank == 0 else None)
        except BaseException as exc:  # noqa: BLE001 - reported to the launcher, which raises
            lines = str(exc).strip().splitlines()
            reply = ("error", (_kind(exc), lines[0] if lines else type(exc).__name__,
                               traceback.format_exc()))
        conn.send_bytes(pickle.dumps(reply))
    destroy_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip teardown, as the launcher's ranks do (gloo's destructors may abort)


class RankPool:
    """``world`` ranks in one gloo group on this machine, each serving jobs over a pipe."""

    def __init__(self, world: int) -> None:
        import torch.distributed as dist

        from treeattn.runtime.transport import plugged_in

        self.world, self.jobs_run, self.environment = world, 0, environment()
        self.plugin = plugged_in()
        self.lock = threading.Lock()
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=GROUP_TIMEOUT_S))
        spawn = mp.get_context("spawn")
        self.conns, self.procs = [], []
        try:
            for rank in range(world):
                ours, theirs = spawn.Pipe()
                proc = spawn.Process(target=_serve, args=(rank, world, self.store.port, theirs,
                                                           self.plugin),
                                     daemon=True, name=f"warm-rank-{rank}")
                proc.start()
                theirs.close()
                self.conns.append(ours)
                self.procs.append(proc)
            self._collect(START_DEADLINE_S)
        except BaseException:
            self.close()
            raise

    @property
    def alive(self) -> bool:
        return bool(self.procs)

    def run(self, job, timeout_s: float, deadline_s: float):
        """Run ``job(ctx)`` on every rank (``ctx.timeout_s = timeout_s``); rank 0's result."""
        data = pickle.dumps((job, timeout_s, os.getcwd()))
        try:
            for conn in self.conns:
                conn.send_bytes(data)
            replies = self._collect(deadline_s)
        except BaseException:
            self.close()
            raise
        self.jobs_run += 1
        return replies[0]

    def _collect(self, deadline_s: float) -> list:
        """Every rank's reply; raise as the launcher would on an error, a death or the
        deadline (the caller then closes the group)."""
        from treeattn.runtime.errors import RankLost, RuntimeFailure

        end = time.monotonic() + deadline_s
        replies: dict[int, object] = {}
        waiting = {conn: rank for rank, conn in enumerate(self.conns)}
        sentinels = {proc.sentinel: rank for rank, proc in enumerate(self.procs)}
        while waiting:
            left = end - time.monotonic()
            if left <= 0:
                ranks = ", ".join(map(str, sorted(waiting.values())))
                raise RuntimeFailure(f"deadline of {deadline_s:g}s passed; rank(s) {ranks} "
                                     "still running")
            for ready in wait([*waiting, *sentinels], timeout=min(left, 1.0)):
                if ready in sentinels:
                    rank = sentinels[ready]
                    if self.conns[rank] in waiting and not self.conns[rank].poll():
                        self.procs[rank].join()
                        code = self.procs[rank].exitcode
                        how = f"killed by {signal.Signals(-code).name}" if code and code < 0 \
                            else f"exit status {code}"
                        raise RankLost(f"rank {rank} died ({how}); the group was stopped")
                    continue
                rank = waiting.pop(ready)
                status, value = pickle.loads(ready.recv_bytes())
                if status == "error":
                    kind, line, trace = value
                    if kind == "bug":
                        raise RuntimeError(f"rank {rank} crashed: {line}\n{trace}")
                    raise RankLost(line) if kind == "lost" else RuntimeFailure(line)
                replies[rank] = value
        return [replies[rank] for rank in range(self.world)]

    def close(self) -> None:
        """Stop every rank (politely, then by force) and forget the group."""
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send_bytes(b"")
        end = time.monotonic() + 5.0
        for proc in self.procs:
            proc.join(timeout=max(0.0, end - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5.0)
        for conn in self.conns:
            conn.close()
        self.conns, self.procs, self.store = [], [], None


_POOLS: dict[int, RankPool] = {}


def can_serve(options) -> bool:
    """Whether a warm group runs a launch with ``options`` as fresh ranks would."""
    import torch

    cpu = options.device == "cpu" or (options.device == "auto" and not torch.cuda.is_available())
    faults = any(name.startswith("TREEATTN_FAULT") for name in os.environ)
    return options.threads == 1 and options.bind != "cores" and cpu and not faults


def launch_once_warm(real_launch_once):
    """A stand-in for the launcher's ``_launch_once`` that runs the job on the warm group of
    its world size (started on first use), or on fresh ranks when it cannot serve it."""

    def launch_once(job, world, options, port, store=None):
        if not can_serve(options):
            return real_launch_once(job, world, options, port, store)
        from treeattn.runtime.transport import plugged_in

        pool = _POOLS.get(world)
        if pool is not None and (pool.environment != environment()
                                 or pool.plugin != plugged_in()):
            pool.close()
        if pool is None or not pool.alive:
            pool = _POOLS[world] = RankPool(world)
        if not pool.lock.acquire(blocking=False):  # a concurrent launch: fresh ranks
            return real_launch_once(job, world, options, port, store)
        try:
            return pool.run(job, options.timeout_s, options.deadline_s)
        finally:
            pool.lock.release()

    return launch_once


def close_pools() -> None:
    """Stop every warm group (the session's end)."""
    while _POOLS:
        _, pool = _POOLS.popitem()
        pool.close()
