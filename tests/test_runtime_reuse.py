"""The executor allocates its receive buffers once: a second run reuses every one of them,
posts no new allocation for a message, and still returns the right result (its own copy)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from treeattn.kernels.reference import naive_attention
from treeattn.runtime.executor import Executor
from treeattn.runtime.launch import LaunchOptions, launch
from treeattn.runtime.plans import build, local_topology, workload_for
from treeattn.runtime.wire import AttnDims

DIMS = AttnDims(1, 2, 1, 8)
LENGTHS = (5, 3)


@dataclass(frozen=True)
class ReuseJob:
    algorithm: str

    def __call__(self, ctx):
        g = torch.Generator().manual_seed(7)
        q = torch.randn(DIMS.batch, DIMS.n_heads, DIMS.head_dim, generator=g)
        kv = torch.randn(2, DIMS.batch, DIMS.n_kv_heads, sum(LENGTHS), DIMS.head_dim,
                         generator=g)
        lo = sum(LENGTHS[:ctx.rank])
        shard = kv[:, :, :, lo:lo + LENGTHS[ctx.rank]].contiguous()
        schedule = build(self.algorithm, local_topology(2), workload_for(DIMS, list(LENGTHS)))
        ex = Executor(ctx, schedule, list(LENGTHS), DIMS)
        posted = []  # receive buffers and KV pool (data_ptr), per run


        outs, stats = [], []
        for _ in range(2):
            before = {i: b.data_ptr() for i, b in ex.recv_buffers.items()}
            pool = [b.data_ptr() for b in ex.kv_pool.buffers]
            (o, lse), st = ex.run(q, shard)
            outs.append((o, lse))
            stats.append(st)
            posted.append((before, pool, [b.data_ptr() for b in ex.kv_pool.buffers]))
        ref = naive_attention(q, kv[0], kv[1])
        return {"posted": posted, "outs": outs, "ref": ref, "n_recv": len(ex.recv_order),
                "peaks": [s.peak_bytes for s in stats],
                "ptrs_after": {i: b.data_ptr() for i, b in ex.recv_buffers.items()}}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("algorithm", ["butterfly", "tree", "ring"])
def test_second_run_reuses_every_receive_buffer(algorithm):
    r = launch(ReuseJob(algorithm), 2, LaunchOptions(timeout_s=30.0, deadline_s=100))
    (first, _, pool_after_first), (second, pool_before_second, pool_after_second) = r["posted"]
    assert r["n_recv"] >= 1
    assert first == second == r["ptrs_after"]  # same receive buffers in both runs
    assert pool_after_first == pool_before_second == pool_after_second  # no new KV block
    assert r["peaks"][0] == r["peaks"][1] > 0  # the memory peak is reported on both runs
    for o, lse in r["outs"]:
        torch.testing.assert_close(o, r["ref"][0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse, r["ref"][1], atol=1e-5, rtol=1e-5)
