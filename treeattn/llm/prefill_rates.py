"""The compute rates a sharded prefill's prediction needs, measured on the ranks themselves.

The calibration half of the prefill check (``benchmarks/prefill_check.py``): before any
prefill runs, every rank of the group measures, at the same time as the others (so the
rates are those of ranks sharing the host, as the prefill will), with microbenchmarks of
the kernels the runtime runs, on the shapes this rank will give them:

* **matmul**, FLOP/s: ``F.linear`` at each of the layer's projections (Q, K, V, O, gate, up,
  down; weights stored as the model stores them) for this rank's query tokens (median of 5);
* **attention**, FLOP/s (``4·Hq·D`` per causal query-key pair): the ring's own tiled kernel
  (:func:`treeattn.runtime.prefill.ring.causal_partial`) over every (query block, key block)
  pair this rank attends under the algorithm, each partial merged as a ring step merges it,
  on random data (median of 3): pass-KV attends its own queries over every rank's block,
  pass-Q every rank's queries over its own block;
* **read bandwidth**, bytes/s, of ``sum()`` over 256 MiB (median of 3).

Nothing here sees a prefill's measured time: these rates make the
:class:`~treeattn.sim.devices.HardwareModel` of each rank, and the prediction is then made
from them and compared with the measurement.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from treeattn.runtime.group import RankContext, all_gather_objects
from treeattn.runtime.prefill.ring import causal_partial, merge_prefill_pair
from treeattn.schedule.workload import ModelConfig
from treeattn.sim.devices import CPU_LAUNCH_S, HardwareModel
from treeattn.sim.prefill.layout import PrefillLayout, causal_pairs


def typical_time(fn, repeats: int) -> float:
    """The median of ``repeats`` timed calls of ``fn``, after one warm-up call.

    The median, not the best: the ranks share the host's cores, caches and memory
    bandwidth, and the prefill runs in that typical state, not in its luckiest moment."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def matmul_rate(m: ModelConfig, tokens: int) -> float:
    """FLOP/s of the layer's projections for ``tokens`` rows, as the model runs them: one
    ``F.linear`` per weight (Q, K, V, O, gate, up, down), weights stored (out, in)."""
    tokens = max(1, tokens)
    g = torch.Generator().manual_seed(0)
    hq, hkv = m.head_dim * m.n_heads, m.head_dim * m.n_kv_heads
    shapes = [(m.dim, hq), (m.dim, hkv), (m.dim, hkv), (hq, m.dim), (m.dim, m.ffn_dim),
              (m.dim, m.ffn_dim), (m.ffn_dim, m.dim)]  # (in, out) of each projection
    inputs = {n: torch.randn(1, tokens, n, generator=g) for n in {a for a, _ in shapes}}
    weights = [torch.randn(b, a, generator=g) for a, b in shapes]  # (out, in)

    def layer():
        for (a, _), w in zip(shapes, weights, strict=True):
            F.linear(inputs[a], w)

    flops = sum(2.0 * tokens * a * b for a, b in shapes)
    return flops / typical_time(layer, 5)


def attention_work(layout: PrefillLayout, rank: int, algorithm: str) -> list[tuple[int, int]]:
    """The (query owner, key block owner) pairs ``rank`` attends under ``algorithm``."""
    world = layout.world
    if algorithm == "pass-q":
        return [(origin, rank) for origin in range(world)]
    return [(rank, holder) for holder in range(world)]


def attention_rate(m: ModelConfig, layout: PrefillLayout, rank: int, algorithm: str) -> float:
    """FLOP/s of the ring's kernel over the blocks ``rank`` attends (random data)."""
    g = torch.Generator().manual_seed(1 + rank)
    work = []
    pairs = 0
    for q_of, k_of in attention_work(layout, rank, algorithm):
        if not layout.sees(q_of, k_of):
            continue
        q_pos, k_pos = layout.positions(q_of, queries=True), layout.positions(k_of)
        q = torch.randn(1, m.n_heads, len(q_pos), m.head_dim, generator=g)  # (B, Hq, T, D)
        kv = torch.randn(2, 1, m.n_kv_heads, len(k_pos), m.head_dim, generator=g)
        empty = (torch.zeros(*q.shape), torch.full(q.shape[:3], -math.inf))  # identity
        work.append((q, q_pos, kv, k_pos, empty))
        pairs += sum(causal_pairs(a, b) for a in layout.compute(q_of)
                     for b in layout.block(k_of))
    if not pairs:
        return 0.0

    def attend():  # as the rings do it: the kernel, then one merge of its partial
        for q, q_pos, kv, k_pos, empty in work:
            merge_prefill_pair(empty, causal_partial(q, q_pos, kv, k_pos))

    return 4.0 * m.n_heads * m.head_dim * pairs / typical_time(attend, 3)


def read_bandwidth() -> float:
    """Bytes/s of ``sum()`` over 256 MiB of fp32."""
    x = torch.ones(64 << 20)
    return x.numel() * 4 / typical_time(lambda: float(x.sum()), 3)


@dataclass(frozen=True)
class PrefillRates:
    """A picklable job for :func:`treeattn.runtime.launch.launch`: every rank measures its
    rates for the prefill of ``context`` cached then ``prompt`` tokens of the registered
    shape ``model`` under ``algorithm``, all at once. Rank 0 gets one dict per rank."""

    model: str
    context: int
    prompt: int
    algorithm: str = "pass-kv"

    def __call__(self, ctx: RankContext) -> list[dict] | None:
        m = ModelConfig.from_name(self.model)
        layout = PrefillLayout(ctx.world, self.context, self.prompt)
        all_gather_objects(ctx, None)  # start together: the rates of ranks sharing the host
        tokens = len(layout.positions(ctx.rank, queries=True))
        mine = {"rank": ctx.rank, "matmul_flops": matmul_rate(m, tokens),
                "attention_flops": attention_rate(m, layout, ctx.rank, self.algorithm),
                "read_Bps": read_bandwidth()}
        everyone = all_gather_objects(ctx, mine)
        return everyone if ctx.rank == 0 else None


def hardware_models(rates: list[dict]) -> list[HardwareModel]:
    """One calibrated CPU :class:`HardwareModel` per rank, from :class:`PrefillRates`."""
    return [HardwareModel(f"cpu-rank{r['rank']}", memory_bandwidth_Bps=r["read_Bps"],
                          peak_flops=r["matmul_flops"], launch_s=CPU_LAUNCH_S,
                          attention_flops=r["attention_flops"] or r["matmul_flops"])
            for r in sorted(rates, key=lambda r: r["rank"])]
