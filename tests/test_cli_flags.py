"""Every flag of ``predict``, ``plan`` and ``generate`` takes effect or is refused, in every
mode of its command: never accepted and dropped.

The tables below say, for each flag and mode, what must happen when the flag is given a value
other than its default: ``E`` it takes effect, ``R`` it is refused with one ``error:`` line
naming it (exit 2), ``M`` it is the flag that selects the mode. The flags come from the
argparse parsers themselves, so a flag added to a command without a row here fails
:func:`test_every_flag_has_a_row`.

Planner modes are checked both ways: a refused flag ends in one line naming it, and a flag
that takes effect changes what is printed or written. ``generate``'s refusals run (they come
before any model loads); its flags that take effect are covered by the generation tests.
"""

from __future__ import annotations

import argparse
import json

import pytest

from treeattn.cli import build_parser, main

pytestmark = pytest.mark.timeout(300)

E, R, M = "effect", "refused", "mode"
BASE = ["--topology", "dgx-h100", "--model", "llama-3.1-8b", "--seq-len", "32k"]
PLANNER_MODES = {
    "predict": ["predict", *BASE],
    "predict --prefill": ["predict", "--prefill", *BASE],
    "predict --token": ["predict", "--token", *BASE],
    "plan": ["plan", *BASE],
    "plan --gpus": ["plan", "--gpus", "8", *BASE],
}
PLANNER_COLUMNS = tuple(PLANNER_MODES)
# flag -> one cell per PLANNER_COLUMNS entry; None: the mode's command has no such flag
PLANNER_TABLE = {
    "--topology":       (E, E, E, E, E),
    "--model":          (E, E, E, E, E),
    "--seq-len":        (E, E, E, E, E),
    "--batch":          (E, R, E, E, E),
    "--tp":             (E, R, E, E, R),
    "--layout":         (E, R, R, E, R),
    "--profile":        (E, E, E, E, E),
    "--nccl-env":       (E, E, E, E, E),
    "--partial-dtype":  (E, R, R, E, R),
    "--json":           (E, E, E, E, E),
    "--wide":           (E, E, E, E, E),
    "--trace":          (E, R, R, E, R),
    "--weights-dtype":  (E, R, E, E, E),
    "--kv-dtype":       (E, R, E, E, E),
    "--dcp":            (R, R, E, R, R),
    "--transport":      (E, R, E, E, E),
    "--prefill":        (E, M, R, None, None),
    "--context-tokens": (R, E, R, None, None),
    "--token":          (E, R, M, None, None),
    "--output":         (None, None, None, E, R),
    "--emit":           (None, None, None, E, R),
    "--gpus":           (None, None, None, E, E),
}
GENERATE_BASE = ["generate", "--model", "debug", "--prompt", "hi", "--max-new-tokens", "2"]
GENERATE_MODES = {
    "generate": [*GENERATE_BASE, "--nproc", "2"],
    "generate on one rank": [*GENERATE_BASE, "--nproc", "1"],
    "generate --engine hf": [*GENERATE_BASE, "--engine", "hf"],
}
GENERATE_COLUMNS = tuple(GENERATE_MODES)
GENERATE_TABLE = {
    "--nproc":          (E, M, E),
    "--prompt":         (E, E, E),
    "--chat":           (E, E, E),
    "--max-new-tokens": (E, E, E),
    "--algorithm":      (E, R, E),
    "--plan":           (E, R, E),
    "--model":          (E, E, E),
    "--verify":         (E, E, E),
    "--json":           (E, E, E),
    "--engine":         (E, E, M),
    "--cuda-graph":     (R, E, R),
    "--context-tokens": (E, E, E),
    "--prefill":        (E, R, R),
    "--timeout":        (E, R, E),
    "--topology":       (E, R, R),
    "--profile":        (E, R, R),
    "--dtype":          (E, E, R),
    "--device":         (E, E, R),
    "--temperature":    (E, E, E),
    "--top-k":          (E, E, E),
    "--top-p":          (E, E, E),
    "--seed":           (E, E, E),
}
# flag -> (a value other than the default, as argv; argv the value needs beside it, or
# mode -> that argv with "*" for the other modes)
TWO_HOSTS = ["--topology", "dgx-h100:nodes=2"]
SAMPLES = {
    # an NCCL variable that changes only send/recv messages between hosts (own buffers: LL
    # mapped, no slot post)
    "--nccl-env": (["--nccl-env", "NCCL_NET_SHARED_BUFFERS=0"],
                   {"*": TWO_HOSTS, "plan --gpus": [*TWO_HOSTS, "--gpus", "16"],
                    "predict --prefill": [*TWO_HOSTS, "--seq-len", "32"]}),
    "--partial-dtype": (["--partial-dtype", "bf16"], []),
    "--topology": (["--topology", "pcie-4090:gpus=8"], []),
    "--model": (["--model", "llama-3.2-1b"], []),
    "--seq-len": (["--seq-len", "64k"], []),
    "--batch": (["--batch", "2"], []),
    "--tp": (["--tp", "2"], []),
    "--layout": (["--layout", "head_sharded"], ["--tp", "2"]),
    "--json": (["--json"], []),
    "--wide": (["--wide"], []),
    "--weights-dtype": (["--weights-dtype", "fp8"], []),
    "--kv-dtype": (["--kv-dtype", "fp8"], []),
    "--dcp": (["--dcp", "2"], ["--topology", "dgx-h100:nodes=2", "--tp", "16"]),
    "--transport": (["--transport", "nccl"], []),
    "--prefill": (["--prefill"], []),
    "--context-tokens": (["--context-tokens", "64k"], []),
    "--token": (["--token"], []),
    "--emit": (["--emit", "vllm"], ["--topology", "dgx-h100:nodes=2", "--tp", "8"]),
    "--gpus": (["--gpus", "4"], []),
    # generate
    "--nproc": (["--nproc", "3"], []),
    "--prompt": (["--prompt", "hello"], []),
    "--chat": (["--chat"], []),
    "--max-new-tokens": (["--max-new-tokens", "3"], []),
    "--algorithm": (["--algorithm", "ring"], []),
    "--verify": (["--verify"], []),
    "--engine": (["--engine", "hf"], []),
    "--cuda-graph": (["--cuda-graph"], []),
    "--timeout": (["--timeout", "30"], []),
    "--dtype": (["--dtype", "bf16"], []),
    "--device": (["--device", "cuda"], []),
    "--temperature": (["--temperature", "0.5"], []),
    "--top-k": (["--top-k", "5"], []),
    "--top-p": (["--top-p", "0.5"], []),
    "--seed": (["--seed", "3"], []),
}
FILE_FLAGS = ("--trace", "--output", "--plan")  # take a path: sampled in tmp_path
# (flag, mode) whose effect the printed record cannot show, and why
UNSEEN = {("--nccl-env", "predict --token"): "the variable changes send/recv between hosts; "
          "a whole step shows only its merge's winner, a collective at every size tried"}
COMMANDS = {"predict": PLANNER_TABLE, "plan": PLANNER_TABLE, "generate": GENERATE_TABLE}


def _parser_flags(command: str) -> set[str]:
    """The longest option string of every optional flag of ``command``'s parser."""
    parser = build_parser(command)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {max(a.option_strings, key=len) for a in sub.choices[command]._actions
            if a.option_strings and a.default is not argparse.SUPPRESS}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_flag_has_a_row(command):
    table = COMMANDS[command]
    columns = PLANNER_COLUMNS if table is PLANNER_TABLE else GENERATE_COLUMNS
    rows = {flag for flag, cells in table.items()
            if any(cell is not None for mode, cell in zip(columns, cells, strict=True)
                   if mode.split()[0] == command)}
    flags = _parser_flags(command)
    assert flags - rows == set(), f"flags of {command} with no row: decide E or R per mode"
    assert rows - flags == set(), f"rows for flags that {command} no longer has"
    assert all(flag in SAMPLES or flag in FILE_FLAGS or flag == "--profile" for flag in flags)


@pytest.fixture(scope="module")
def profile(tmp_path_factory):
    """A calibration of dgx-h100's collectives from a published 8-GPU nccl-tests table."""
    from pathlib import Path

    path = tmp_path_factory.mktemp("profile") / "h100.json"
    table = Path(__file__).parent / "fixtures" / "nccl-tests" / \
        "h100-1node-all-reduce-perf-large-issue290.txt"
    assert main(["calibrate", "--nccl-tests", str(table), "--topology", "dgx-h100", "-o",
                 str(path)]) == 0
    return path


def _sample(flag: str, tmp_path, profile_path) -> tuple[list[str], list[str]]:
    if flag in FILE_FLAGS:
        return [flag, str(tmp_path / f"out{flag}.json")], []
    if flag == "--profile":
        return ["--profile", str(profile_path)], []
    return SAMPLES[flag]


def _run(capsys, argv: list[str]) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def _assert_refused(capsys, argv: list[str], flag: str) -> None:
    code, out, err = _run(capsys, argv)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (argv, err)
    assert flag in lines[0], (argv, lines[0])


def _written(tmp_path) -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(tmp_path.glob("out*"))}


def _cells(table, columns):
    return [(flag, mode, cell) for flag, cells in table.items()
            for mode, cell in zip(columns, cells, strict=True) if cell in (E, R)]


@pytest.mark.parametrize("flag, mode, cell", _cells(PLANNER_TABLE, PLANNER_COLUMNS))
def test_planner_flag_takes_effect_or_is_refused(flag, mode, cell, tmp_path, capsys,
                                                 monkeypatch, profile):
    monkeypatch.setenv("COLUMNS", "40")  # narrow enough that --wide shows more
    sample, needs = _sample(flag, tmp_path, profile)
    if isinstance(needs, dict):
        needs = needs.get(mode, needs["*"])
    base = PLANNER_MODES[mode] + needs
    if cell == R:
        _assert_refused(capsys, base + sample, flag)
        return
    # compare the full record (JSON) unless the flag is about the form of the output
    form = [] if flag in ("--json", "--wide") else ["--json"]
    code, before, err = _run(capsys, base + form)
    assert code == 0, err
    assert _written(tmp_path) == {}
    code, after, err = _run(capsys, base + form + sample)
    assert code == 0, (flag, mode, err)
    if (flag, mode) in UNSEEN:
        return
    assert after != before or _written(tmp_path), f"{flag} changed nothing in {mode}"


@pytest.mark.parametrize("flag, mode", [(f, m) for f, m, c in
                                        _cells(GENERATE_TABLE, GENERATE_COLUMNS) if c == R])
def test_generate_flag_is_refused(flag, mode, tmp_path, capsys, profile):
    sample, needs = _sample(flag, tmp_path, profile)
    _assert_refused(capsys, GENERATE_MODES[mode] + needs + sample, flag)


def test_plan_gpus_refuses_a_profile_of_other_gpus(capsys, profile):
    argv = ["plan", "--gpus", "4", *BASE, "--profile"]
    _assert_refused(capsys, argv + [str(profile)], "--profile")
    _assert_refused(capsys, argv + ["/nonexistent/profile.json"], "--profile")


def test_a_plan_file_refuses_the_flags_that_pick_another_merge(tmp_path, capsys):
    plan = tmp_path / "plan.json"
    assert main(["plan", "--topology", "local:ranks=2", "--model", "debug", "--seq-len", "64",
                 "-o", str(plan)]) == 0
    capsys.readouterr()
    argv = [*GENERATE_MODES["generate"], "--plan", str(plan)]
    _assert_refused(capsys, argv + ["--algorithm", "ring"], "--algorithm")
    _assert_refused(capsys, argv + ["--topology", "local:ranks=2"], "--topology")


@pytest.mark.parametrize("argv, flag", [
    (["predict", *BASE, "--tp", "0"], "--tp"),
    (["predict", "--token", *BASE, "--tp", "0"], "--tp"),
    (["plan", "--gpus", "8", *BASE, "--batch", "-1"], "--batch"),
    (["predict", "--token", *BASE, "--dcp", "0"], "--dcp"),
    (["plan", "--gpus", "0", *BASE], "--gpus"),
    (["predict", *BASE, "--seq-len", "9" * 400], "--seq-len"),
    (["predict", "--prefill", *BASE, "--context-tokens", "9" * 400], "--context-tokens"),
    (["plan", *BASE[:-1], "2" * 30 + "k"], "--seq-len"),
    (["predict", *BASE, *[f"--seq-len={n}k" for n in range(1, 18)]], "--seq-len"),
    (["plan", "--gpus", "4096", *BASE], "--gpus"),
    ([*GENERATE_MODES["generate"], "--timeout", "1e300"], "--timeout"),
    ([*GENERATE_MODES["generate --engine hf"], "--timeout", "1e300"], "--timeout"),
])
def test_hostile_counts_are_refused_in_one_line(argv, flag, capsys):
    _assert_refused(capsys, argv, flag)


def test_an_empty_prompt_through_the_hf_engine_is_refused(capsys):
    code, _, err = _run(capsys, ["generate", "--engine", "hf", "--prompt", " "])
    assert code == 2 and err.strip() == "error: the prompt is empty"


def test_the_bounds_hold_at_their_edge(capsys):
    """The largest accepted token count and search are still answered, not refused."""
    code, out, err = _run(capsys, ["predict", "--prefill", "--topology", "pcie-4090:gpus=2",
                                   "--model", "debug", "--seq-len", str(1 << 40), "--json"])
    assert code == 0, err
    assert json.loads(out)["rows"]
