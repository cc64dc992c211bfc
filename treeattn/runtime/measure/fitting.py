"""Turn calibration timings into model parameters: latency and bandwidth of messages.

Two estimators, for two purposes. :func:`fit_latency_bandwidth` is a least-squares fit of
``t = α + n/β`` weighted by ``1/t`` (every size counts alike in relative terms); it is right
for clean data over a wide size range, and the collectives' fits use it. On a loaded host its
slope follows whichever mid-size point was unlucky, and extrapolating it far beyond the
largest size calibrated (a ring's 1 GiB block from 64 MiB) multiplies that error, so the
message sections of the profile use :func:`latency_bandwidth` instead: α the median time of
the latency-bound sizes (up to :data:`LATENCY_BOUND_BYTES`), β the median rate over the
largest sizes, which are the sizes a bandwidth-bound step moves (the calibration extends the
sizes to the run's largest message).
"""

from __future__ import annotations

import statistics

import numpy as np

from treeattn.runtime.errors import RuntimeFailure
from treeattn.runtime.measure.timing import spread

# Messages up to this size are latency-bound: at the slowest loopback rate calibrated here
# (~1 GB/s) their bytes add at most 4 µs to a 10-50 µs latency. α is the median of their
# times rather than the smallest size's alone, which one slow phase of a shared host could
# set 10x too high (185 µs against 12-17 µs, seen in one calibration of this repository's
# 2-core box).
LATENCY_BOUND_BYTES = 4096


def fit_latency_bandwidth(sizes: list[float], times: list[float]) -> tuple[float, float]:
    """Least-squares fit of ``t = a + n/b`` weighted by ``1/t``; returns ``(a, b)``.

    >>> a, b = fit_latency_bandwidth([0, 1e6, 2e6], [1e-5, 1e-5 + 1e-3, 1e-5 + 2e-3])
    >>> round(a, 9), round(b / 1e9, 3)
    (1e-05, 1.0)
    """
    scale_n = max(float(max(sizes)), 1.0)  # scale both axes: a well-conditioned system
    n = np.asarray(sizes, dtype=float) / scale_n
    t = np.asarray(times, dtype=float)
    scale_t = max(float(t.max()), 1e-12)
    t = t / scale_t
    w = 1.0 / np.maximum(t, 1e-12)
    design = np.stack([np.ones_like(n), n], axis=1) * w[:, None]
    (a, slope), *_ = np.linalg.lstsq(design, t * w, rcond=None)
    if slope <= 1e-9:  # (normalised units) flat or falling: no bandwidth to speak of
        raise RuntimeFailure("calibration: times do not grow with size; cannot fit a bandwidth")
    a = max(float(a), 0.0) * scale_t
    slope = float(slope) * scale_t / scale_n
    if slope <= 0:
        raise RuntimeFailure("calibration: times do not grow with size; cannot fit a bandwidth")
    return a, 1.0 / slope


def latency_bandwidth(sizes: list[float], times: list[float]) -> tuple[float, float]:
    """``(α, β)`` robust to a loaded host: α the median time of the sizes up to
    :data:`LATENCY_BOUND_BYTES` (the smallest size's when it is larger), β the median of
    ``n / (t − α)`` over the sizes at least a quarter of the largest (the ones a bandwidth-
    bound step moves); falls back to :func:`fit_latency_bandwidth` when none qualifies.
    ``sizes`` ascend.

    >>> a, b = latency_bandwidth([4, 1e6, 4e6, 8e6], [1e-5, 1e-3, 4e-3 + 1e-5, 8e-3 + 1e-5])
    >>> round(a, 9), round(b / 1e9, 3)
    (1e-05, 1.0)
    >>> round(latency_bandwidth([4, 256, 4096, 8e6], [1e-5, 2e-4, 1.1e-5, 8e-3])[0], 9)
    1.1e-05
    """
    small = [t for n, t in zip(sizes, times, strict=True) if n <= LATENCY_BOUND_BYTES]
    alpha = float(statistics.median(small)) if small else float(times[0])
    top = max(sizes)
    rates = [n / (t - alpha) for n, t in zip(sizes, times, strict=True)
             if n >= top / 4 and n > sizes[0] and t > alpha]
    if not rates:
        return fit_latency_bandwidth(sizes, times)
    return alpha, float(statistics.median(rates))


def message_section(sizes: list[int], stats: list[tuple[float, float, float]]) -> dict:
    """A p2p or exchange section: robust α and β, the per-size medians and p10/p90, and the
    spreads of the latency (the latency-bound sizes) and of the bandwidth (the sizes β comes
    from)."""
    times = [s[0] for s in stats]
    latency, bandwidth = latency_bandwidth(sizes, times)
    top = max(sizes)
    return {
        "latency_s": latency,
        "bandwidth_Bps": bandwidth,
        "sizes": list(sizes),
        "times_s": times,
        "p10_s": [s[1] for s in stats],
        "p90_s": [s[2] for s in stats],
        "latency_spread": spread([s for n, s in zip(sizes, stats, strict=True)
                                  if n <= LATENCY_BOUND_BYTES] or stats[:1]),
        "bandwidth_spread": spread([s for n, s in zip(sizes, stats, strict=True)
                                    if n >= top / 4 and n > sizes[0]]),
    }
