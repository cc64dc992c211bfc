"""The one-sided transports against published, measured microbenchmarks
(``benchmarks/fidelity_onesided.py``): the issue's ±30%, each miss explained, and the
published order of the kernels."""

from __future__ import annotations

from benchmark_module import load_benchmark


def _fidelity():
    return load_benchmark("fidelity_onesided")


def test_symm_mem_kernels_against_vllm_graph_replays():
    """Scored rows (CUDA-graph replays with the hardware stated: the all-reduce kernel and
    the communicator's two staging copies) within the issue's ±30%, except exactly the rows
    the report explains, and those within 50%; every row names its source, every unscored
    one says why."""
    f = _fidelity()
    rows = f.score_rows()
    scored = [r for r in rows if r["scored"]]
    assert len(scored) >= 12
    over = {(r["run"], r["kernel"], r["bytes"]) for r in scored if r["error"] > 0.30}
    assert over == set(f.MISSES), "explain each miss, and only the misses"
    assert all(r["error"] <= 0.50 for r in scored)
    for r in rows:
        assert r["url"].startswith("https://")
        assert r["scored"] or r["why_not_scored"]


def test_the_published_order_of_the_kernels_is_reproduced():
    """At every size vLLM measured both, multimem beats two-shot, published and predicted."""
    rows = _fidelity().score_rows()
    by = {}
    for r in rows:
        if r["scored"]:
            by.setdefault(r["bytes"], {})[r["kernel"]] = r
    assert by
    for pair in by.values():
        mm, two = pair["multimem"], pair["two_shot"]
        assert (mm["published_us"] < two["published_us"]) == (mm["predicted_us"]
                                                              < two["predicted_us"])
