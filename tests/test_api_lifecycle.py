"""A user's ``dist.destroy_process_group()`` frees the group: treeattn keeps no reference to it.

A group torch has destroyed but a module still holds is destroyed only at interpreter exit,
where gloo's threads can abort the process ("terminate called without an active exception",
SIGABRT) after a run that printed the right answer: exit status -6 from a correct program.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.distributed as dist

from treeattn.runtime.launch import LaunchOptions, launch
from treeattn.runtime.sharded_attention import ShardedAttention

# the job destroys its own group, so no other test may reuse these ranks
pytestmark = [pytest.mark.timeout(120), pytest.mark.fresh_ranks]


def _job(ctx) -> dict:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(ctx.rank)
    q = torch.randn(1, 4, 8, generator=torch.Generator().manual_seed(0))  # (B, Hq, D)
    k, v = torch.randn(2, 1, 2, 5, 8, generator=g)  # (B, Hkv, T, D) each
    held = {}
    for algorithm in ("oneshot", "tree"):  # a collective and point-to-point messages
        attn = ShardedAttention(algorithm=algorithm)
        attn(q, k, v)
        held[algorithm] = attn  # still alive, as a user's module-level object is
    world = weakref.ref(dist.group.WORLD)
    dist.destroy_process_group()
    gc.collect()
    return {"world freed": world() is None, "objects": len(held)}


def test_destroying_the_group_frees_it_while_the_objects_live():
    got = launch(_job, 2, LaunchOptions(timeout_s=60.0, threads=1))
    assert got == {"world freed": True, "objects": 2}


def _subgroup_job(ctx) -> dict:
    """Two context-parallel subgroups of two ranks each ({0, 1} and {2, 3})."""
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(ctx.rank)
    q = torch.randn(1, 4, 8, generator=torch.Generator().manual_seed(0))  # (B, Hq, D)
    k, v = torch.randn(2, 1, 2, 5, 8, generator=g)  # (B, Hkv, T, D) each
    halves = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # collective over the world
    mine = halves[ctx.rank // 2]
    held = {}
    for algorithm in ("oneshot", "tree"):  # a collective and point-to-point messages
        attn = ShardedAttention(group=mine, algorithm=algorithm)
        attn(q, k, v)
        held[algorithm] = attn  # still alive, as a user's module-level object is
    subgroup = weakref.ref(mine)
    del halves, mine
    dist.destroy_process_group()
    gc.collect()
    from treeattn.runtime.transport import _TRANSPORTS

    # the transports of the dead groups are forgotten with them
    return {"subgroup freed": subgroup() is None, "objects": len(held),
            "transports": len(_TRANSPORTS)}


def test_destroying_the_groups_frees_a_subgroup_while_its_objects_live():
    got = launch(_subgroup_job, 4, LaunchOptions(timeout_s=60.0, threads=1))
    assert got == {"subgroup freed": True, "objects": 2, "transports": 0}
