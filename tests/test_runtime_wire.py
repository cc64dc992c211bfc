"""The runtime's wire format, the latency/bandwidth fit and the error summary (no group)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from treeattn.runtime import RuntimeFailure, wire
from treeattn.sim import DecodeWorkload, build_schedule
from treeattn.topo import Topology


@given(st.integers(0, 1000), st.integers(1, 9))
@settings(max_examples=80, deadline=None)
def test_chunks_tile_the_buffer(numel: int, count: int) -> None:
    bounds = [wire.chunk_bounds(numel, (i, count)) for i in range(count)]
    assert bounds[0][0] == 0 and bounds[-1][1] == numel
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:], strict=False))
    sizes = [hi - lo for lo, hi in bounds]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_partial_chunks_are_head_ranges() -> None:
    dims = wire.AttnDims(2, 5, 1, 3)
    o = torch.arange(2 * 5 * 3, dtype=torch.float32).view(2, 5, 3)  # (B, Hq, D)
    lse = -torch.arange(10, dtype=torch.float32).view(2, 5)  # (B, Hq)
    flat = wire.pack_partial(o, lse)
    o2, lse2 = wire.unpack_partial(flat, dims)
    assert torch.equal(o2, o) and torch.equal(lse2, lse)
    piece = wire.take_slice(flat, dims, "partial", (1, 2))  # heads 3..4
    assert piece.numel() == wire.message_numel(dims, "partial", (1, 2))
    po, plse = wire.unpack_heads(piece, dims, 2)
    assert torch.equal(po, o[:, 3:]) and torch.equal(plse, lse[:, 3:])
    back = wire.put_slice(torch.zeros_like(flat), dims, "partial", (1, 2), piece)
    bo, blse = wire.unpack_partial(back, dims)
    assert torch.equal(bo[:, 3:], o[:, 3:]) and torch.equal(bo[:, :3], torch.zeros(2, 3, 3))
    assert torch.equal(blse[:, 3:], lse[:, 3:])


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ring_kv_messages_carry_the_senders_block(world: int) -> None:
    lengths = [5, 0, 7, 2][:world]
    topo = Topology.from_spec(f"local:ranks={world}")
    schedule = build_schedule("ring", topo, DecodeWorkload("debug", sum(lengths),
                                                           shard_lengths=tuple(lengths)))
    sizes = wire.kv_message_lengths(schedule, lengths)
    # rank r's i-th receive carries the shard of rank (r - 1 - i) mod p
    for r, steps in enumerate(schedule.steps):
        recvs = [i for i, s in enumerate(steps) if type(s).__name__ == "Recv"]
        assert [sizes[(r, i)] for i in recvs] == [
            lengths[(r - 1 - j) % world] for j in range(world - 1)
        ]


@given(st.floats(1e-6, 1e-3), st.floats(1e8, 1e11))
@settings(max_examples=40, deadline=None)
def test_latency_bandwidth_fit_recovers_exact_data(alpha: float, beta: float) -> None:
    from treeattn.testbed.calibration.calibrate import fit_latency_bandwidth

    sizes = [4, 4096, 1 << 20, 1 << 24, 1 << 26]
    a, b = fit_latency_bandwidth(sizes, [alpha + n / beta for n in sizes])
    assert a == pytest.approx(alpha, rel=1e-6) and b == pytest.approx(beta, rel=1e-6)
    with pytest.raises(RuntimeFailure):
        fit_latency_bandwidth(sizes, [alpha] * len(sizes))


def test_geo_mean_error_is_symmetric_in_over_and_under_prediction() -> None:
    from treeattn.runtime.measure.check import geo_mean_error

    points = [{"measured_s": 1.0, "predicted_s": 2.0}, {"measured_s": 2.0, "predicted_s": 1.0},
              {"measured_s": 1.0, "predicted_s": None}]
    assert geo_mean_error(points) == pytest.approx(1.0)
    assert geo_mean_error([{"measured_s": 3.0, "predicted_s": 3.0}]) == 0.0
    assert geo_mean_error([]) is None
