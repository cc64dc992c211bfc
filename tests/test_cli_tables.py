"""Every table command fits an 80-column terminal with its key cells whole.

Each command is rendered at widths 80 and 200 (rich takes the width from ``COLUMNS`` when
output is not a terminal). The key cells are taken from the command's own ``--json`` output
or from the rows the test builds, never from the table code, and must appear unbroken on
one line: no ellipsis, no fold.
"""

from __future__ import annotations

import io
import json
import re

import pytest
from rich.console import Console

from treeattn.cli import main
from treeattn.commands.tables import Column, fitted_columns, print_table

WIDTHS = (80, 200)
TIME = re.compile(r"\d[\d,]*\.\d+ (µs|ms)")
SPEEDUP = re.compile(r"\d+\.\d\d×")


def run_cli(capsys, monkeypatch, width: int, *argv: str) -> str:
    monkeypatch.setenv("COLUMNS", str(width))
    capsys.readouterr()
    assert main(list(argv)) == 0
    return capsys.readouterr().out


def lines_with(text: str, needle: str) -> list[str]:
    return [line for line in text.splitlines() if needle in line]


def assert_fits(text: str, width: int) -> None:
    assert "…" not in text
    table_lines = [line for line in text.splitlines() if line[:1] in "┏┃┡│└"]
    assert table_lines, text
    assert max(len(line) for line in table_lines) <= width


@pytest.mark.parametrize("width", WIDTHS)
def test_predict_keeps_algorithm_time_and_speedup_whole(capsys, monkeypatch, width):
    argv = ("predict", "--topology", "dgx-h100:nodes=2", "--model", "llama-3.1-405b",
            "--seq-len", "128k", "--tp", "8")
    rows = json.loads(run_cli(capsys, monkeypatch, width, *argv, "--json"))["rows"]
    text = run_cli(capsys, monkeypatch, width, *argv)
    assert_fits(text, width)
    for r in rows:
        line = next(line for line in lines_with(text, f" {r['algorithm']} ") if "│" in line)
        assert TIME.search(line), line
        assert f"{r['speedup_vs_best_baseline']:.2f}×" in line, line
    if width == 80:
        assert "--wide shows them" in text
    else:
        assert "left out" not in text


def test_predict_wide_shows_every_column_at_80(capsys, monkeypatch):
    argv = ("predict", "--topology", "dgx-h100:nodes=2", "--model", "llama-3.1-8b",
            "--seq-len", "32k", "--wide")
    text = run_cli(capsys, monkeypatch, 80, *argv)
    for header in ("plan", "system", "vs ring pass-KV", "peak mem", "comm", "token"):
        assert header in text
    assert "left out" not in text


@pytest.mark.parametrize("width", WIDTHS)
def test_plan_candidates_whole(capsys, monkeypatch, width):
    argv = ("plan", "--topology", "dgx-h100:nodes=2", "--model", "llama-3.1-8b",
            "--seq-len", "64k")
    record = json.loads(run_cli(capsys, monkeypatch, width, *argv, "--json"))
    text = run_cli(capsys, monkeypatch, width, *argv)
    assert "…" not in text
    assert record["name"] in text


@pytest.mark.parametrize("width", WIDTHS)
def test_comm_keeps_size_time_algorithm_protocol(capsys, monkeypatch, width):
    argv = ("comm", "--topology", "dgx-h100:nodes=2", "--op", "all_reduce",
            "--max-bytes", "1M")
    rows = json.loads(run_cli(capsys, monkeypatch, width, *argv, "--json"))["rows"]
    text = run_cli(capsys, monkeypatch, width, *argv)
    assert_fits(text, width)
    for r in rows:
        line = next(line for line in lines_with(text, f" {r['bytes']} ") if "│" in line)
        assert f"{r['time_us']:.2f}" in line and r["algorithm"] in line, line


@pytest.mark.parametrize("width", WIDTHS)
def test_run_points_table(width):
    from treeattn.commands.run import print_points

    point = {"algorithm": "butterfly", "world": 4, "seq_len": 65536, "measured_s": 0.0123,
             "measured_p10_s": 0.0101, "measured_p90_s": 0.0150, "predicted_s": 0.0119,
             "predicted_lo_s": 0.0110, "predicted_hi_s": 0.0131, "error": -0.033,
             "within_band": True, "max_abs_diff": 1.2e-7, "bytes_sent": [1 << 20] * 4,
             "peak_memory_bytes": [64 << 20] * 4, "steps_timed": 12}
    out = io.StringIO()
    print_points(Console(file=out, width=width), [point, {**point, "algorithm": "ring"}])
    text = out.getvalue()
    assert_fits(text, width)
    assert ("10.100-15.000" in text) == (width == 200)
    for name in ("butterfly", "ring"):
        line = next(line for line in lines_with(text, f" {name} ") if "│" in line)
        for cell in ("65536", "12.300", "11.900", "-3.3%", "yes"):
            assert cell in line, line


@pytest.mark.parametrize("width", WIDTHS)
def test_topo_tables(capsys, monkeypatch, width):
    from treeattn.commands.topo import DEMO_SPECS, demo_section

    out = io.StringIO()
    demo_section(Console(file=out, width=width))
    text = out.getvalue()
    assert_fits(text, width)
    for spec in DEMO_SPECS:
        assert lines_with(text, f" {spec} "), spec
    shown = run_cli(capsys, monkeypatch, width, "topo", "show", "dgx-h100:nodes=2")
    assert "…" not in shown and "16" in shown


def test_fitting_drops_non_key_columns_last_declared_first():
    columns = [Column("name", key=True), Column("a"), Column("b"), Column("t", key=True)]
    rows = [["tree", "x" * 40, "y" * 40, "1.0 µs"]]
    assert fitted_columns(columns, rows, 200) == [0, 1, 2, 3]
    assert fitted_columns(columns, rows, 70) == [0, 1, 3]
    assert fitted_columns(columns, rows, 30) == [0, 3]
    out = io.StringIO()
    print_table(Console(file=out, width=30), columns, rows)
    text = out.getvalue()
    assert "tree" in text and "1.0 µs" in text and "x" * 40 not in text
    assert "2 columns left out to fit 30 columns: a, b; --wide shows them" in " ".join(
        text.split())


def test_key_columns_wider_than_the_terminal_overflow_instead_of_cutting():
    columns = [Column("plan", key=True), Column("time", key=True)]
    rows = [["butterfly(radix=2,levels=hosts>gpus)" * 2, "12,345.6 µs"]]
    out = io.StringIO()
    print_table(Console(file=out, width=40), columns, rows)
    assert rows[0][0] in out.getvalue() and "12,345.6 µs" in out.getvalue()


@pytest.mark.parametrize("width", WIDTHS)
def test_prefill_and_token_tables_keep_their_key_cells(capsys, monkeypatch, width):
    prefill = ("predict", "--prefill", "--topology", "dgx-h100:nodes=2", "--model",
               "llama-3.1-8b", "--seq-len", "256k")
    rows = json.loads(run_cli(capsys, monkeypatch, width, *prefill, "--json"))["rows"]
    text = run_cli(capsys, monkeypatch, width, *prefill)
    assert_fits(text, width)
    for r in rows:
        assert lines_with(text, f" {r['algorithm']} "), r["algorithm"]
    token = ("predict", "--token", "--topology", "dgx-h100:nodes=2", "--model",
             "llama-3.1-70b", "--seq-len", "128k", "--tp", "8")
    rows = json.loads(run_cli(capsys, monkeypatch, width, *token, "--json"))["rows"]
    text = run_cli(capsys, monkeypatch, width, *token)
    assert_fits(text, width)
    for r in rows:
        assert f"{r['seq_len']:,}" in text
