"""Ranks given different plans, shapes or dtypes are stopped at setup, the ranks named."""

from __future__ import annotations

import pytest

from treeattn.runtime import RankLost
from treeattn.runtime.agreement import agree_at_setup
from treeattn.runtime.launch import LaunchOptions, launch


class SetupJob:
    """Rank ``odd`` gets its own dtype (and its own plan when ``plans``): as ranks started
    by torchrun on two hosts with different files would."""

    def __init__(self, odd: int | None, plans: bool = False) -> None:
        self.odd, self.plans = odd, plans

    def __call__(self, ctx):
        differs = ctx.rank == self.odd
        agree_at_setup(ctx, plan={"steps": [ctx.rank]} if self.plans and differs else {"x": 1},
                       shapes=(1, 4, 2, 16), dtype="bfloat16" if differs else "float32")
        return "agreed"


@pytest.mark.timeout(180)
def test_disagreeing_ranks_are_named():
    """(Agreeing ranks run on: every run and generate test passes through the same check.)"""
    with pytest.raises(RankLost) as info:
        launch(SetupJob(1, plans=True), 2, LaunchOptions(timeout_s=20.0, deadline_s=120))
    text = str(info.value)
    assert "rank(s) 1 disagree with rank 0 at setup on dtype (rank 1); plan (rank 1)" in text
    assert "\n" not in text


def test_run_maps_a_disagreement_to_exit_status_1():
    from treeattn.commands.run import EXIT_RUN_FAILED, guarded
    from treeattn.runtime.agreement import RanksDisagree

    def handler(args):
        raise RanksDisagree("rank(s) 1 disagree with rank 0 at setup on plan (rank 1)")

    assert guarded(handler)(None) == EXIT_RUN_FAILED
