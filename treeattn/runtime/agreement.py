"""Ranks agree on what they run before they run it: a digest of the plan, shapes and dtype.

Spawned ranks all receive one pickled job, but ranks started by torchrun (or by a user's own
code through the library) each read their own arguments and files: a plan file that differs
between two hosts, a ``--dtype`` given to one rank only, a model with other head counts.
Such ranks would exchange messages of different sizes or run different collectives, and hang
or answer wrong. So at setup every rank hashes what must be the same everywhere and the
digests are gathered (one small collective, bounded by the group's timeout); any difference
ends the run on every rank with one line naming the ranks that differ from rank 0 and what
differs. :class:`RanksDisagree` is a :class:`~treeattn.runtime.errors.RankLost`: the input
may have been fine, the group was not one run (exit status 1).

The library's exchanges (:class:`treeattn.ShardedAttention`'s plan and shapes) go through
:func:`gather_named` instead: one message per pair of ranks, so that a rank which does not
make the same call within the timeout is named on the others rather than waited for.
"""

from __future__ import annotations

import hashlib
import json
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from treeattn.runtime.errors import RankLost, RankTimeout, RuntimeFailure
from treeattn.runtime.group import RankContext, all_gather_objects, silent_ranks_text


class RanksDisagree(RankLost):
    """Ranks of one group were given different plans, shapes or dtypes."""


def digest(value) -> str:
    """A short stable hash of ``value`` (plain data; anything else by its ``repr``).

    >>> digest({"b": 1, "a": [2, 3]}) == digest({"a": [2, 3], "b": 1})
    True
    """
    text = json.dumps(value, sort_keys=True, default=repr, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def agree_at_setup(ctx: RankContext, **parts) -> None:
    """Raise :class:`RanksDisagree` on every rank unless all ranks passed equal ``parts``."""
    mine = {name: digest(value) for name, value in parts.items()}
    everyone = all_gather_objects(ctx, mine)
    reference = everyone[0]
    differ: dict[str, list[int]] = {}
    for rank, theirs in enumerate(everyone):
        for name in sorted(set(reference) | set(theirs)):
            if theirs.get(name) != reference.get(name):
                differ.setdefault(name, []).append(rank)
    if differ:
        ranks = sorted({r for rs in differ.values() for r in rs})
        what = "; ".join(f"{name} (rank {', '.join(map(str, rs))})"
                         for name, rs in differ.items())
        raise RanksDisagree(f"rank(s) {', '.join(map(str, ranks))} disagree with rank 0 at "
                            f"setup on {what}: every rank must be given the same plan, "
                            "shapes and dtype")


EXCHANGE_TAG = 1 << 20  # above every schedule's and the prefill's tags
EXCHANGE_BYTES = 256  # one rank's value, as JSON: a digest and a few numbers


def gather_named(ctx: RankContext, value, what: str) -> list:
    """Every rank's ``value`` (JSON-able, at most :data:`EXCHANGE_BYTES` as JSON), on every
    rank, waiting at most the context's timeout for the whole exchange.

    Unlike a collective, whose wait cannot tell who is missing, each pair of ranks exchanges
    one message, so a rank that does not make the same call in time is named: raises
    :class:`~treeattn.runtime.errors.RankTimeout` ``rank 0: rank 2 did not reach <what>
    within 5s``. A rank that died is :class:`~treeattn.runtime.errors.RankLost`, named too.
    """
    text = json.dumps(value, separators=(",", ":")).encode()
    if len(text) > EXCHANGE_BYTES - 4:
        raise RuntimeFailure(f"{what}: {len(text)} bytes to exchange, at most "
                             f"{EXCHANGE_BYTES - 4}")
    mine = torch.zeros(EXCHANGE_BYTES, dtype=torch.uint8)  # (EXCHANGE_BYTES,) length, JSON
    mine[:4] = torch.tensor(list(len(text).to_bytes(4, "little")), dtype=torch.uint8)
    mine[4:4 + len(text)] = torch.tensor(list(text), dtype=torch.uint8)
    mine = mine.to(ctx.device)
    peers = [r for r in range(ctx.world) if r != ctx.rank]
    boxes = {r: torch.empty_like(mine) for r in peers}
    works = {}
    for r in peers:  # in rank order on every rank: NCCL's batches pair up without a cycle
        ops = [dist.P2POp(dist.isend, mine, ctx.global_rank(r), group=ctx.group,
                          tag=EXCHANGE_TAG),
               dist.P2POp(dist.irecv, boxes[r], ctx.global_rank(r), group=ctx.group,
                          tag=EXCHANGE_TAG)]
        works[r] = dist.batch_isend_irecv(ops)
    pending, lost = _settle(ctx, works)
    if lost:
        ranks = ", ".join(str(r) for r, _ in lost)
        raise RankLost(f"rank {ctx.rank}: lost rank {ranks} during {what}"
                       f"{silent_ranks_text()} ({lost[0][1]})")
    if pending:
        ranks = ", ".join(str(r) for r in pending)
        raise RankTimeout(f"rank {ctx.rank}: rank {ranks} did not reach {what} within "
                          f"{ctx.timeout_s:g}s{silent_ranks_text()}")
    out = []
    for r in range(ctx.world):
        raw = (mine if r == ctx.rank else boxes[r]).cpu()
        size = int.from_bytes(bytes(raw[:4].tolist()), "little")
        out.append(json.loads(bytes(raw[4:4 + size].tolist())))
    return out


def _settle(ctx: RankContext, works: dict[int, list]) -> tuple[list[int], list[tuple]]:
    """Wait for every peer's works within the context's timeout: the peers that did not
    answer in time, and (peer, reason) of those whose exchange failed.

    Gloo marks a message done only inside ``wait``, which takes a timeout; a CUDA work's
    ``wait`` returns once the work is queued on the stream, so NCCL's are polled instead.
    """
    start, pending, lost = time.monotonic(), [], []
    for r, peer_works in works.items():
        try:
            for work in peer_works:
                if ctx.device.type == "cpu":
                    left = ctx.timeout_s - (time.monotonic() - start)
                    # never 0, which some backends read as "no timeout"
                    done = work.wait(timedelta(seconds=max(1e-3, left)))
                else:
                    while (not (done := work.is_completed())
                           and time.monotonic() - start < ctx.timeout_s):
                        time.sleep(min(1e-3, (time.monotonic() - start) / 16))
                    if done:
                        work.wait()  # raises if it failed
                if done is False:
                    pending.append(r)
                    break
        except Exception as exc:
            reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
            if "timeout" in reason.lower() or "timed out" in reason.lower():
                pending.append(r)
            else:
                lost.append((r, reason))
    return pending, lost
