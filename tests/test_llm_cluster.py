"""`treeattn generate` as one rank of a torchrun group gives the tokens `--nproc` gives.

Two ways of starting the group: the environment torchrun sets (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) written by hand for two subprocesses of
``python -m treeattn`` (no agent: the cheapest way to cover the rank-side code), and the
real ``torchrun --standalone`` binary with the planner choosing the algorithm for a
``--topology``. All on the tiny debug model: what is tested is how the group starts; the
real model's end-to-end run is ``test_demo_generation_section_runs``. The reference is
always the same command with ``--nproc 2`` (our own launcher), run in this process.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from treeattn.cli import main
from treeattn.runtime.launch import free_port

HARD_TIMEOUT_S = 120  # subprocess guard only; nothing asserts on wall-clock time
MODULE = [sys.executable, "-m", "treeattn", "generate"]
DEBUG = ["--model", "debug", "--prompt", "hello world", "--max-new-tokens", "6",
         "--timeout", "30"]


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


def _by_hand(args: list[str], world: int = 2) -> list[subprocess.CompletedProcess]:
    """Run ``python -m treeattn generate ARGS`` as ``world`` ranks set up like torchrun."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(_env(), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                   LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen(MODULE + args, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    done = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=HARD_TIMEOUT_S)
            done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return done


def _nproc_record(args: list[str], capsys) -> dict:
    assert main(["generate", "--nproc", "2", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("extra", [
    ["--algorithm", "tree"],
    ["--algorithm", "ring", "--temperature", "0.9", "--top-k", "40", "--seed", "7"],
], ids=["greedy-tree", "sampled-ring"])
def test_torchrun_env_ranks_give_the_nproc_tokens(extra, capsys):
    ranks = _by_hand(DEBUG + extra + ["--json"])
    assert [r.returncode for r in ranks] == [0, 0], ranks[0].stderr + ranks[1].stderr
    assert ranks[1].stdout == ""  # only rank 0 prints
    record = json.loads(ranks[0].stdout)
    ref = _nproc_record(DEBUG + extra, capsys)
    assert record["world"] == 2 and record["ranks_agree"] is True
    assert record["tokens"] == ref["tokens"] and len(ref["tokens"]) == 6
    assert record["algorithm"] == ref["algorithm"]


@pytest.mark.timeout(240)
def test_torchrun_env_rank_0_streams_the_text_and_verifies():
    ranks = _by_hand(DEBUG + ["--verify"])
    assert [r.returncode for r in ranks] == [0, 0], ranks[0].stderr + ranks[1].stderr
    assert ranks[0].stdout.strip() and ranks[1].stdout == ""
    assert "6 tokens on 2 rank(s)" in ranks[0].stderr
    assert "greedy tokens identical to single-process decoding" in ranks[0].stderr


@pytest.mark.timeout(240)
def test_torchrun_env_bad_topology_is_one_error_line_per_rank():
    ranks = _by_hand(DEBUG + ["--topology", "dgx-h100"])
    for r in ranks:
        assert r.returncode == 2
        assert r.stderr.strip().splitlines() == [
            "error: topology dgx-h100 has 8 GPUs, but the world size is 2"]


@pytest.mark.timeout(300)
def test_real_torchrun_matches_nproc_2_with_the_planner(capsys):
    """The target: `torchrun --standalone --nproc-per-node 2 -m treeattn generate` (gloo)."""
    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        torchrun = Path(shutil.which("torchrun") or "")
    if not torchrun.is_file():
        pytest.skip("torchrun is not installed next to this python")
    args = [*DEBUG, "--algorithm", "auto", "--topology", "pcie-4090:gpus=2", "--device", "cpu"]
    proc = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", "2", "-m",
                           "treeattn", "generate", *args, "--json"], env=_env(),
                          capture_output=True, text=True, timeout=HARD_TIMEOUT_S * 2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(proc.stdout)
    ref = _nproc_record(args, capsys)
    assert record["tokens"] == ref["tokens"] and len(ref["tokens"]) == 6
    assert record["algorithm"] == ref["algorithm"] and record["ranks_agree"] is True


@pytest.mark.timeout(60)
def test_topology_size_must_equal_the_world(capsys):
    status = main(["generate", "--nproc", "2", *DEBUG, "--topology", "pcie-4090:gpus=4"])
    assert status == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: topology pcie-4090:gpus=4 has 4 GPUs, but the world size is 2"]


@pytest.mark.timeout(120)
def test_auto_on_a_topology_runs_the_planners_choice(capsys):
    record = _nproc_record(DEBUG + ["--algorithm", "auto", "--topology", "pcie-4090:gpus=2",
                                    "--verify"], capsys)
    assert record["identical_to_single_process"] is True
    assert record["algorithm"] != "auto"


@pytest.mark.timeout(60)
def test_python_dash_m_treeattn_is_the_cli():
    proc = subprocess.run([sys.executable, "-m", "treeattn", "--version"], env=_env(),
                          capture_output=True, text=True, timeout=HARD_TIMEOUT_S)
    assert proc.returncode == 0 and proc.stdout.startswith("treeattn ")
