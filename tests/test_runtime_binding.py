"""Pinning local ranks to cores: which CPUs each rank gets, and that launched ranks get them."""

from __future__ import annotations

import os
from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from treeattn.runtime.errors import RuntimeFailure
from treeattn.runtime.launch import LaunchOptions, launch
from treeattn.testbed.transport.binding import (
    GROUP_CPUS_ENV,
    available_cpus,
    cpus_for_rank,
    group_cores,
    group_cpus,
    resolve_bind,
)

linux_only = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux affinity")

pytestmark = pytest.mark.fresh_ranks  # the launcher's own pinning


@given(cpus=st.lists(st.integers(0, 255), min_size=1, max_size=16, unique=True),
       world=st.integers(1, 16), threads=st.integers(1, 8))
def test_ranks_get_their_share_of_the_cpus(cpus, world, threads):
    cpus = sorted(cpus)
    given_out = [cpus_for_rank(r, threads, cpus) for r in range(world)]
    width = min(threads, len(cpus))
    for mine in given_out:
        assert len(mine) == width and set(mine) <= set(cpus)
    load = Counter(c for mine in given_out for c in mine)
    if world * width <= len(cpus):  # room for everyone: nobody shares
        assert max(load.values()) == 1
    else:  # round-robin: no CPU carries more than one rank beyond any other
        assert max(load.values()) - min(load.get(c, 0) for c in cpus) <= 1


def test_the_group_cpus_come_from_the_launcher(monkeypatch):
    monkeypatch.setenv(GROUP_CPUS_ENV, "3,1,2")
    assert group_cpus() == [1, 2, 3] and group_cores() == 3
    for junk in ("", "x,y", " , "):
        monkeypatch.setenv(GROUP_CPUS_ENV, junk)
        assert group_cpus() == available_cpus()


def _placement(ctx):
    from treeattn.testbed.transport.binding import group_cores

    return ctx.rank, sorted(os.sched_getaffinity(0)), group_cores()


def _all_placements(ctx):
    from treeattn.runtime.group import all_gather_objects

    return all_gather_objects(ctx, _placement(ctx))


@linux_only
@pytest.mark.timeout(120)
def test_launched_ranks_are_pinned_round_robin_and_know_the_group_size():
    cpus = available_cpus()
    world = 4
    placements = launch(_all_placements, world, LaunchOptions(timeout_s=30, bind="cores"))
    for rank, mine, cores in placements:
        assert mine == [cpus[rank % len(cpus)]]
        assert cores == len(cpus)  # not the single core the rank now sees


@linux_only
@pytest.mark.timeout(120)
def test_bind_none_leaves_placement_to_linux():
    placements = launch(_all_placements, 2, LaunchOptions(timeout_s=30, bind="none"))
    assert all(mine == available_cpus() for _, mine, _ in placements)


@given(world=st.integers(1, 64), threads=st.integers(1, 8), cpus=st.integers(1, 64))
def test_auto_pins_exactly_when_the_threads_outnumber_the_cpus(world, threads, cpus):
    assert (resolve_bind("auto", world, threads, cpus) == "cores") == (world * threads > cpus)
    assert resolve_bind("cores", world, threads, cpus) == "cores"
    assert resolve_bind("none", world, threads, cpus) == "none"


def test_an_unknown_bind_is_refused_before_anything_starts():
    with pytest.raises(RuntimeFailure, match="--bind"):
        launch(_placement, 2, LaunchOptions(bind="sockets"))


def test_the_cli_offers_bind(capsys):
    from treeattn.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["run", "--nproc", "2", "--seq-len", "1k", "--bind", "sockets"])
    assert exit_info.value.code == 2
    assert "--bind" in capsys.readouterr().err
