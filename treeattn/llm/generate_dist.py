"""Distributed greedy generation: the KV cache sharded across ranks, attention by the plan.

Every rank runs the same model (everything but attention is replicated in decode):

* **Prefill** (:func:`treeattn.llm.prefill.sharded_prefill`): context-parallel, the prompt
  never whole on one rank. Each rank runs the model on its zig-zag pair of prompt chunks,
  every layer's attention is a pass-KV ring, and each rank keeps the pieces of the passing
  blocks that fall in its contiguous shard of the
  :class:`~treeattn.llm.cache.ShardedKVCache`. In long-context mode each rank builds only
  its own shard of the repeated document (:mod:`treeattn.llm.generate_context`).
* **Decode**: at every layer, the new token's K/V are first staged into the shard of the
  rank that will keep them (policy ``"last"``: the last rank), then the new query attends
  over the sharded cache through the runtime's
  :class:`~treeattn.runtime.executor.Executor` running the plan's schedule (tree by default;
  every algorithm leaves the merged partial on every rank). The owner's shard is one token
  longer during that step, so the token's own key needs no separate partial and merge.
  After the last layer every rank counts the token in its length table.
* Rank 0 picks each token (greedy, or drawn by its seeded
  :class:`~treeattn.llm.options.Sampler`) and broadcasts it as one int64, so all ranks stay
  on the same sequence even if an algorithm leaves them with partials that differ in the
  last bit. At the end the ranks compare their token lists once (``ranks_agree``).
* **Placement**: each rank moves the weights to its device in the request's dtype once
  (:func:`~treeattn.llm.options.place_model`); the KV cache takes the blocks' dtype.

:func:`generate_distributed` spawns local ranks; under torchrun the command calls
:func:`rank_generate` on each rank itself, with the model it has already loaded.
"""

from __future__ import annotations

import functools
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.distributed as dist

from treeattn.llm.cache import ShardedKVCache
from treeattn.llm.formats.snapshot import save_snapshot
from treeattn.llm.formats.weights import load_model
from treeattn.llm.generate import Generation, greedy_decode
from treeattn.llm.options import Sampler, Sampling, body_dtype, dtype_of, place_model
from treeattn.llm.prefill import sharded_prefill
from treeattn.runtime.agreement import agree_at_setup
from treeattn.runtime.errors import RuntimeFailure
from treeattn.runtime.executor import Executor
from treeattn.runtime.group import RankContext, all_gather_objects, wait_work
from treeattn.runtime.launch import LaunchOptions, launch
from treeattn.runtime.plans import build, local_topology, workload_for
from treeattn.runtime.wire import AttnDims
from treeattn.schedule.ir import Schedule
from treeattn.sim.files.export import schedule_to_json

GENERATE_TIMEOUT_S = 60.0  # per wait on a peer: ranks load the model at different speeds


@dataclass(frozen=True)
class GenerateRequest:
    """One distributed generation, as every rank receives it (picklable)."""

    model: str  # a path or "debug", already resolved by the caller
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    schedule: Schedule
    eos_id: int | None = None
    context_tokens: int = 0
    segment: tuple[int, ...] = ()
    stream: bool = False
    dtype: str = "fp32"  # the blocks' dtype on every rank (treeattn.llm.options.DTYPES)
    sampling: Sampling = field(default_factory=Sampling)
    prefill: str = "pass-kv"  # treeattn.runtime.prefill.ring.PREFILL_ALGORITHMS


def split_lengths(n: int, world: int) -> list[int]:
    """Contiguous shard lengths of ``n`` tokens; the first ``n % world`` ranks get one more.

    Unlike :func:`treeattn.runtime.plans.shard_lengths` a shard may be empty (n < world).

    >>> split_lengths(5, 3), split_lengths(1, 3)
    ([2, 2, 1], [1, 0, 0])
    """
    base, extra = divmod(n, world)
    return [base + (1 if r < extra else 0) for r in range(world)]


class ShardBackend:
    """The attention backend of one rank: its cache shard plus the plan's executor."""

    def __init__(self, ctx: RankContext, cache: ShardedKVCache, schedule: Schedule, dims):
        self.ctx, self.cache, self.schedule, self.dims = ctx, cache, schedule, dims
        self.attention_s = 0.0
        self.bytes_sent = 0
        self.executor: Executor | None = None

    def attend(self, layer, q, k, v, start):
        if q.shape[2] != 1:
            raise ValueError("the sharded backend decodes one token at a time")
        if layer == 0:  # shard lengths change once per token: one executor per step
            lengths = list(self.cache.lengths)
            lengths[self.cache.next_owner()] += 1  # the staged token's owner
            self.executor = Executor(self.ctx, self.schedule, lengths, self.dims)
        t0 = time.perf_counter()
        shard = self.cache.stage(layer, k, v)  # (2, B, Hkv, T, D), the new token included
        (o, _), sent = self.executor.decode(q[:, :, 0], shard)  # (B, Hq, D), (B, Hq)
        self.attention_s += time.perf_counter() - t0
        self.bytes_sent += sent
        if layer == self.cache.n_layers - 1:
            self.cache.commit()
        return o.to(q.dtype)[:, :, None]  # (B, Hq, 1, D)


def _agreed_token(ctx: RankContext, sampler: Sampler, logits: torch.Tensor) -> int:
    """Rank 0's choice (greedy or sampled), broadcast to every rank as one int64."""
    if sampler.greedy:  # every rank takes its argmax; rank 0's overwrites the others
        token = torch.argmax(logits[0]).reshape(1).to(torch.int64)  # (1,)
    else:  # only rank 0 draws, so only its generator advances
        chosen = sampler(logits) if ctx.rank == 0 else 0
        token = torch.tensor([chosen], dtype=torch.int64, device=logits.device)  # (1,)
    work = dist.broadcast(token, src=0, async_op=True)
    wait_work(work, ctx, 0, "token broadcast")
    return int(token.item())


def _streamer(tokenizer):
    """An ``on_token`` callback that prints the text as it grows."""
    ids: list[int] = []
    shown = [""]

    def on_token(token: int) -> None:
        ids.append(token)
        text = tokenizer.decode(ids)
        if text.startswith(shown[0]) and not text.endswith("\ufffd"):
            sys.stdout.write(text[len(shown[0]) :])
            sys.stdout.flush()
            shown[0] = text

    return on_token


@torch.no_grad()
def rank_generate(ctx: RankContext, request: GenerateRequest, loaded=None) -> dict:
    """What every rank runs; rank 0's returned dict is the launcher's result.

    ``loaded`` is the model this process already holds (torchrun), else it is loaded from
    ``request.model``; either way it is placed on ``ctx.device`` in ``request.dtype`` here.
    """
    if request.schedule.world != ctx.world:  # before any work: the plan's shards are not ours
        raise RuntimeFailure(f"rank {ctx.rank}: the decode plan is for {request.schedule.world} "
                             f"ranks, but this group has {ctx.world}")
    loaded = loaded or load_model(request.model)
    cfg = loaded.model.config
    agree_at_setup(ctx, schedule=schedule_to_json(request.schedule),
                   shapes=(cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.dim),
                   dtype=request.dtype, prompt=request.prompt_ids,
                   tokens=(request.max_new_tokens, request.context_tokens))
    model = place_model(loaded.model, ctx.device, dtype_of(request.dtype))
    prompt = list(request.prompt_ids)
    cfg = model.config
    t0 = time.perf_counter()
    cache, logits = sharded_prefill(ctx, model, prompt, context_tokens=request.context_tokens,
                                    segment=request.segment, reserve=request.max_new_tokens,
                                    algorithm=request.prefill)
    dims = AttnDims(1, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cache.kv(0).dtype)
    backend = ShardBackend(ctx, cache, request.schedule, dims)
    start = request.context_tokens + len(prompt)
    t1 = time.perf_counter()
    on_token = _streamer(loaded.tokenizer) if request.stream and ctx.rank == 0 else None
    choose = functools.partial(_agreed_token, ctx, Sampler(request.sampling))
    tokens, seen, steps = greedy_decode(model, backend, logits, start, request.max_new_tokens,
                                        request.eos_id, on_token, choose=choose)
    t2 = time.perf_counter()
    gen = Generation(tokens, [lg.cpu() for lg in seen], t1 - t0, t2 - t1, backend.attention_s,
                     steps)
    agree = all(t == tokens for t in all_gather_objects(ctx, tokens))
    return {"generation": gen, "lengths": list(cache.lengths), "bytes_sent": backend.bytes_sent,
            "ranks_agree": agree, "dtype": str(body_dtype(model)).removeprefix("torch.")}


def make_schedule(algorithm: str, world: int, config, lengths: list[int],
                  dtype: torch.dtype = torch.float32, topology=None,
                  models: tuple = (None, None)) -> Schedule:
    """The plan's schedule for one layer's decode attention with these shard lengths.

    ``auto`` asks the simulator's planner, on ``topology`` (a
    :class:`~treeattn.topo.Topology` of ``world`` GPUs: the real cluster, or a calibrated
    local one) or else the uncalibrated local topology, pricing with ``models``
    (``(hardware, backend)`` from a calibration; None: the defaults).
    """
    dims = AttnDims(1, config.n_heads, config.n_kv_heads, config.head_dim, dtype)
    return build(algorithm, topology or local_topology(world), workload_for(dims, lengths),
                 models)


def generate_distributed(request: GenerateRequest, world: int, timeout_s=GENERATE_TIMEOUT_S,
                         loaded=None, device: str = "auto"):
    """Launch ``world`` local ranks running ``request``; return rank 0's result dict.

    ``loaded`` (the caller's :class:`~treeattn.llm.formats.weights.LoadedModel`) is handed to
    the ranks as a temporary snapshot, so they skip parsing the original file.
    """
    options = LaunchOptions(timeout_s=timeout_s, threads=1, device=device)
    if loaded is None:
        return launch(functools.partial(rank_generate, request=request), world, options)
    with tempfile.TemporaryDirectory(prefix="treeattn-model-") as tmp:
        snapshot = save_snapshot(loaded, Path(tmp))
        request = replace(request, model=str(snapshot))
        return launch(functools.partial(rank_generate, request=request), world, options)
