"""The prefill pricing: its work adds up to the causal attention, overlap is bounded, CLI."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from treeattn.cli import main
from treeattn.sim.prefill.layout import PrefillLayout, causal_pairs
from treeattn.sim.prefill.pricing import PREFILL_ALGORITHMS, _Prefill, predict_prefill
from treeattn.topo import Topology


@settings(max_examples=80, deadline=None)
@given(world=st.integers(1, 8), context=st.integers(0, 30), prompt=st.integers(1, 90))
def test_blocks_attended_by_the_queries_cover_the_causal_triangle_once(world, context, prompt):
    """Summed over every (query rank, key block), the pairs are the prompt's causal pairs."""
    layout = PrefillLayout(world, context, prompt)
    total = sum(causal_pairs(q, k) for r in range(world) for j in range(world)
                for q in layout.compute(r) for k in layout.block(j))
    n = context + prompt
    assert total == n * (n + 1) // 2 - context * (context + 1) // 2
    assert total == sum(layout.pairs(r) for r in range(world))


@settings(max_examples=60, deadline=None)
@given(world=st.integers(1, 9), context=st.integers(0, 30), prompt=st.integers(1, 90))
def test_the_pair_matrix_is_the_runs_causal_pairs(world, context, prompt):
    """The pricing's vectorised (query rank, key block) pairs, against the scalar count."""
    from treeattn.sim.prefill.pricing import _pair_matrix

    layout = PrefillLayout(world, context, prompt)
    got = _pair_matrix(layout)
    for r in range(world):
        for j in range(world):
            assert got[r, j] == sum(causal_pairs(q, k) for q in layout.compute(r)
                                    for k in layout.block(j))


@pytest.mark.parametrize("spec", ["dgx-h100:nodes=2", "pcie-4090:gpus=4", "mi300x:nodes=2",
                                  "local:ranks=3"])
@pytest.mark.parametrize("nbytes", [512, 1 << 20])
def test_all_pairs_message_summaries_equal_the_per_pair_ones(spec, nbytes):
    """P2PModel.summary_matrices (one pass over the routes) gives each pair's summary."""
    from treeattn.schedule.workload import DecodeWorkload
    from treeattn.sim.network import CostModel

    topo = Topology.load(spec)
    cm = CostModel(topo, DecodeWorkload("llama-3.1-8b", 4096))
    lat, inv = cm.p2p.summary_matrices(nbytes)
    for a in range(topo.num_gpus):
        for b in range(topo.num_gpus):
            want = cm.p2p.summary(a, b, nbytes) if a != b else (0.0, 0.0)
            assert (lat[a, b], inv[a, b]) == pytest.approx(want, rel=1e-12, abs=0)


@settings(max_examples=40, deadline=None)
@given(qa=st.integers(0, 40), qn=st.integers(0, 30), ka=st.integers(0, 40),
       kn=st.integers(0, 30))
def test_causal_pairs_counts_like_brute_force(qa, qn, ka, kn):
    want = sum(1 for q in range(qa, qa + qn) for k in range(ka, ka + kn) if k <= q)
    assert causal_pairs((qa, qa + qn), (ka, ka + kn)) == want


def test_a_million_token_prefill_of_llama_8b_on_two_dgx_nodes_is_priced():
    topo = Topology.load("dgx-h100:nodes=2")
    got = predict_prefill(topo, "llama-3.1-8b", 1 << 20)
    assert sorted(p.algorithm for p in got) == sorted(PREFILL_ALGORITHMS)
    assert [p.ttft_s for p in got if p.fits] == sorted(p.ttft_s for p in got if p.fits)
    for p in got:
        assert math.isfinite(p.ttft_s) and p.ttft_s > p.layer_s > p.attention_s > 0
    by = {p.algorithm: p for p in got}
    # the 128 GiB cache split 16 ways, plus blocks in flight; all-gather holds a whole layer
    shard = (1 << 20) * 32 * 2 * 8 * 128 * 2 // 16
    assert shard < by["pass-kv"].peak_bytes < shard * 1.2
    assert by["all-gather-kv"].peak_bytes > by["pass-kv"].peak_bytes


@pytest.mark.parametrize("spec", ["dgx-h100:nodes=1", "pcie-4090:gpus=8"])
def test_the_ring_overlaps_but_never_beats_its_work_or_its_wire(spec):
    topo = Topology.load(spec)
    p = _Prefill(topo, "llama-3.1-8b", 65536)
    w = p.world
    sizes = p.block_tokens * p.per_token
    ends = p.ring(sizes, p.kv_work)
    for r in range(w):
        work = sum(p.kv_work[r, (r - s) % w] for s in range(w))
        wire = sum(float(p.messages(np.array([(r - 1) % w]), np.array([r]),
                                    np.array([sizes[(r - s - 1) % w]]))[0])
                   for s in range(w - 1))
        span = ends[r] - p.proj[r]
        assert span >= work - 1e-12 and span >= wire * 0.999
        assert span <= work + wire + max(p.proj) + 1e-9


def test_ttft_grows_with_the_prompt():
    topo = Topology.load("dgx-h100:nodes=1")
    times = [predict_prefill(topo, "llama-3.1-8b", n, algorithms=("pass-kv",))[0].ttft_s
             for n in (4096, 32768, 262144)]
    assert times == sorted(times) and times[-1] > 8 * times[0]


def test_predict_prefill_and_plan_report_the_prefill_pick(capsys):
    argv = ["--topology", "dgx-h100:nodes=2", "--model", "llama-3.1-8b", "--seq-len", "1M"]
    assert main(["predict", "--prefill", "--json", *argv]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert {r["algorithm"] for r in rows} == set(PREFILL_ALGORITHMS)
    assert main(["plan", "--json", *argv]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["prefill"][0]["algorithm"] == rows[0]["algorithm"]
    assert main(["plan", *argv]) == 0
    assert "Prefill of 1,048,576 tokens" in capsys.readouterr().out


@pytest.mark.parametrize("extra,message", [
    (["--seq-len", "0"], "at least one prompt token"),
    (["--seq-len", "4096", "--batch", "2"], "does not use --batch"),
])
def test_predict_prefill_bad_input_is_one_line_and_exit_2(extra, message, capsys):
    argv = ["predict", "--prefill", "--topology", "dgx-h100:nodes=1", "--model",
            "llama-3.1-8b", *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and message in err[0], err


def test_a_slower_attention_rate_prices_only_the_attention():
    """``HardwareModel.attention_flops`` slows the attention by its ratio to the matmul peak,
    by a hand count: with memory and wires far faster than the arithmetic, a rank's attention
    is ``4·Hq·D`` FLOPs per causal pair of its queries, at that rate; the projections and the
    rest of the layer keep the peak."""
    from treeattn.sim.devices import HardwareModel

    topo = Topology.from_spec("local:ranks=2")
    layout = PrefillLayout(2, 0, 1024)
    pairs = max(sum(causal_pairs(q, k) for q in layout.compute(r) for j in range(2)
                    for k in layout.block(j)) for r in range(2))
    flops = 4 * 9 * 64 * pairs  # smollm2-135m: 9 query heads of 64
    out = {}
    for rate in (1e11, 1e10):
        hardware = HardwareModel("cpu", memory_bandwidth_Bps=1e18, peak_flops=1e11,
                                 launch_s=0.0, attention_flops=rate if rate != 1e11 else 0.0)
        (out[rate],) = predict_prefill(topo, "smollm2-135m", 1024, hardware=hardware,
                                       algorithms=("pass-kv",))
    assert out[1e11].attention_s == pytest.approx(flops / 1e11, rel=1e-3)
    assert out[1e10].attention_s == pytest.approx(flops / 1e10, rel=1e-3)
    assert out[1e10].layer_s - out[1e11].layer_s == pytest.approx(
        out[1e10].attention_s - out[1e11].attention_s, rel=1e-3)


@pytest.mark.parametrize("spec,prompt,context", [("dgx-h100:nodes=2", 8192, 0),
                                                 ("dgx-h100:nodes=2", 300, 65536),
                                                 ("local:ranks=3", 37, 5)])
def test_pass_q_is_priced_step_by_step_as_the_runtime_runs_it(spec, prompt, context):
    """A scalar walk of the pass-Q ring (per-pair messages, per-pair work), against the
    pricing's vectorised one: query blocks from r - 1, partials back from r + s - 1."""
    from treeattn.schedule.workload import FP32

    topo = Topology.load(spec)
    p = _Prefill(topo, "llama-3.1-8b", prompt, context=context)
    m, w, lay, cm = p.m, p.world, p.layout, p.cm

    def pairs(q_of, k_of):
        return sum(causal_pairs(q, k) for q in lay.compute(q_of) for k in lay.block(k_of))

    def work(r, origin):
        n = pairs(origin, r)
        nbytes = (lay.block_length(r) * p.per_token
                  + len(lay.positions(origin, queries=True)) * m.n_heads * m.head_dim
                  * (p.item + FP32))
        return cm.hardware[r].attention_time(nbytes, 4.0 * m.n_heads * m.head_dim * n) \
            if n else 0.0

    def msg(a, b, nbytes):
        return (cm.send_cost(nbytes) + cm.wire(a, b, nbytes) + cm.recv_cost(nbytes)
                if nbytes else 0.0)

    q_bytes = [len(lay.positions(r, queries=True)) * m.n_heads * m.head_dim * p.item
               for r in range(w)]
    part = [len(lay.positions(r, queries=True)) * m.n_heads * (m.head_dim + 1) * FP32
            for r in range(w)]
    t = [float(x) for x in p.proj]
    for s in range(w + 1):
        start = list(t)
        for r in range(w):
            done = start[r] + (work(r, (r - s) % w) if s < w else 0.0)
            if s < w - 1:
                done = max(done, start[(r - 1) % w] + msg((r - 1) % w, r,
                                                          q_bytes[(r - s - 1) % w]))
            h = (r + s - 1) % w
            if s >= 1 and h != r and pairs(r, h):
                done = max(done, start[h] + msg(h, r, part[r]))
            t[r] = done
    # then each computed piece to the rank storing it, sends and receives taking turns
    def piece(k, o):
        lo, hi = lay.storage(o)
        return sum(max(0, min(b, hi) - max(a, lo)) for a, b in lay.compute(k)) * p.per_token

    def route(k, o, n):
        lat, inv = cm.p2p.summary(k, o, n)
        return lat, n * inv

    end = list(t)
    for r in range(w):
        out = [(o, piece(r, o)) for o in range(w) if o != r and piece(r, o)]
        into = [(k, piece(k, r)) for k in range(w) if k != r and piece(k, r)]
        sent = t[r] + sum(route(r, o, n)[1] for o, n in out)
        got_in = (max(t[k] + route(k, r, n)[0] + cm.send_cost(n) + cm.recv_cost(n)
                      for k, n in into) + sum(route(k, r, n)[1] for k, n in into)
                  if into else 0.0)
        end[r] = max(t[r], sent, got_in)
    got = predict_prefill(topo, "llama-3.1-8b", prompt, algorithms=("pass-q",),
                          context=context)[0]
    layer = max(end[r] + p.rest[r] for r in range(w))
    assert got.layer_s == pytest.approx(layer, rel=1e-12)
