"""`treeattn run` and `treeattn calibrate` from the command line: bad input, a real run."""

from __future__ import annotations

import json
import math
import socket

import pytest

from treeattn.cli import main

SMALL = ["--heads", "4", "--kv-heads", "2", "--head-dim", "16"]


def _error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err  # one line, no traceback
    assert err[0].startswith("error:")
    return err[0]


@pytest.mark.parametrize(
    "argv, words",
    [
        (["run", "--nproc", "0", "--seq-len", "64"], "--nproc"),
        (["run", "--nproc", "100000", "--seq-len", "64"], "--nproc"),
        (["run", "--nproc", "4", "--seq-len", "3"], "smaller than the world"),
        (["run", "--nproc", "2", "--seq-len", "64", "--algorithm", "spiral"], "invalid choice"),
        (["run", "--nproc", "2", "--seq-len", "64", "--profile", "/nonexistent/p.json"],
         "cannot read profile"),
        (["run", "--nproc", "2", "--seq-len", "sixty"], "not a token count"),
        (["run", "--nproc", "2", "--seq-len", "64", "--heads", "5", "--kv-heads", "2"],
         "multiple"),
        (["run", "--nproc", "1", "--seq-len", "64", "--check"], "at least 2 ranks"),
        (["run", "--nproc", "2", "--seq-len", "64", "--algorithm", "tree", "--shape", "blob"],
         "blob"),
        (["calibrate", "--nproc", "1"], "at least 2"),
        (["calibrate", "--nproc", "2", "--max-bytes", "2G"], "above the largest exchange"),
        (["calibrate", "--nproc", "2", "--max-bytes", "0"], "must be positive"),
        (["calibrate", "--nproc", "2", "--max-bytes", "lots"], "not a byte count"),
        (["run", "--nproc", "2", "--seq-len", "64", "--topology", "dgx-h100"], "8 GPUs"),
        (["run", "--nproc", "2", "--seq-len", "64", "--device", "cuda"], "CUDA"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, words, capsys) -> None:
    try:
        status = main(argv)
    except SystemExit as exc:  # argparse's own usage errors
        status = exc.code
    assert status == 2
    assert words in _error_line(capsys)


def test_unreadable_profile_contents(tmp_path, capsys) -> None:
    bad = tmp_path / "p.json"
    bad.write_text("{not json")
    assert main(["run", "--nproc", "2", "--seq-len", "64", "--profile", str(bad)]) == 2
    assert "cannot read profile" in _error_line(capsys)
    bad.write_text(json.dumps({"version": 99}))
    assert main(["run", "--nproc", "2", "--seq-len", "64", "--profile", str(bad)]) == 2
    assert "version" in _error_line(capsys)


def test_port_in_use(capsys) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        port = sock.getsockname()[1]
        assert main(["run", "--nproc", "2", "--seq-len", "64", "--port", str(port)]) == 2
    assert "in use" in _error_line(capsys)


@pytest.mark.timeout(240)
def test_run_json_reports_every_point(capsys) -> None:
    argv = ["run", "--nproc", "3", "--seq-len", "301", "--seq-len", "1k", "--algorithm", "tree",
            "--algorithm", "ring", "--algorithm", "allreduce3", "--native", "--steps", "2",
            "--warmup", "1", "--json", *SMALL]
    assert main(argv) == 0
    points = json.loads(capsys.readouterr().out)["rows"]
    assert [(p["seq_len"], p["requested"]) for p in points] == [
        (n, a) for n in (301, 1024) for a in ("tree", "ring", "allreduce3")
    ]
    keys = {"algorithm", "world", "seq_len", "measured_s", "predicted_s", "error",
            "max_abs_diff", "bytes_sent", "peak_memory_bytes"}
    for p in points:
        assert keys <= set(p)
        assert p["world"] == 3 and p["predicted_s"] is None and p["error"] is None
        assert p["measured_s"] > 0 and math.isfinite(p["measured_s"])
        # fp32 kernels against the float64 single-process oracle over <= 1k keys
        assert p["max_abs_diff"] < 1e-5
        assert len(p["bytes_sent"]) == 3 and len(p["peak_memory_bytes"]) == 3
        names = {entry[2] for entry in p["timeline"]}
        assert "attention" in names
    ring, tree = points[4], points[3]
    assert min(ring["peak_memory_bytes"]) > min(tree["peak_memory_bytes"])
    assert points[5]["algorithm"] == "allreduce3+native"


@pytest.fixture(scope="module")
def profile_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("cal") / "profile.json"
    assert main(["calibrate", "--nproc", "2", "-o", str(path), "--max-bytes", "80M", *SMALL]) == 0
    return path


@pytest.mark.timeout(240)
def test_calibrate_writes_a_version_1_profile(profile_path) -> None:
    import os

    from treeattn.sim.files.profiles import load_profile
    from treeattn.testbed.host.profiles import hardware_from_profile

    profile = load_profile(profile_path)
    cpus = len(os.sched_getaffinity(0))
    assert profile["world"] == 2 and profile["cores"] == cpus
    assert profile["pinned"] == (cpus < 2)  # --bind auto: only when ranks outnumber cores
    for section in ("p2p", "allreduce"):
        assert len(profile[section]["sizes"]) == len(profile[section]["times_s"])
        assert all(t > 0 for t in profile[section]["times_s"])
    assert profile["p2p"]["bandwidth_Bps"] > 0 and profile["p2p"]["latency_s"] >= 0
    assert profile["exchange"]["sizes"][-1] == 80 << 20  # --max-bytes: measured, not guessed
    assert profile["attention"]["threads_per_rank"] == 1
    assert hardware_from_profile(profile).host.cores == cpus
    # host steps right after the kernel: measured, non-negative, and handed to the simulator
    from treeattn.testbed.calibration.cold import l2_bytes

    cold = profile["cold"]
    assert cold["world"] == 2 and cold["after_bytes"] == 2 * l2_bytes()
    assert cold["merge_s"] >= 0 and cold["message_s"] >= 0
    assert set(cold["collectives_s"]) == {"all_reduce", "all_gather", "reduce_scatter",
                                          "all_to_all", "broadcast"}
    assert all(0 < s < 0.5 for s in cold["collectives_s"].values())
    assert hardware_from_profile(profile).host.cold.merge_s == cold["merge_s"]
    # the executor's own per-message cost, measured against raw gloo, reaches the simulator
    from treeattn.testbed.host.profiles import backend_from_profile

    step = profile["executor"]["step_overhead_s"]
    assert 0 <= step < 0.05 and profile["executor"]["ratio_executor_raw"] > 0
    alpha = profile["p2p"]["latency_s"]
    assert backend_from_profile(profile).send_s == pytest.approx(alpha / 2 + step)
    # and the C program's, for the ranks that run as one (shared memory here, a C compiler)
    from treeattn.testbed.transport import shm, shm_program

    if shm_program.unavailable_reason() == "":
        program = hardware_from_profile(profile).host.program
        assert profile["executor"]["program_message_bytes"] == shm.SLOT_BYTES
        assert program.send_s == pytest.approx(
            max(0.0, alpha / 2 + profile["executor"]["program_step_s"]))


@pytest.mark.timeout(240)
def test_check_predicts_then_gates_on_the_error(profile_path, tmp_path, capsys) -> None:
    base = ["run", "--nproc", "2", "--seq-len", "2k", "--algorithm", "tree", "--steps", "2",
            "--warmup", "0", "--check", "--profile", str(profile_path), "--json", *SMALL]
    assert main(base + ["--max-error", "1e9"]) == 0
    (point,) = json.loads(capsys.readouterr().out)["rows"]
    assert point["predicted_s"] > 0
    ratio = point["predicted_s"] / point["measured_s"]
    assert point["error"] == pytest.approx(max(ratio, 1 / ratio) - 1)  # symmetric error
    names = [(e[0], e[1], e[2]) for e in point["timeline"]]
    predicted = [(e[0], e[1], e[2]) for e in point["predicted_timeline"]]
    assert sorted(names) == sorted(predicted)  # same steps, same names, on both sides
    # A prediction far outside the measured band fails the gate. A 2k step's p10-p90 can span
    # 4x on a busy 2-core box, so a true prediction may sit inside it even at a tiny
    # --max-error; a profile whose messages cost 0.1 s each cannot.
    slow = json.loads(profile_path.read_text())
    slow["p2p"]["latency_s"] = 0.1
    slow_path = tmp_path / "slow.json"
    slow_path.write_text(json.dumps(slow))
    gated = [slow_path if arg == str(profile_path) else arg for arg in base]
    assert main([str(a) for a in gated] + ["--max-error", "0.5"]) == 1
    assert "exceeds --max-error" in capsys.readouterr().err
    assert main(base + ["--max-error", "nan"]) == 2  # a NaN would switch the gate off


def test_native_without_allreduce3_is_refused(capsys) -> None:
    assert main(["run", "--nproc", "2", "--seq-len", "4k", "--algorithm", "tree",
                 "--native"]) == 2
    assert "--algorithm allreduce3" in capsys.readouterr().err


@pytest.mark.timeout(300)
def test_generate_auto_plans_with_the_calibration(profile_path, monkeypatch, capsys) -> None:
    """`generate --algorithm auto --profile` prices the planner with the calibrated models;
    without --profile it plans with the defaults; the tokens are the single process's."""
    from treeattn.llm import generate_dist

    priced = []
    real = generate_dist.build
    monkeypatch.setattr(generate_dist, "build", lambda algorithm, topology, workload, models:
                        priced.append(models) or real(algorithm, topology, workload, models))
    base = ["generate", "--nproc", "2", "--model", "debug", "--prompt", "abc",
            "--max-new-tokens", "3", "--algorithm", "auto", "--json"]
    assert main([*base, "--profile", str(profile_path), "--verify"]) == 0
    assert json.loads(capsys.readouterr().out)["identical_to_single_process"] is True
    assert main(base) == 0
    hardware, backend = priced[0]
    assert hardware is not None and backend is not None  # the calibration's cpu and p2p models
    assert priced[1] == (None, None)


@pytest.mark.parametrize("extra, message", [
    (["--algorithm", "tree"], "use it with --algorithm auto"),
    (["--algorithm", "auto", "--plan", "plan.json"], "use it with --algorithm auto"),
])
def test_generate_profile_without_auto_is_refused(profile_path, capsys, extra, message) -> None:
    assert main(["generate", "--nproc", "2", "--model", "debug", "--prompt", "abc",
                 "--profile", str(profile_path), *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and message in err and len(err.strip().splitlines()) == 1


def test_generate_with_an_invalid_profile_is_one_error_line(tmp_path, capsys) -> None:
    bad = tmp_path / "profile.json"
    bad.write_text('{"format": "treeattn.profile", "version": 1}')
    assert main(["generate", "--nproc", "2", "--model", "debug", "--prompt", "abc",
                 "--algorithm", "auto", "--profile", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and len(err.strip().splitlines()) == 1
