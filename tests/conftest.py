"""Suite-wide collection rules and fixtures."""

from __future__ import annotations

import os
import sys

import pytest

SUBPROCESS_RUNNER = "test_triton_kernels_in_interpreter_subprocess"


def pytest_collection_modifyitems(config, items):
    """Outside the Triton interpreter, the in-place Triton tests are not collected: their
    runner test executes them all in a child pytest with ``TRITON_INTERPRET=1`` (see
    ``tests/test_kernels_triton.py``), so listing them here as skipped would only mislead."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return
    kept, moved = [], []
    for item in items:
        in_triton_file = item.path.name == "test_kernels_triton.py"
        (moved if in_triton_file and item.originalname != SUBPROCESS_RUNNER else kept).append(item)
    if moved:
        config.hook.pytest_deselected(items=moved)
        items[:] = kept


@pytest.fixture(autouse=True, scope="session")
def _test_bed_plugged_in():
    """The suite runs its ranks as the CLI does: with the CPU test bed's transport plugged
    in (tests that need the bare process group unplug it themselves)."""
    from treeattn import testbed

    testbed.plug_in()
    yield


@pytest.fixture(scope="module")
def dgx():
    """The group NCCL's cost model is most often checked on: one DGX H100, all 8 GPUs."""
    from treeattn.sim.nccl.group_shape import GroupShape
    from treeattn.topo import Topology

    return GroupShape.of(Topology.from_spec("dgx-h100"), range(8))


@pytest.fixture
def rank_starts(monkeypatch) -> list:
    """Every local launch of ranks in this test, recorded instead of started: a test of input
    refused "before any rank starts" asserts the list stays empty (a count, not a clock)."""
    from treeattn.runtime import launch

    started: list = []
    monkeypatch.setattr(launch, "_launch_once", lambda job, world, *rest: started.append(
        (job, world)))
    return started


@pytest.fixture(autouse=True)
def warm_ranks(request, monkeypatch) -> None:
    """Launched ranks run on this session's warm group of their world size
    (``tests/rank_pool.py``), not on fresh processes; tests of the launcher itself are marked
    ``fresh_ranks`` and start them as ``treeattn run`` does. ``TREEATTN_TEST_FRESH_RANKS=1``
    starts fresh ranks everywhere (to compare, or to rule the warm groups out)."""
    if request.node.get_closest_marker("fresh_ranks") or os.environ.get(
            "TREEATTN_TEST_FRESH_RANKS") == "1":
        return
    try:
        from treeattn.runtime import launch
    except ImportError:  # no torch: nothing here launches ranks
        return
    import rank_pool

    monkeypatch.setattr(launch, "_launch_once", rank_pool.launch_once_warm(launch._launch_once))


def pytest_sessionfinish(session, exitstatus):
    """Stop the warm rank groups (``tests/rank_pool.py``) the session started."""
    pools = sys.modules.get("rank_pool")
    if pools is not None:
        pools.close_pools()
