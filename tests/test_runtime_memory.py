"""One schedule, two executors, for memory too: the peak tensor bytes the runtime holds on
each rank equal what the simulator's memory model predicts for the same schedule."""

from __future__ import annotations

import pytest
import torch

from treeattn.runtime.launch import LaunchOptions, launch
from treeattn.runtime.measure.check import RunRequest
from treeattn.runtime.plans import build, shard_lengths, workload_for
from treeattn.runtime.run_state import KVPool
from treeattn.sim.memory import peak_memory
from treeattn.topo import Topology

WORLD = 4
SEQ_LEN = 8195  # uneven shards: blocks one token apart must still reuse buffers


@pytest.mark.timeout(240)
def test_measured_peak_memory_matches_the_model():
    request = RunRequest(seq_lens=(SEQ_LEN,), algorithms=("tree", "ring", "butterfly"),
                         steps=1, warmup=1, reference=False)
    points = launch(request, WORLD, LaunchOptions(timeout_s=60.0))
    lengths = shard_lengths(SEQ_LEN, WORLD)
    workload = workload_for(request.dims, lengths)
    topology = Topology.from_spec(f"local:ranks={WORLD}")
    for point in points:
        schedule = build(point["algorithm"], topology, workload)
        predicted = peak_memory(schedule, workload)
        # The runtime also holds a few small scratch tensors (the query, a block partial in
        # flight): allow 2% on top of megabytes of KV.
        assert point["peak_memory_bytes"] == pytest.approx(predicted, rel=0.02), point["algorithm"]
    ring = next(p for p in points if p["algorithm"] == "ring")
    tree = next(p for p in points if p["algorithm"] == "tree")
    # shard + the block attended + the block arriving, against the shard alone
    assert max(ring["peak_memory_bytes"]) / max(tree["peak_memory_bytes"]) == pytest.approx(
        3.0, rel=0.02)


def test_empty_kv_blocks_do_not_pile_up_in_the_receive_pool():
    """An empty shard's KV block is a 0-element receive; every empty storage has address 0,
    so a pooled empty buffer would always look in use and each receive would add one."""
    pool = KVPool(torch.float32, torch.device("cpu"), block_numel=0)
    for _ in range(3):
        assert pool.take(0, in_use={0}).numel() == 0
    assert pool.buffers == []
    assert pool.take(5, in_use=set()).numel() == 5 and len(pool.buffers) == 1
