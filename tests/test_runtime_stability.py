"""Stable predictions: the band a point passes in, robust calibration fits, and a real
``run --check`` point's bands.

Nothing here asserts a wall-clock value: the band function gets synthetic numbers, the fits
get synthetic timings, and the real point is held to the internal consistency of its bands.
Whether repeated calibrations predict alike is a property of the machine's noise as much as
of the estimator, so it is measured and reported against its target by
``benchmarks/repeatability.py``, not asserted here on a shared 2-core box.
"""

from __future__ import annotations

import json

import pytest

from treeattn.runtime.measure.check import RunRequest, mark_bands, point_error, within_band
from treeattn.runtime.measure.fitting import fit_latency_bandwidth, latency_bandwidth

# -- the band -------------------------------------------------------------------------------

@pytest.mark.parametrize("predicted, p10, p90, max_error, expected", [
    (1.00, 0.9, 1.1, 0.0, True),     # inside the band itself
    (0.90, 0.9, 1.1, 0.0, True),     # on its edges
    (1.10, 0.9, 1.1, 0.0, True),
    (1.11, 0.9, 1.1, 0.0, False),    # just above, no widening
    (1.375, 0.9, 1.1, 0.25, True),   # p90 × 1.25
    (1.38, 0.9, 1.1, 0.25, False),
    (0.72, 0.9, 1.1, 0.25, True),    # p10 / 1.25
    (0.71, 0.9, 1.1, 0.25, False),
    (5.0, 1.0, 4.0, 0.25, True),     # a wide measured band forgives more
    (5.0, 1.0, 1.2, 0.25, False),    # ... a narrow one less, at the same median error
])
def test_within_band_on_synthetic_numbers(predicted, p10, p90, max_error, expected) -> None:
    assert within_band(predicted, p10, p90, max_error) is expected


@pytest.mark.parametrize("p10, p90, max_error", [(0.0, 1.0, 0.1), (2.0, 1.0, 0.1),
                                                 (1.0, 2.0, -0.1)])
def test_within_band_rejects_a_malformed_band(p10, p90, max_error) -> None:
    with pytest.raises(ValueError):
        within_band(1.0, p10, p90, max_error)


def test_mark_bands_leaves_unpredicted_points_alone() -> None:
    points = [{"predicted_s": 1.2, "measured_p10_s": 0.9, "measured_p90_s": 1.0},
              {"predicted_s": 2.0, "measured_p10_s": 0.9, "measured_p90_s": 1.0},
              {"predicted_s": None, "measured_p10_s": 0.9, "measured_p90_s": 1.0}]
    assert [p["within_band"] for p in mark_bands(points, 0.25)] == [True, False, None]
    # the band passes a point whose median error alone would fail it: the run was noisy
    noisy = {"predicted_s": 1.3, "measured_p10_s": 1.0, "measured_p90_s": 1.1}
    assert point_error(1.3, 1.0) > 0.25 and mark_bands([noisy], 0.25)[0]["within_band"]


# -- the fits ---------------------------------------------------------------------------------

def test_robust_bandwidth_holds_where_a_weighted_fit_extrapolates_badly() -> None:
    """Loaded-host timings: ms noise at small sizes, one slow mid-size point. The profile's
    estimator (β from the largest sizes) stays at the true rate; the old 1/t-weighted fit's
    slope, extrapolated to 1 GiB, does not (what made the issue's predictions jump)."""
    beta, alpha = 0.75e9, 5e-5
    sizes = [4096, 1 << 20, 1 << 24, 1 << 26, 1 << 28, 1 << 30]
    times = [alpha + n / beta for n in sizes]
    times[0] += 2e-3  # scheduler noise on the smallest message
    times[2] *= 1.8  # one unlucky 16 MiB median
    a, b = latency_bandwidth(sizes, times)
    assert b == pytest.approx(beta, rel=0.02)
    _, b_fit = fit_latency_bandwidth(sizes[:4], times[:4])
    assert abs(b_fit / beta - 1) > 0.10  # the old estimator is off by more than 10%


def test_exchange_sizes_reach_the_largest_message_and_stop_at_the_cap() -> None:
    from treeattn.testbed.calibration.calibrate import EXCHANGE_CAP, EXCHANGE_SIZES, exchange_sizes

    assert exchange_sizes(None) == EXCHANGE_SIZES
    assert exchange_sizes(3 << 27)[-1] == 3 << 27
    assert exchange_sizes(EXCHANGE_CAP * 4)[-1] == EXCHANGE_CAP
    assert list(exchange_sizes(1 << 30)) == sorted(set(exchange_sizes(1 << 30)))


def test_predicted_band_brackets_the_prediction() -> None:
    from treeattn.runtime.plans import build, local_topology, shard_lengths, workload_for
    from treeattn.sim import simulate
    from treeattn.testbed.host.profiles import (
        backend_from_profile,
        hardware_from_profile,
        profile_bound,
        topology_from_profile,
    )

    profile = {"version": 1, "backend": "gloo", "world": 2, "cores": 2,
               "p2p": {"latency_s": 5e-5, "bandwidth_Bps": 2e9, "latency_spread": [0.8, 1.5],
                       "bandwidth_spread": [0.9, 1.2]},
               "exchange": {"latency_s": 6e-5, "bandwidth_Bps": 1e9,
                            "latency_spread": [0.8, 1.5], "bandwidth_spread": [0.9, 1.3]},
               "attention": {"bandwidth_Bps": 5e9, "launch_s": 1e-5, "spread": [0.95, 1.4]}}
    req = RunRequest(seq_lens=(65536,), n_heads=8, n_kv_heads=2)
    workload = workload_for(req.dims, shard_lengths(65536, 2))
    schedule = build("ring", local_topology(2), workload)

    def predict(p):
        return simulate(schedule, topology_from_profile(p, 2), workload,
                        hardware_from_profile(p), backend_from_profile(p)).makespan_s

    lo, mid, hi = (predict(profile_bound(profile, "lo")), predict(profile),
                   predict(profile_bound(profile, "hi")))
    assert lo < mid < hi
    assert json.dumps(profile_bound(profile, "lo"))  # still plain JSON


# -- a real check point -------------------------------------------------------------------

class CheckJob:
    """One ``--check`` run of ``req`` on every rank, calibrating first as the command does."""

    def __init__(self, req: RunRequest) -> None:
        self.req = req

    def __call__(self, ctx):
        from treeattn.runtime.measure.check import run_points

        return run_points(ctx, self.req)


@pytest.mark.timeout(420)
def test_a_check_point_is_priced_from_calibrated_sizes_inside_consistent_bands() -> None:
    from treeattn.runtime.launch import LaunchOptions, launch

    # ring's 64 MiB blocks: a bandwidth-bound point, priced from calibrated sizes
    req = RunRequest(seq_lens=(65536,), algorithms=("ring", "tree"), n_heads=8, n_kv_heads=2,
                     check=True, steps=3, warmup=1, min_time_s=0.0, reference=False)
    points = launch(CheckJob(req), 2, LaunchOptions(timeout_s=120.0))
    assert [p["algorithm"] for p in points] == ["ring", "tree"]
    for p in mark_bands(points, 0.25):
        assert p["predicted_lo_s"] <= p["predicted_s"] <= p["predicted_hi_s"]
        assert p["measured_p10_s"] <= p["measured_s"] <= p["measured_p90_s"]
        assert p["within_band"] is within_band(p["predicted_s"], p["measured_p10_s"],
                                               p["measured_p90_s"], 0.25)
        assert not p["profile"]["extrapolated"]  # 64 MiB blocks were calibrated



def test_one_slow_small_message_does_not_set_the_latency() -> None:
    """α is the median over the latency-bound sizes: one small size's median caught in a
    slow phase (10x) must not become the latency of every message."""
    alpha, beta = 1.5e-5, 1.3e9
    sizes = [4, 256, 4096, 65536, 1 << 20, 1 << 24]
    times = [alpha + n / beta for n in sizes]
    times[0] = 10 * alpha
    a, b = latency_bandwidth(sizes, times)
    assert a == pytest.approx(alpha, rel=0.25)
    assert b == pytest.approx(beta, rel=0.02)
