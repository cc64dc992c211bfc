"""Run several schedules on one process group and return every rank's output.

This is the distributed half of the correctness pattern *global reference → shard →
compare*: the caller holds the global ``q``, ``K`` and ``V`` and the single-process
reference; each rank takes its contiguous shard, runs every case, and rank 0 returns all
ranks' partials so the caller can compare each with the reference.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from treeattn.llm.cache import ShardedKVCache
from treeattn.runtime.group import RankContext, all_gather_objects
from treeattn.runtime.plans import (
    build,
    local_topology,
    shard_offsets,
    step_runner,
    workload_for,
)
from treeattn.runtime.wire import AttnDims


@dataclass(frozen=True)
class Case:
    """One schedule to run: the algorithm, its generator parameters, native all-reduce, and
    how its partials travel (``None``: the algorithm's own format)."""

    algorithm: str
    params: dict = field(default_factory=dict, hash=False)
    native: bool = False
    partial_dtype: str | None = None

    @property
    def label(self) -> str:
        extra = ",".join(f"{k}={v}" for k, v in sorted(self.params.items()))
        return (f"{self.algorithm}[{extra}]" + ("+native" if self.native else "")
                + (f"@{self.partial_dtype}" if self.partial_dtype else ""))


@dataclass(frozen=True)
class CasesJob:
    """A picklable job for :func:`treeattn.runtime.launch.launch`."""

    q: torch.Tensor  # (B, Hq, D)
    k: torch.Tensor  # (B, Hkv, T, D) the global keys
    v: torch.Tensor  # (B, Hkv, T, D)
    lengths: tuple[int, ...]
    cases: tuple[Case, ...]

    def __call__(self, ctx: RankContext):
        return run_cases(ctx, self.q, self.k, self.v, list(self.lengths), list(self.cases))


def run_cases(ctx, q, k, v, lengths, cases) -> dict | None:
    """Shard the global KV by ``lengths``, run every case; rank 0 gets {label: [(o, lse)]}."""
    b, hkv, _, d = k.shape
    dims = AttnDims(b, q.shape[1], hkv, d, k.dtype)
    cache = ShardedKVCache(ctx.rank, lengths, 1, b, hkv, d, k.dtype, ctx.device)
    start = shard_offsets(lengths)[ctx.rank]
    n = lengths[ctx.rank]
    own = slice(start, start + n)
    cache.fill(0, k[:, :, own].to(ctx.device), v[:, :, own].to(ctx.device))
    q = q.to(ctx.device)
    topology, workload = local_topology(ctx.world), workload_for(dims, lengths)
    mine = {}
    for case in cases:
        wire = replace(workload, partial_dtype=case.partial_dtype)
        schedule = build(case.algorithm, topology, wire, **case.params)
        kv = cache.kv(0)  # (2, B, Hkv, n, D)
        run = step_runner(ctx, schedule, lengths, dims, q, kv, cache.tensors(), case.native)
        (o, lse), stats = run()
        mine[case.label] = (o.cpu(), lse.cpu(), stats.bytes_sent)
    everyone = all_gather_objects(ctx, mine)
    if ctx.rank != 0:
        return None
    return {label: [rank_out[label] for rank_out in everyone] for label in mine}
