"""Process groups: join one from the torchrun environment, and wait on peers with timeouts.

Both ways of starting a run end here. ``torchrun`` (one or many nodes) and the local launcher
(:mod:`treeattn.runtime.launch`) set the same variables: ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``. The backend is gloo on CPU and NCCL on
CUDA. Every wait carries a timeout, and a failed or timed-out wait raises
:class:`~treeattn.runtime.errors.RuntimeFailure` naming this rank and the peer it waited on.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from treeattn.runtime.errors import RankLost, RankTimeout, RuntimeFailure

ENV_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# Set by the local launcher, which hosts the rendezvous store itself on the loopback: every
# rank, rank 0 included, joins it as a client. Under torchrun, rank 0 (or torchrun's agent)
# hosts the store on MASTER_ADDR:MASTER_PORT, reachable from the cluster's network.
STORE_HOSTED_ENV = "TREEATTN_STORE_HOSTED"
DEFAULT_TIMEOUT_S = 30.0
HEARTBEAT_S = 0.5
# The host a rank says it is on, where it is not its machine's name: CPU ranks of one
# machine laid out as several hosts (a test, a rehearsal of a multi-host layout).
HOST_ENV = "TREEATTN_HOST"


def host_name() -> str:
    """The host this rank runs on: ``$TREEATTN_HOST`` if set, else the machine's name."""
    return os.environ.get(HOST_ENV) or socket.gethostname()


@dataclass(frozen=True)
class RankContext:
    """Who this process is in the group, and how it talks to the others."""

    rank: int
    world: int
    local_rank: int
    device: torch.device
    backend: str
    timeout_s: float = DEFAULT_TIMEOUT_S
    # A process subgroup (one context-parallel group of several), held weakly
    # (:func:`held_weakly`, see :attr:`group`): ``rank`` and ``world`` are then within it,
    # and ``ranks`` gives each member's global rank, which torch.distributed addresses peers
    # by. None: the default group, where the two coincide.
    group_ref: Callable[[], object] | None = None
    ranks: tuple[int, ...] | None = None

    @property
    def group(self):
        """The process subgroup (None: the default group). A context never keeps it alive:
        a group torch has destroyed but an object still holds is destroyed only at
        interpreter exit, where gloo's threads can abort the process. RuntimeFailure once
        it is gone (never the default group in its place)."""
        if self.group_ref is None:
            return None
        group = self.group_ref()
        if group is None:
            raise RuntimeFailure(f"rank {self.rank}: its process group has been destroyed "
                                 "(dist.destroy_process_group)")
        return group

    @property
    def timeout(self) -> timedelta:
        return timedelta(seconds=self.timeout_s)

    def global_rank(self, rank: int) -> int:
        """The global rank of member ``rank`` of this context's group."""
        return rank if self.ranks is None else self.ranks[rank]


def in_torchrun_env() -> bool:
    """Whether this process was started by torchrun (or our launcher) as one rank of a group."""
    return all(name in os.environ for name in ENV_VARS)


def _env_int(name: str) -> int:
    try:
        return int(os.environ[name])
    except (KeyError, ValueError) as exc:
        raise RuntimeFailure(f"environment variable {name} is missing or not an integer") from exc


def init_group(
    timeout_s: float = DEFAULT_TIMEOUT_S, threads: int | None = 1, device: str = "auto"
) -> RankContext:
    """Join the process group described by the torchrun environment variables.

    Parameters
    ----------
    timeout_s
        Timeout for rendezvous, collectives and every point-to-point wait.
    threads
        ``torch.set_num_threads`` for this rank (``None`` leaves torch's default).
    device
        ``"auto"`` (CUDA if available), ``"cpu"`` or ``"cuda"``.
    """
    rank, world = _env_int("RANK"), _env_int("WORLD_SIZE")
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeFailure("--device cuda was asked for, but CUDA is not available")
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if threads is not None:
        torch.set_num_threads(max(1, threads))
    if use_cuda:
        os.environ.setdefault("TORCH_NCCL_BLOCKING_WAIT", "1")  # wait(timeout) blocks the host
        torch.cuda.set_device(local_rank)
        # NCCL for the CUDA tensors of the schedule; gloo beside it for the few CPU tensors of
        # the control path (step counts, flags, objects), which NCCL alone refuses
        dev, backend = torch.device("cuda", local_rank), "cpu:gloo,cuda:nccl"
    else:
        dev, backend = torch.device("cpu"), "gloo"
    ctx = RankContext(rank, world, local_rank, dev, backend, float(timeout_s))
    if not dist.is_initialized():
        try:
            if os.environ.get(STORE_HOSTED_ENV) == "1":
                store = dist.TCPStore(os.environ["MASTER_ADDR"], _env_int("MASTER_PORT"),
                                      is_master=False, timeout=ctx.timeout)
                dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                        timeout=ctx.timeout)
            else:
                dist.init_process_group(backend, init_method="env://", rank=rank,
                                        world_size=world, timeout=ctx.timeout)
        except Exception as exc:  # rendezvous failed: say so in one line
            message = f"rank {rank}: cannot join the process group: {_short(exc)}"
            raise RuntimeFailure(message) from exc
    _Heartbeat.start(ctx)
    return ctx


def destroy_group() -> None:
    """Leave the process group if one is active."""
    _Heartbeat.stop()
    if dist.is_initialized():
        dist.destroy_process_group()


def held_weakly(obj):
    """A callable that returns ``obj`` while it lives: a weak reference to a process group
    (so that holding it never keeps a group torch has destroyed alive until interpreter exit,
    where gloo's threads can abort the process), or ``obj`` itself where it cannot be weakly
    referenced (``None`` before a default group exists, a non-member's int marker)."""
    try:
        return weakref.ref(obj)
    except TypeError:
        return lambda: obj


def heartbeat_key(rank: int) -> str:
    """The store key of ``rank``'s heartbeat counter (the launcher watches it too)."""
    return f"treeattn/heartbeat/{rank}"


class _Heartbeat:
    """Each rank bumps a counter in the rendezvous store; a counter that stops names the dead.

    It runs on its own store connection in a daemon thread, so it works while the main thread
    is blocked in a collective, and on every node (the store lives at ``MASTER_ADDR``).
    """

    current: _Heartbeat | None = None

    def __init__(self, ctx: RankContext) -> None:
        self.ctx, self.halt = ctx, threading.Event()
        self.store = dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
            timeout=timedelta(seconds=5),
        )
        self.store.add(self._key(ctx.rank), 1)
        self.thread = threading.Thread(target=self._beat, daemon=True, name="treeattn-heartbeat")
        self.thread.start()

    def _key(self, rank: int) -> str:
        return heartbeat_key(rank)

    def _beat(self) -> None:
        while not self.halt.wait(HEARTBEAT_S):
            try:
                self.store.add(self._key(self.ctx.rank), 1)
            except Exception:  # the store's host (rank 0's node) is gone
                return

    def silent_ranks(self) -> list[int] | None:
        """Ranks whose counter did not move over a few beats; None if the store is gone."""
        try:
            keys = [self._key(r) for r in range(self.ctx.world)]
            before = [self.store.add(k, 0) for k in keys]
            time.sleep(4 * HEARTBEAT_S)
            after = [self.store.add(k, 0) for k in keys]
        except Exception:
            return None
        return [r for r in range(self.ctx.world) if before[r] == after[r] and r != self.ctx.rank]

    @classmethod
    def start(cls, ctx: RankContext) -> None:
        try:
            cls.current = cls(ctx)
        except Exception:  # no heartbeat: failures are still reported, only less precisely
            cls.current = None

    @classmethod
    def stop(cls) -> None:
        """Stop beating and wait for the thread: left running inside a store call while the
        process exits, it can abort the process ("terminate called without an active
        exception"), which the launcher then reports as a dead rank."""
        beat, cls.current = cls.current, None
        if beat is not None:
            beat.halt.set()
            beat.thread.join(timeout=HEARTBEAT_S + 6)  # one beat plus the store's timeout


def silent_ranks_text() -> str:
    """A phrase naming the ranks that stopped beating (or the lost store), or ``""``."""
    beat = _Heartbeat.current
    if beat is None:
        return ""
    silent = beat.silent_ranks()
    if silent is None:
        return "; the rendezvous store (rank 0's node) is unreachable, so rank 0 is down"
    if not silent:
        return ""
    ranks = ", ".join(str(r) for r in silent)
    return f"; rank {ranks} stopped answering (dead)"


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__


def wait_work(work, ctx: RankContext, peer: int | None, what: str) -> None:
    """Wait for a torch.distributed ``Work`` with the context's timeout.

    Raises
    ------
    RankTimeout
        The peer did not answer within the timeout.
    RankLost
        The backend reported a broken connection (the peer died).
    """
    who = f"rank {peer}" if peer is not None else "the group"
    try:
        done = work.wait(ctx.timeout)
    except RuntimeFailure:  # already names the rank and the cause (shared-memory transport)
        raise
    except Exception as exc:
        message = _short(exc)
        if "timed out" in message.lower() or "timeout" in message.lower():
            raise RankTimeout(
                f"rank {ctx.rank}: timed out after {ctx.timeout_s:g}s waiting for {who} "
                f"({what}){silent_ranks_text()}"
            ) from exc
        raise RankLost(
            f"rank {ctx.rank}: lost {who} during {what}{silent_ranks_text()} ({message})"
        ) from exc
    if done is False:  # some backends return False instead of raising
        raise RankTimeout(
            f"rank {ctx.rank}: timed out after {ctx.timeout_s:g}s waiting for {who} "
            f"({what}){silent_ranks_text()}"
        )


def barrier(ctx: RankContext) -> None:
    """A barrier with the context's timeout; on gloo it names the ranks that did not arrive."""
    try:
        if ctx.backend == "gloo":
            dist.monitored_barrier(group=ctx.group, timeout=ctx.timeout, wait_all_ranks=True)
        else:
            wait_work(dist.barrier(group=ctx.group, async_op=True), ctx, None, "barrier")
    except RuntimeFailure:
        raise
    except Exception as exc:
        raise RankLost(
            f"rank {ctx.rank}: barrier failed{silent_ranks_text()} ({_short(exc)})"
        ) from exc


def all_gather_objects(ctx: RankContext, obj) -> list:
    """Gather one picklable object per rank onto every rank (small metadata only)."""
    out: list = [None] * ctx.world
    try:
        dist.all_gather_object(out, obj, group=ctx.group)
    except Exception as exc:
        raise RankLost(
            f"rank {ctx.rank}: all_gather_object failed{silent_ranks_text()} ({_short(exc)})"
        ) from exc
    return out


def broadcast_object(ctx: RankContext, obj, src: int = 0):
    """Broadcast one picklable object from ``src`` to every rank and return it."""
    box = [obj if ctx.rank == src else None]
    try:
        dist.broadcast_object_list(box, src=ctx.global_rank(src), group=ctx.group)
    except Exception as exc:
        raise RankLost(
            f"rank {ctx.rank}: broadcast from rank {src} failed{silent_ranks_text()} "
            f"({_short(exc)})"
        ) from exc
    return box[0]
