"""RCCL's collective model on MI300X: its own tables, its correction factors (which choose
but do not price), the protocol it forces by size, and the MSCCL all-pairs schedule.

Expected values are worked by hand from RCCL's source (named in each test).
"""

from __future__ import annotations

import pytest

from treeattn.sim.nccl import tables as T
from treeattn.sim.nccl.collectives import (
    GroupShape,
    candidates,
    collective_cost,
)
from treeattn.topo import Topology

_TOPOLOGIES: dict[str, Topology] = {}


def _topology(spec: str) -> Topology:
    if spec not in _TOPOLOGIES:
        _TOPOLOGIES[spec] = Topology.from_spec(spec)
    return _TOPOLOGIES[spec]


def test_rccl_on_mi300x_uses_its_own_tables():
    shape = GroupShape.of(Topology.from_spec("mi300x"), range(8))
    # RCCL: base 12.0 + 14 xGMI hops * 0.8 us = 23.2 us; LL128 off.
    best = collective_cost("all_reduce", 8, shape)
    assert best.latency_s == pytest.approx(23.2e-6)
    assert all(c.protocol != "LL128" for c in candidates("all_reduce", 1 << 20, shape))


def test_rccl_correction_factors_choose_but_do_not_price():
    """RCCL's per-size factors (tuning_model_5) rank variants; the time is the model's own.

    On 2 MI300X nodes a 128 MiB all-reduce: ring Simple's factor there is 0.1 and tree
    Simple's 0.7, so the tuner ranks ring at 10x its bandwidth time and tree at 1/0.7x. By
    hand: 16 ranks, 30 ring steps, 2 across the network; 16 channels at the 2-node per-channel
    speed, bwRatio 1.0; latency 17 + 28 * max(2.1, 3 * 2 us AMD net overhead) + 2 * 320 us.
    """
    shape = GroupShape.of(Topology.from_spec("mi300x:nodes=2"), range(16))
    nbytes = 128 << 20
    ring = collective_cost("all_reduce", nbytes, shape, algorithm="ring")
    latency_us = 17.0 + 28 * 6.0 + 2 * 320.0
    alg_bw = shape.channels * shape.intra_speed * 1.0 * 16 / 30  # GB/s
    assert ring.latency_s == pytest.approx(latency_us * 1e-6)
    assert ring.time_s == pytest.approx((latency_us + nbytes / (1000 * alg_bw)) * 1e-6)
    assert ring.choice_s == pytest.approx((latency_us + nbytes / (100 * alg_bw)) * 1e-6)
    # 32 MiB: ring Simple's factor is 0.1 and tree Simple's 1.0, so RCCL picks the tree, whose
    # own time (2-node tree Simple bwRatio 0.11) is the slower of the two
    pick = collective_cost("all_reduce", 32 << 20, shape)
    ring = collective_cost("all_reduce", 32 << 20, shape, algorithm="ring")
    assert (pick.algorithm, pick.protocol) == ("tree", "Simple")
    assert ring.time_s < pick.time_s and pick.choice_s < ring.choice_s


def test_rccl_forced_ll_makes_reduce_scatter_slower_just_below_its_limit():
    """RCCL forces LL for a one-node reduce-scatter up to a per-rank size, after its model
    chose; past that size Simple runs, and a larger message finishes sooner. The model
    keeps that, so the best time is monotone only among the same variants (above)."""
    shape = GroupShape.of(_topology("mi300x"), range(8))
    limit = 8 * T.RCCL_LL_MAX_PER_RANK_RS_ONE_NODE
    below, above = (collective_cost("reduce_scatter", n, shape) for n in (limit, 4 * limit))
    assert (below.protocol, above.protocol) == ("LL", "Simple")
    assert above.time_s < below.time_s


@pytest.fixture(scope="module")
def mi300x_msccl():
    from dataclasses import replace

    from treeattn.topo import Topology

    shape = GroupShape.of(Topology.from_spec("mi300x"), range(8))
    return shape, replace(shape, rccl_msccl=True)


def test_rccl_msccl_takes_small_all_reduces_where_its_rule_allows(mi300x_msccl):
    tuner, msccl = mi300x_msccl
    for nbytes in (1024, 4096, 65536):  # 256-float multiples up to the XML's 64 KiB
        got = collective_cost("all_reduce", nbytes, msccl)
        assert (got.algorithm, got.protocol) == ("msccl_allpairs", "LL")
        # RCCL's ring LL base (12 us) and two xGMI hops (0.8 us each), by hand
        assert got.latency_s == pytest.approx(13.6e-6)
        assert got.time_s < collective_cost("all_reduce", nbytes, tuner).time_s
    for nbytes in (8, 512, 1536, 65536 + 1024):  # below 256 floats, not a multiple, too big
        assert collective_cost("all_reduce", nbytes, msccl) == collective_cost(
            "all_reduce", nbytes, tuner)
    assert collective_cost("all_gather", 4096, msccl).algorithm != "msccl_allpairs"


def test_rccl_msccl_needs_exactly_one_8_gpu_gfx942_node():
    from dataclasses import replace

    from treeattn.topo import Topology

    for spec, ranks in (("mi300x:nodes=2", 16), ("mi300x", 4), ("dgx-h100", 8)):
        shape = replace(GroupShape.of(Topology.from_spec(spec), range(ranks)), rccl_msccl=True)
        assert collective_cost("all_reduce", 4096, shape).algorithm != "msccl_allpairs"


def test_comm_cli_prices_the_older_rccl_on_request(capsys):
    import json

    from treeattn.cli import main

    args = ["comm", "--topology", "mi300x", "--op", "all_reduce", "--min-bytes", "4K",
            "--max-bytes", "4K", "--json"]
    assert main(args) == 0
    (today,) = json.loads(capsys.readouterr().out)["rows"]
    assert main(args + ["--rccl-msccl"]) == 0
    (older,) = json.loads(capsys.readouterr().out)["rows"]
    assert today["algorithm"] == "ring" and older["algorithm"] == "msccl_allpairs"
    assert older["time_us"] < today["time_us"]
