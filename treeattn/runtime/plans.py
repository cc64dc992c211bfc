"""From a request to a schedule: the simulator's model of our attention shape, and one step.

The runtime runs the very schedules :func:`treeattn.schedule.algorithms.build_schedule` builds, on
a :class:`~treeattn.schedule.workload.DecodeWorkload` whose model has this run's shape (one layer;
``Hq``, ``Hkv``, ``D`` and dtype from :class:`~treeattn.runtime.wire.AttnDims`). A world of
one rank has nothing to reduce; it runs a one-step ``local`` schedule.

The KV cache's default split along the sequence (:func:`shard_lengths`) lives here too, so the
runtime's checks need nothing of :mod:`treeattn.llm`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from treeattn.runtime.errors import RuntimeFailure
from treeattn.runtime.executor import Executor
from treeattn.runtime.group import RankContext
from treeattn.runtime.native import run_allreduce3_native
from treeattn.runtime.run_state import RunStats
from treeattn.runtime.wire import AttnDims
from treeattn.schedule.algorithms import CLI_CHOICES
from treeattn.schedule.ir import Compute, Schedule
from treeattn.schedule.workload import DecodeWorkload, ModelConfig

ALGORITHMS = CLI_CHOICES
MEMORY_HEADROOM = 0.9  # use at most this share of what the system reports as available
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_name(dtype: torch.dtype) -> str:
    for name, value in DTYPES.items():
        if value == dtype:
            return name
    raise RuntimeFailure(f"unsupported dtype {dtype}")


def attn_model(dims: AttnDims) -> ModelConfig:
    """A one-layer :class:`ModelConfig` with this run's attention shape."""
    dim = dims.n_heads * dims.head_dim
    return ModelConfig(
        name=f"attn-{dims.n_heads}x{dims.n_kv_heads}x{dims.head_dim}",
        n_layers=1,
        n_heads=dims.n_heads,
        n_kv_heads=dims.n_kv_heads,
        head_dim=dims.head_dim,
        dim=dim,
        ffn_dim=4 * dim,
        vocab_size=1,
        dtype=dtype_name(dims.kv_dtype),
    )


def uses_cuda(device: str) -> bool:
    """Whether ranks started with ``--device device`` run on CUDA."""
    return device in ("cuda", "auto") and torch.cuda.is_available()


def available_memory_bytes(cuda: bool = False) -> tuple[int, str]:
    """``(bytes free for new allocations, what they are)``: one GPU's free memory, or RAM.

    RAM is ``MemAvailable`` from ``/proc/meminfo`` (free plus reclaimable cache) on Linux,
    else the physical memory size (psutil is not a dependency).
    """
    if cuda:
        return int(torch.cuda.mem_get_info()[0]), "GPU memory"
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "RAM"
    except OSError:
        pass
    import os

    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "physical RAM"


def format_bytes(n: float) -> str:
    """``1.5 GiB``-style sizes for messages."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"


def check_fits(needed: int, what: str, cuda: bool = False) -> None:
    """Raise RuntimeFailure, before any rank starts, if ``needed`` bytes cannot fit.

    A rank that runs out of memory while allocating dies with a traceback (or the OOM killer's
    SIGKILL); checking the sizes up front gives one line saying how much and how much there is.
    """
    free, where = available_memory_bytes(cuda)
    if needed > free * MEMORY_HEADROOM:
        raise RuntimeFailure(f"{what} needs about {format_bytes(needed)}, but only "
                             f"{format_bytes(free)} of {where} is available")


def shard_lengths(seq_len: int, world: int) -> list[int]:
    """Even contiguous split: the first ``seq_len % world`` ranks get one extra token.

    >>> shard_lengths(10, 4)
    [3, 3, 2, 2]
    """
    if world < 1:
        raise RuntimeFailure(f"world must be at least 1, got {world}")
    if seq_len < world:
        raise RuntimeFailure(f"seq_len {seq_len} is smaller than the world size {world}")
    base, extra = divmod(seq_len, world)
    return [base + (1 if r < extra else 0) for r in range(world)]


def shard_offsets(lengths: list[int]) -> list[int]:
    """Start position of each contiguous shard.

    >>> shard_offsets([3, 3, 2])
    [0, 3, 6]
    """
    offsets, pos = [], 0
    for length in lengths:
        offsets.append(pos)
        pos += length
    return offsets


def workload_for(dims: AttnDims, lengths: list[int]) -> DecodeWorkload:
    """The decode workload of one attention layer with these exact shard lengths."""
    return DecodeWorkload(
        attn_model(dims), sum(lengths), batch=dims.batch, shard_lengths=tuple(lengths),
        partial_dtype=dims.partial_dtype,
    )


def local_topology(world: int, hosts: list[str] | None = None):
    """The uncalibrated local topology (used when no profile is given); ``hosts`` names each
    rank's host (:func:`treeattn.runtime.group.host_name`), default one host for all."""
    from treeattn.topo import Topology

    if hosts is None or len(set(hosts)) == 1:
        return Topology.from_spec(f"local:ranks={world}")
    from treeattn.topo.builders import local_layout

    index = {h: i for i, h in enumerate(dict.fromkeys(hosts))}
    return Topology(local_layout([index[h] for h in hosts]),
                    name=f"local:ranks={world} on {len(index)} hosts")


def build(algorithm: str, topology, workload: DecodeWorkload, models: tuple = (None, None),
          **params) -> Schedule:
    """The schedule of ``algorithm`` (``auto``: the planner's choice) on ``topology``;
    ``models`` is the ``(hardware, backend)`` the planner prices with (calibrated ones)."""
    from treeattn.sim import build_schedule

    if algorithm not in ALGORITHMS:
        raise RuntimeFailure(f"unknown algorithm {algorithm!r} (known: {', '.join(ALGORITHMS)})")
    if algorithm == "auto":
        from treeattn.sim import plan_workload

        # the runtime sends with the process group's collectives and messages: plan on those
        return plan_workload(topology, workload, *models, transports=("nccl",)).schedule
    return build_schedule(algorithm, topology, workload, **params)


def local_schedule(dims: AttnDims, tokens: int) -> Schedule:
    """One rank, nothing to reduce: attention over the whole cache."""
    elem = torch.empty(0, dtype=dims.kv_dtype).element_size()
    nbytes = 2 * dims.batch * dims.n_kv_heads * tokens * dims.head_dim * elem
    return Schedule("local", [[Compute("attention", nbytes)]], {})


def step_runner(
    ctx: RankContext,
    schedule: Schedule,
    lengths: list[int],
    dims: AttnDims,
    q: torch.Tensor,
    kv: torch.Tensor,
    resident: list[torch.Tensor] | None = None,
    native: bool = False,
) -> Callable[[], tuple[tuple[torch.Tensor, torch.Tensor], RunStats]]:
    """A zero-argument function that runs one decode step of ``schedule`` on this rank.

    ``native=True`` runs ``allreduce3`` on the backend's ``all_reduce`` instead.
    """
    if native:
        if schedule.algorithm != "allreduce3":
            raise RuntimeFailure("--native applies to allreduce3 only")
        return lambda: run_allreduce3_native(ctx, q, kv, dims, resident=resident)
    executor = Executor(ctx, schedule, lengths, dims)
    return lambda: executor.run(q, kv, resident)
