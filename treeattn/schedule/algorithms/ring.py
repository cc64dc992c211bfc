"""``ring``: the Ring Attention decode baseline.

Rank ``r`` starts with its own shard as ``"kv"``. In step ``i`` (0 … p−2) it sends the block
it holds to ``r+1``, attends over that block while the send is in flight, and receives the
next block from ``r−1`` (replacing ``"kv"``); after ``p−1`` rotations it attends the last
block. The block rank ``r`` holds in step ``i`` is the shard of rank ``(r − i) mod p``::

    for i in 0 … p−2:
        Send(r+1, kv, tag=i)
        Compute("attention") if i == 0 else Compute("attention_block"); Merge(tag=None)
        Recv(r−1, kv, tag=i, reduce=False)
    Compute("attention_block"); Merge(tag=None)

Communication convention: per layer and decode step each rank sends ``p − 1`` KV blocks,
a block of ``n`` tokens being ``2·B·n·Hkv·D·dtype_bytes`` bytes (K and V). The total
``comm_bytes`` is therefore ``(p − 1) ×`` the whole KV cache of the layer, i.e.
``p·(p−1)·2·shard_tokens·Hkv·D·dtype_bytes`` for an even split.
"""

from __future__ import annotations

from treeattn.schedule.ir import Merge, Recv, Schedule, Send
from treeattn.schedule.payloads import ComputeLabel, MergeOp, Payload
from treeattn.schedule.workload import DecodeWorkload


def block_compute(workload: DecodeWorkload, tokens: int) -> list:
    """Attend over a foreign block and fold it into the running partial."""
    return [workload.attention_step(tokens, ComputeLabel.ATTENTION_BLOCK),
            Merge(3 * workload.partial_bytes, MergeOp.PARTIAL, None)]


def build_ring(topology, workload: DecodeWorkload) -> Schedule:
    world = topology.num_gpus
    shards = workload.shards(world)
    steps = []
    for r in range(world):
        nxt, prv = (r + 1) % world, (r - 1) % world
        rank_steps = []
        for i in range(world - 1):
            held, incoming = shards[(r - i) % world], shards[(r - i - 1) % world]
            rank_steps.append(Send(nxt, workload.kv_bytes(held), i, Payload.KV))
            if i == 0:
                rank_steps.append(workload.attention_step(held))
            else:
                rank_steps += block_compute(workload, held)
            rank_steps.append(Recv(prv, workload.kv_bytes(incoming), i, Payload.KV,
                                   reduce=False))
        rank_steps += block_compute(workload, shards[(r + 1) % world])
        steps.append(rank_steps)
    return Schedule("ring", steps, {})
