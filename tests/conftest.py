"""Suite-wide collection rules."""

from __future__ import annotations

import os

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
