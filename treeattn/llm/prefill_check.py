"""Sharded prefill run on a process group, every rank's shard and memory returned to rank 0.

The distributed half of *global reference -> shard -> compare* for prefill: the caller runs
the single-process prefill (:func:`reference_prefill`) and compares every layer's K/V slice
and the first logits with what each rank of :class:`PrefillJob` kept. The job also measures
each rank's peak resident memory during the prefill (``VmHWM`` of ``/proc/self/status``,
reset through ``/proc/self/clear_refs`` just before it; Linux), which
``benchmarks/prefill_memory.py`` reports against the shard size.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from treeattn.llm.formats.weights import load_model
from treeattn.llm.generate_context import fill_document
from treeattn.llm.local_cache import LocalCache, prefill
from treeattn.llm.model import LlamaConfig, random_model
from treeattn.llm.options import dtype_of, place_model
from treeattn.llm.prefill import sharded_prefill
from treeattn.runtime.group import RankContext, all_gather_objects
from treeattn.runtime.prefill.ring import RingStats


def _status_kib(field: str) -> int | None:
    """A ``/proc/self/status`` field in KiB (``VmRSS``, ``VmHWM``); None off Linux."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def reset_peak_rss() -> bool:
    """Reset this process's peak resident set (``VmHWM``) to its current one; Linux only."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


@dataclass(frozen=True)
class PrefillJob:
    """A picklable job for :func:`treeattn.runtime.launch.launch`: sharded prefill of
    ``context_tokens`` of ``segment`` then ``prompt`` with ``model`` (a path or "debug")."""

    model: str
    prompt: tuple[int, ...]
    context_tokens: int = 0
    segment: tuple[int, ...] = ()
    dtype: str = "fp32"
    gather_kv: bool = True  # rank 0 gets every rank's shards (small runs only)
    random_shape: bool = False  # ``model`` names a registered shape: seeded random weights
    replicated: bool = False  # run the whole single-process prefill instead (world 1)
    algorithm: str = "pass-kv"  # treeattn.runtime.prefill.ring.PREFILL_ALGORITHMS

    def __call__(self, ctx: RankContext) -> list[dict] | None:
        model = (random_model(LlamaConfig.from_name(self.model)) if self.random_shape
                 else load_model(self.model).model)
        model = place_model(model, ctx.device, dtype_of(self.dtype))
        for p in model.parameters():  # fault every weight page in before measuring
            float(p.detach().float().sum())
        stats = RingStats()
        rss_before = _status_kib("VmRSS")
        measured = reset_peak_rss()
        t0 = time.perf_counter()
        if self.replicated:  # what every rank did before the sharded prefill
            local, logits = reference_prefill(model, list(self.prompt), self.context_tokens,
                                              self.segment)
            cache = _Whole(local)
        else:
            cache, logits = sharded_prefill(ctx, model, list(self.prompt),
                                            context_tokens=self.context_tokens,
                                            segment=self.segment, stats=stats,
                                            algorithm=self.algorithm)
        seconds = time.perf_counter() - t0
        peak = _status_kib("VmHWM") if measured else None
        mine = {
            "rank": ctx.rank, "lengths": list(cache.lengths), "logits": logits.cpu(),
            "kv": [cache.kv(layer).cpu() for layer in range(cache.n_layers)]
            if self.gather_kv else None,
            "shard_bytes": cache.nbytes(), "bytes_sent": stats.bytes_sent,
            "peak_block_bytes": stats.peak_block_bytes, "prefill_s": seconds,
            "document_s": stats.document_s,
            "rss_before_bytes": None if rss_before is None else rss_before * 1024,
            "peak_rss_bytes": None if peak is None else peak * 1024,
        }
        everyone = all_gather_objects(ctx, mine)
        return everyone if ctx.rank == 0 else None


class _Whole:
    """A :class:`LocalCache` seen as the one shard of a world of one."""

    def __init__(self, local: LocalCache) -> None:
        self.local, self.lengths, self.n_layers = local, [local.length], local.n_layers

    def kv(self, layer: int) -> torch.Tensor:
        n = self.local.length
        return torch.stack([self.local.k[layer][:, :, :n], self.local.v[layer][:, :, :n]])

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.local.k + self.local.v)


@torch.no_grad()
def reference_prefill(model, prompt: list[int], context_tokens: int = 0,
                      segment: list[int] | tuple = ()) -> tuple[LocalCache, torch.Tensor]:
    """Single-process prefill, as :func:`treeattn.llm.generate.generate_local` does it."""
    local = LocalCache(model.config.n_layers, capacity=context_tokens + len(prompt))
    if context_tokens:
        fill_document(local, model, list(segment), context_tokens)
    return local, prefill(model, list(prompt), local, start=context_tokens)


@dataclass(frozen=True)
class CappedGenerate:
    """A picklable job: :func:`~treeattn.llm.generate_dist.rank_generate` with this rank's
    address space capped (``RLIMIT_AS``) at its size once loaded plus ``cap_bytes``.

    The model is loaded and the process group's transport made first, so the cap bounds what
    the prefill and the decode allocate. Linux; rank 0 gets ``rank_generate``'s dict with
    ``cap_bytes`` and every rank's ``peak_rss_bytes`` growth added.
    """

    request: object  # treeattn.llm.generate_dist.GenerateRequest
    cap_bytes: int

    def __call__(self, ctx: RankContext):
        import resource

        from treeattn.llm.generate_dist import rank_generate
        from treeattn.runtime.transport import transport_for

        loaded = load_model(self.request.model)
        transport_for(ctx)  # collective on first use: every rank, here
        size = _status_kib("VmSize")
        if size is None:
            raise RuntimeError("no /proc/self/status here: cannot cap the address space")
        limit = size * 1024 + self.cap_bytes
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
        rss = _status_kib("VmRSS")
        reset_peak_rss()
        result = rank_generate(ctx, self.request, loaded)
        growth = (_status_kib("VmHWM") - rss) * 1024
        everyone = all_gather_objects(ctx, growth)
        if ctx.rank != 0:
            return None
        return {**result, "cap_bytes": self.cap_bytes, "peak_rss_growth_bytes": everyone}
