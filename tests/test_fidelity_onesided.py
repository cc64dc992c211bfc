"""The one-sided transports against published, measured microbenchmarks
(``benchmarks/fidelity_onesided.py``): the issue's ±30%, each miss explained, and the
published order of the kernels."""

from __future__ import annotations

import pytest
from benchmark_module import load_benchmark


def _fidelity():
    return load_benchmark("fidelity_onesided")


def test_symm_mem_kernels_against_vllm_graph_replays():
    """Scored rows of torch's kernels (CUDA-graph replays with the hardware stated: the
    all-reduce kernel and the communicator's two staging copies) within the issue's ±30% or
    a named miss, and all within ±40%;
    every scored miss of any row explained, and every explanation a miss; every row names
    its source, every unscored one says why."""
    f = _fidelity()
    rows = f.score_rows()
    scored = [r for r in rows if r["scored"]]
    torch_rows = [r for r in scored if r["priced_as"] == r["kernel"]]
    assert len(torch_rows) >= 27
    assert all(r["error"] <= f.TARGET or r["miss"] for r in torch_rows)
    assert all(r["error"] <= 0.40 for r in torch_rows)
    over = {(r["run"], r["kernel"]) for r in scored if r["error"] > f.TARGET}
    assert over == set(f.MISSES), "explain each miss, and only the misses"
    for r in rows:
        assert r["url"].startswith("https://")
        assert r["scored"] or r["why_not_scored"]


def test_a_constants_source_is_shown_not_scored():
    """The two published kernels the graph-replay fractions come from (SGLang PR #2904's
    2-rank 512 B row, nccl-tests issue #333's B200 row) are priced, shown, and not scored;
    the model reproduces them, as it must."""
    rows = _fidelity().score_rows()
    sources = [r for r in rows if "source of" in (r["why_not_scored"] or "")]
    assert {(r["run"], r["bytes"]) for r in sources} == {("sglang-2904-h100-tp2", 512),
                                                         ("nccl-tests-333-b200", 8)}
    assert not any(r["scored"] for r in sources)
    one_shot = next(r for r in sources if r["run"].startswith("sglang"))
    # 3.7 µs, and 512 B loaded by one block of 512 threads, a 16-byte load each in flight
    # per NVLink round trip (2 x NCCL's 0.6 µs hop)
    want = 3.7 + 512 / (512 * 16 / 1.2)
    assert one_shot["predicted_us"] == pytest.approx(want, abs=1e-3)


def test_engines_one_stage_kernels_at_megabytes_and_their_two_stage_misses():
    """vLLM's one-stage kernel priced as torch's one-shot holds within ±30% at 0.5-4 MiB on
    4 and 6 H100s; its two-stage kernel is slower than the two-shot price at every size
    (the report's explained misses), never faster."""
    rows = [r for r in _fidelity().score_rows() if r["run"].endswith("custom-ar")]
    one = [r for r in rows if r["kernel"] == "ca_1stage"]
    two = [r for r in rows if r["kernel"] == "ca_2stage"]
    assert len(one) == len(two) == 12
    assert all(r["error"] <= 0.30 for r in one)
    assert all(r["ratio"] < 1 for r in two)


def test_the_published_order_of_the_kernels_is_reproduced():
    """Wherever vLLM measured multimem ahead of two-shot (every size on 6 ranks, up to
    1 MiB on 4), the prediction has it ahead too; where two-shot was ahead (4 ranks, 1.5 MiB
    and up) the prediction keeps multimem ahead, and the report says so."""
    f = _fidelity()
    rows = f.score_rows()
    by = {}
    for r in rows:
        if r["scored"] and r["kernel"] in ("multimem", "two_shot"):
            by.setdefault((r["run"], r["bytes"]), {})[r["kernel"]] = r
    assert by
    reversed_at = set()
    for key, pair in by.items():
        if len(pair) < 2:
            continue  # a run that timed one of the two (two ranks have no multimem)
        mm, two = pair["multimem"], pair["two_shot"]
        assert mm["predicted_us"] < two["predicted_us"]
        if mm["published_us"] >= two["published_us"]:
            reversed_at.add(key)
    assert reversed_at == {("vllm-24111-h100-tp4", b) for b in (1572864, 2097152, 3145728,
                                                                4194304)}
    assert "two-shot" in f.ORDER_MISS and "4 ranks" in f.ORDER_MISS
