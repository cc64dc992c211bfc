"""Sizes that cannot fit in memory are refused before any rank starts, in one line.

``--seq-len 2^63``, ``--batch 10^6`` or ``--head-dim 10^9`` used to reach the ranks, which
crashed while allocating (a traceback, or the OOM killer). The check compares the bytes the
KV caches need with what the machine has (``/proc/meminfo`` MemAvailable, or the GPU's free
memory) and names both.
"""

from __future__ import annotations

import pytest

from treeattn.cli import main

RUN = ["run", "--nproc", "2", "--heads", "4", "--kv-heads", "2", "--device", "cpu"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("extra", [
    ["--seq-len", str(2**40)],  # the largest count the flag takes
    ["--seq-len", "1024", "--batch", str(10**6)],
    ["--seq-len", "1024", "--head-dim", str(10**9)],
])
def test_run_refuses_sizes_that_cannot_fit(extra, capsys, rank_starts):
    assert main(RUN + extra) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs about" in err[0] and "is available" in err[0], err
    assert rank_starts == []  # refused before any rank started


@pytest.mark.timeout(60)
def test_generate_refuses_a_context_that_cannot_fit(capsys, rank_starts):
    argv = ["generate", "--nproc", "2", "--model", "debug", "--prompt", "hi",
            "--context-tokens", "4096M"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs about" in err[0] and "of RAM is available" in err[0], err
    assert rank_starts == []


def test_small_memory_is_reported_with_both_sizes(monkeypatch):
    from treeattn.runtime import plans
    from treeattn.runtime.errors import RuntimeFailure

    monkeypatch.setattr(plans, "available_memory_bytes", lambda cuda=False: (1 << 30, "RAM"))
    with pytest.raises(RuntimeFailure, match=r"needs about 2\.0 GiB, but only 1\.0 GiB of RAM"):
        plans.check_fits(2 << 30, "this run")
    plans.check_fits(1 << 20, "this run")
