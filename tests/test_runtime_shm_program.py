"""The compiled reduction of partials (treeattn/testbed/transport/shm_program.py and
native/shm_program.c).

In-process, ranks are threads (the C call releases the GIL) on one segment held in a plain
array, as in test_runtime_shm.py: every rank's result equals the reference attention of the
whole KV and, bit for bit, the merges of the Python path in the schedule's order; a send into
a full mailbox waits without deadlocking its peer; a silent peer times out with its rank
named; a size disagreement is an error; the Python channel carries on after a program.
Across processes: the executor's program runs agree bit for bit with its Python runs.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from treeattn.kernels import merge_packed, partial_attention_packed, partial_attention_path
from treeattn.kernels.reference import naive_attention
from treeattn.kernels.testing import O_TOLERANCE
from treeattn.runtime.errors import RankTimeout, RuntimeFailure
from treeattn.runtime.executor import Executor
from treeattn.runtime.group import RankContext, all_gather_objects
from treeattn.runtime.launch import LaunchOptions, launch
from treeattn.runtime.plans import build, local_topology, shard_offsets, workload_for
from treeattn.runtime.wire import AttnDims, unpack_partial
from treeattn.schedule.ir import Compute, Merge, Recv, Send
from treeattn.testbed.transport import shm, shm_program

pytestmark = pytest.mark.skipif(shm_program.unavailable_reason() != "",
                                reason="no C compiler: the executor keeps its Python steps")


def _channels(world: int, timeout_s: float = 5.0) -> list[shm.ShmChannel]:
    seg = np.zeros(shm.segment_bytes(world), dtype=np.uint8)
    return [shm.ShmChannel(RankContext(r, world, r, torch.device("cpu"), "gloo", timeout_s), seg)
            for r in range(world)]


def _in_threads(jobs):
    """Run each job in its own thread; return the results (or raise the first error)."""
    results, errors = [None] * len(jobs), []

    def run(i):
        try:
            results[i] = jobs[i]()
        except Exception as exc:  # noqa: BLE001  (re-raised below, in the test's thread)
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    if errors:
        raise errors[0]
    return results


def _python_merges(steps, partials: list[torch.Tensor], rank: int, rows: int) -> torch.Tensor:
    """What the Python path computes on ``rank``: its steps replayed on the known partials
    (each Recv carries the sender's partial at the matching Send), in the schedule's order."""
    world = len(partials)
    current = list(partials)
    cursor = [1] * world
    sent: dict[tuple[int, int, int], list[torch.Tensor]] = {}
    # Replay every rank's steps round-robin until each is done (a receive waits its message).
    progressed = True
    while progressed:
        progressed = False
        for r in range(world):
            while cursor[r] < len(steps[r]):
                step = steps[r][cursor[r]]
                if isinstance(step, Send):
                    sent.setdefault((r, step.dst, step.tag), []).append(current[r])
                    cursor[r] += 1
                elif isinstance(step, Recv):
                    queue = sent.get((step.src, r, step.tag))
                    if not queue:
                        break
                    msg = queue.pop(0)
                    if step.reduce:  # the Merge right after folds it in
                        current[r] = merge_packed(current[r], msg, rows)
                        cursor[r] += 2
                    else:
                        current[r] = msg
                        cursor[r] += 1
                    progressed = True
                    continue
                progressed = True
    return current[rank]


@contextlib.contextmanager
def _one_thread():
    """One torch thread, as ranks run: the C kernel only serves single-threaded callers."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _empty_kv(d: int = 8) -> torch.Tensor:
    return torch.empty(2, 1, 1, 0, d)  # (2, B, Hkv, 0, D): the rank's partial comes from attend


def _given(partial: torch.Tensor):
    """A rank with an empty shard whose ``attend`` hands over ``partial``."""
    return {"q": torch.zeros(1, 2, 8), "kv": _empty_kv(), "scale": 1.0, "attend": lambda: partial}


@settings(max_examples=25, deadline=None)
@given(plan=st.one_of(st.tuples(st.just("tree"), st.integers(2, 6)),
                     st.tuples(st.just("butterfly"), st.sampled_from([2, 4, 8]))),
       lengths_seed=st.integers(0, 10**6), hkv=st.sampled_from([1, 2]),
       group=st.sampled_from([1, 3]), d=st.sampled_from([8, 16, 64]),
       kv_dtype=st.sampled_from([torch.float32, torch.bfloat16]), longest=st.sampled_from([7, 600]))
def test_every_rank_gets_the_exact_attention_and_the_python_paths_bits(
        plan, lengths_seed, hkv, group, d, kv_dtype, longest):
    """Tree at any world, butterfly at powers of two (elsewhere it keeps a residue partial,
    which the program does not take). The C kernel runs inside the call where
    partial_attention_packed would choose it (here: D = 16 or 64, and bf16 or long shards),
    Python's attention first elsewhere (D = 8, short fp32 shards, empty ones)."""
    algorithm, world = plan
    g = torch.Generator().manual_seed(lengths_seed)
    lengths = [int(x) for x in torch.randint(0, longest, (world,), generator=g)]
    lengths[0] = max(lengths[0], 1)  # an empty shard may be anywhere else
    b, hq = 2, hkv * group
    dims = AttnDims(b, hq, hkv, d, kv_dtype, world=world)
    q = torch.randn(b, hq, d, generator=g).to(kv_dtype)  # (B, Hq, D)
    k = torch.randn(b, hkv, sum(lengths), d, generator=g).to(kv_dtype)  # (B, Hkv, T, D)
    v = torch.randn(b, hkv, sum(lengths), d, generator=g).to(kv_dtype)
    schedule = build(algorithm, local_topology(world), workload_for(dims, lengths))
    channels = _channels(world)
    offsets = shard_offsets(lengths)
    names = [f"step{i}" for i in range(max(len(s) for s in schedule.steps))]
    partials, programs, shards = [], [], []
    for r in range(world):
        own = slice(offsets[r], offsets[r] + lengths[r])
        shards.append(torch.stack([k[:, :, own], v[:, :, own]]))  # (2, B, Hkv, n, D)
        if lengths[r]:  # as the executor's Python path computes it, on one thread
            with _one_thread():
                partials.append(partial_attention_packed(q, k[:, :, own], v[:, :, own]))
        else:  # the identity partial, as the executor uses for an empty shard
            o, lse = torch.zeros(b, hq, d), torch.full((b, hq), -torch.inf)
            partials.append(torch.cat([o.reshape(-1), lse.reshape(-1)]))
        programs.append(shm_program.compile_program(schedule.steps[r], names, r, channels[r],
                                                    dims))
    assert all(p is not None for p in programs)
    scale = d ** -0.5
    with _one_thread():
        outs = _in_threads([lambda r=r: programs[r].run(q, shards[r], scale,
                                                        lambda r=r: partials[r], r, 5.0)
                            for r in range(world)])
    ref_o, ref_lse = naive_attention(q.float(), k.float(), v.float())
    # bf16: the paths that compute in 16 bits (torch's fused kernel) keep the kernels' tolerance
    tol = dict(atol=1e-4, rtol=1e-4) if kv_dtype == torch.float32 else O_TOLERANCE[
        ("fused", torch.bfloat16)]
    for r in range(world):
        o, lse = unpack_partial(outs[r], dims)
        torch.testing.assert_close(o, ref_o, **tol)
        torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)
        expected = _python_merges(schedule.steps, partials, r, b * hq)
        assert torch.equal(outs[r], expected)
    for ch in channels:  # every message read
        assert all(box.ctrl[0] == box.ctrl[8] for box in ch.boxes.values())
    for r, program in enumerate(programs):  # steps in order, each after the previous
        rows = program.timeline(r)
        assert [index for _, index, _, _, _ in rows] == list(range(len(schedule.steps[r])))
        ends = [0.0] + [end for *_, end in rows]
        assert all(start >= ends[i] - 1e-9 and end >= start
                   for i, (_, _, _, start, end) in enumerate(rows))


def test_the_kernel_inside_the_call_is_the_one_python_would_call_bit_for_bit():
    """bf16 shards of SmolLM2's head shape: partial_attention_packed takes the C kernel, so
    the program computes the partial inside its call, and gets the same bits."""
    dims = AttnDims(1, 9, 3, 64, torch.bfloat16, world=2)
    g = torch.Generator().manual_seed(11)
    q = torch.randn(1, 9, 64, generator=g).to(torch.bfloat16)  # (B, Hq, D)
    kv = torch.randn(2, 2, 1, 3, 300, 64, generator=g).to(torch.bfloat16)  # per rank
    schedule = build("butterfly", local_topology(2), workload_for(dims, [300, 300]))
    channels = _channels(2)
    programs = [shm_program.compile_program(schedule.steps[r], ["s"] * 4, r, channels[r], dims)
                for r in range(2)]

    def never():
        raise AssertionError("the program took Python's attention")

    for tokens in (300, 120, 300):  # a second signature, then the first one's plan again
        shards = kv[..., :tokens, :]  # (2 ranks, 2, B, Hkv, tokens, D), strided views
        with _one_thread():
            assert partial_attention_path(q, shards[0][0], shards[0][1]) == "native"
            partials = [partial_attention_packed(q, shards[r][0], shards[r][1], scale=0.125)
                        for r in range(2)]
            outs = _in_threads([lambda r=r, s=shards: programs[r].run(q, s[r], 0.125, never, r, 5.0)
                                for r in range(2)])
        assert torch.equal(outs[0], merge_packed(partials[0], partials[1], 9))
        assert torch.equal(outs[1], merge_packed(partials[1], partials[0], 9))
    assert len(programs[0].plans) == 2


def _two_rank_exchange(channels, dims):
    steps = [Compute("attention", 0, 0), Send(1, 0, 0, "partial"), Recv(1, 0, 0, "partial",
                                                                        reduce=True),
             Merge(0, "partial", 0)]
    mirrored = [steps[0], Send(0, 0, 0, "partial"), Recv(0, 0, 0, "partial", reduce=True),
                steps[3]]
    return [shm_program.compile_program(s, ["attention", "send", "recv", "merge"], r,
                                        channels[r], dims)
            for r, s in enumerate([steps, mirrored])]


DIMS = AttnDims(1, 2, 1, 8, torch.float32, world=2)


def _partial(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.cat([torch.randn(2 * 8, generator=g), torch.randn(2, generator=g)])


def test_a_send_into_a_full_mailbox_waits_there_without_blocking_its_peer():
    a, b = _channels(2)
    earlier = torch.arange(5.0)
    a.isend(earlier, 1, tag=0)  # rank 1 has not read this yet: the program's send must wait
    programs = _two_rank_exchange([a, b], DIMS)
    p0, p1 = _partial(0), _partial(1)

    def rank1():
        threading.Event().wait(0.05)  # let rank 0 reach its wait with the send deferred
        got = torch.zeros(5)
        assert b.irecv(got, 0, tag=0).wait()
        return got, programs[1].run(**_given(p1), rank=1, timeout_s=5.0)

    out0, (got, out1) = _in_threads([
        lambda: programs[0].run(**_given(p0), rank=0, timeout_s=5.0), rank1])
    assert torch.equal(got, earlier)
    assert torch.equal(out0, merge_packed(p0, p1, 2))
    assert torch.equal(out1, merge_packed(p1, p0, 2))


def test_the_python_channel_carries_on_in_order_after_a_program():
    a, b = _channels(2)
    programs = _two_rank_exchange([a, b], DIMS)
    _in_threads([lambda: programs[0].run(**_given(_partial(0)), rank=0, timeout_s=5.0),
                 lambda: programs[1].run(**_given(_partial(1)), rank=1, timeout_s=5.0)])
    after = torch.arange(18.0)
    a.isend(after, 1, tag=0)
    got = torch.zeros(18)
    assert b.irecv(got, 0, tag=0).wait(None) and torch.equal(got, after)


def test_a_silent_peer_times_out_with_its_rank_named():
    a, b = _channels(2)
    program = _two_rank_exchange([a, b], DIMS)[0]
    with pytest.raises(RankTimeout, match=r"rank 0: timed out after 0.2s waiting for rank 1"):
        program.run(**_given(_partial(0)), rank=0, timeout_s=0.2)


def test_a_message_of_the_wrong_size_is_an_error_not_garbage():
    a, b = _channels(2)
    program = _two_rank_exchange([a, b], DIMS)[0]
    b.isend(torch.zeros(5), 0, tag=0)  # the peer thinks the partial is smaller
    with pytest.raises(RuntimeFailure, match="disagree on the schedule"):
        program.run(**_given(_partial(0)), rank=0, timeout_s=2.0)


@pytest.mark.parametrize("algorithm", ["ring", "helix", "dcp", "allreduce3", "oneshot",
                                       "ring-passq", "butterfly"])
def test_schedules_that_move_more_than_whole_partials_keep_the_python_steps(algorithm):
    dims = AttnDims(1, 4, 2, 8, torch.float32, world=3)  # butterfly: a residue at world 3
    schedule = build(algorithm, local_topology(3), workload_for(dims, [4, 4, 4]))
    channels = _channels(3)
    names = ["step"] * max(len(s) for s in schedule.steps)
    assert all(shm_program.compile_program(schedule.steps[r], names, r, channels[r], dims)
               is None for r in range(3))


def test_the_switch_keeps_the_python_steps(monkeypatch):
    monkeypatch.setenv(shm_program.ENV_SWITCH, "0")
    assert _two_rank_exchange(_channels(2), DIMS) == [None, None]


@dataclass(frozen=True)
class TwoRuns:
    """Run one executor twice on this rank's shard: the first run walks memory (the Python
    steps), the second takes the program. Rank 0 returns every rank's two results."""

    algorithm: str
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    lengths: tuple[int, ...]

    def __call__(self, ctx):
        b, hkv, _, d = self.k.shape
        dims = AttnDims(b, self.q.shape[1], hkv, d, torch.float32)
        schedule = build(self.algorithm, local_topology(ctx.world),
                         workload_for(dims, list(self.lengths)))
        lo = shard_offsets(list(self.lengths))[ctx.rank]
        own = slice(lo, lo + self.lengths[ctx.rank])
        kv = torch.stack([self.k[:, :, own], self.v[:, :, own]])  # (2, B, Hkv, n, D)
        executor = Executor(ctx, schedule, list(self.lengths), dims)
        runs = [executor.run(self.q, kv) for _ in range(2)]
        names = [[name for _, _, name, _, _ in stats.timeline] for _, stats in runs]
        mine = (executor.program is not None, [out for out, _ in runs], names,
                [stats.bytes_sent for _, stats in runs])
        everyone = all_gather_objects(ctx, mine)
        return everyone if ctx.rank == 0 else None


@pytest.mark.timeout(120)
@pytest.mark.parametrize("algorithm,world", [("tree", 3), ("butterfly", 2)])
def test_the_executors_program_runs_equal_its_python_runs(algorithm, world):
    lengths = (5, 0, 4)[:world] if world == 3 else (3, 6)
    g = torch.Generator().manual_seed(7)
    q = torch.randn(1, 6, 16, generator=g)  # (B, Hq, D)
    k = torch.randn(1, 2, sum(lengths), 16, generator=g)  # (B, Hkv, T, D)
    v = torch.randn(1, 2, sum(lengths), 16, generator=g)
    everyone = launch(TwoRuns(algorithm, q, k, v, lengths), world, LaunchOptions(timeout_s=30))
    ref_o, ref_lse = naive_attention(q, k, v)
    for compiled, (python_run, program_run), (names_py, names_prog), sent in everyone:
        assert compiled
        assert names_py == names_prog and sent[0] == sent[1]
        assert all(torch.equal(x, y) for x, y in zip(python_run, program_run, strict=True))
        torch.testing.assert_close(program_run[0], ref_o, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(program_run[1], ref_lse, atol=1e-5, rtol=1e-5)


def test_a_query_or_partial_that_does_not_fit_the_program_is_refused_not_written():
    a, b = _channels(2)
    program = _two_rank_exchange([a, b], DIMS)[0]  # 1 x 2 rows of 8
    kv = torch.randn(2, 1, 1, 40, 16)  # (2, B, Hkv, T, D): D = 16, not the schedule's 8
    with _one_thread(), pytest.raises(RuntimeFailure, match="rows of 8"):
        program.run(torch.randn(1, 2, 16), kv, 0.25, lambda: None, 0, 1.0)
    with pytest.raises(RuntimeFailure, match="for a program of 18"):
        program.run(**_given(torch.zeros(36)), rank=0, timeout_s=1.0)
    assert a.box(0, 1, 0).ctrl[0] == 0  # nothing was sent


def test_kernel_backends_other_than_native_keep_the_python_steps(monkeypatch):
    """Their merge is not the C one, so a program would not give the Python path's bits."""
    monkeypatch.setenv("TREEATTN_KERNEL", "torch")
    assert _two_rank_exchange(_channels(2), DIMS) == [None, None]
