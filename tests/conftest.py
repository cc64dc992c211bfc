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


@pytest.fixture
def rank_starts(monkeypatch) -> list:
    """Every local launch of ranks in this test, recorded instead of started: a test of input
    refused "before any rank starts" asserts the list stays empty (a count, not a clock)."""
    from treeattn.runtime import launch

    started: list = []
    monkeypatch.setattr(launch, "_launch_once", lambda job, world, *rest: started.append(
        (job, world)))
    return started


def pytest_sessionfinish(session, exitstatus):
    """Stop the warm rank groups (``tests/rank_pool.py``) the session started."""
    pools = sys.modules.get("rank_pool")
    if pools is not None:
        pools.close_pools()
