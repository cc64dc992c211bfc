"""A user's measured kernel table (calibrate --kernels): format, fit, use and bad input.

Expected values are worked by hand from the rows of the fixture
``tests/fixtures/kernels/h100-decode.csv`` (a hand-written example of the format).
"""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from treeattn.cli import main
from treeattn.sim import SimError
from treeattn.sim.deploy.capacity import Split
from treeattn.sim.deploy.kernel_table import fit_kernels, read_kernel_table, row_bytes
from treeattn.sim.deploy.token import predict_token
from treeattn.topo import Topology

TABLE = "tests/fixtures/kernels/h100-decode.csv"
HEADER = "kind,m,n,k,dtype,batch,q_heads,kv_heads,head_dim,context,time_us\n"


def test_rows_read_the_bytes_the_token_model_reads():
    rows = read_kernel_table(TABLE)
    gemm = rows[0]  # 1 x 8192 x 8192 bf16: the weight plus a bf16 input and output row
    assert row_bytes(gemm) == 8192 * 8192 * 2 + (8192 + 8192) * 2
    attention = rows[-1]  # batch 1, 8 KV heads, 128k tokens, D = 128, bf16 K and V
    assert row_bytes(attention) == 2 * 1 * 8 * 131072 * 128 * 2


def test_the_fit_recovers_a_fixed_cost_and_a_rate_by_hand():
    text = HEADER + ("gemm,1,4096,4096,fp8,,,,,,10\n"   # 16,793,600 B
                     "gemm,1,8192,8192,fp8,,,,,,30\n")  # 67,141,632 B
    (fit,) = fit_kernels(read_kernel_table("t.csv", text))
    b1, b2 = 4096 * 4096 + 2 * 4096 * 2, 8192 * 8192 + 2 * 8192 * 2
    rate = (b2 - b1) / 20e-6  # two points: the line through them
    assert fit.bytes_per_s == pytest.approx(rate)
    assert fit.fixed_s == pytest.approx(10e-6 - b1 / rate)


def test_a_calibrated_profile_replaces_the_sourced_kernels(tmp_path, capsys):
    out = tmp_path / "kernels.json"
    assert main(["calibrate", "--kernels", TABLE, "--topology", "dgx-h100", "-o",
                 str(out)]) == 0
    profile = json.loads(out.read_text())
    fits = {(f["kind"], f["dtype"]): f for f in profile["kernels"]["fits"]}
    assert set(fits) == {("gemm", "bf16"), ("gemm", "fp8"), ("attention", "any")}
    from treeattn.sim.files.profiles import plan_overrides

    topo = Topology.from_spec("dgx-h100")
    hardware = plan_overrides(str(out), topo)["hardware"]
    p = predict_token(topo, "llama-3.1-70b", 32768, Split(8), weights_dtype="float8",
                      hardware=hardware)
    assert hardware[0].launch_s == pytest.approx(fits[("attention", "any")]["fixed_s"])
    # every small kernel costs the GEMM fits' mean fixed cost (one GEMM is one kernel), and
    # each layer's attention the attention fit, in place of the sourced grid model
    gemm_fixed = (fits[("gemm", "bf16")]["fixed_s"] + fits[("gemm", "fp8")]["fixed_s"]) / 2
    from treeattn.schedule.workload import ModelConfig
    from treeattn.sim.deploy.token import kernels_per_step

    m = ModelConfig.from_name("llama-3.1-70b")
    assert p.parts_s["kernels"] == pytest.approx(kernels_per_step(m, "float8") * gemm_fixed)
    kv = 2 * 1 * 32768 * 128 * 2  # one KV head per GPU, bf16 K and V
    attention = fits[("attention", "any")]
    assert p.attention_layer_s == pytest.approx(
        attention["fixed_s"] + kv / attention["bytes_per_s"], rel=1e-3)
    # the weights read at the table's rates, not the sourced defaults: the FP8 layers at its
    # fp8 rate, the 16-bit LM head (a 128256 × 8192 / 8 shard) and embedding row at its bf16
    table = 128256 * 8192 / 8 * 2
    fp8_bytes = p.memory.weights_bytes - 2 * table  # a dense model reads every layer
    sixteen_bit = table + 8192 * 2
    assert p.parts_s["weights"] == pytest.approx(
        fp8_bytes / fits[("gemm", "fp8")]["bytes_per_s"]
        + sixteen_bit / fits[("gemm", "bf16")]["bytes_per_s"], rel=1e-3)
    # and it is refused on another GPU
    assert main(["predict", "--topology", "dgx-a100", "--model", "llama-3.1-70b",
                 "--seq-len", "32k", "--token", "--tp", "8", "--profile", str(out)]) == 2
    assert "gpu_model" in capsys.readouterr().err


@pytest.mark.parametrize("body, needle", [
    ("m,n,k,dtype,time_us\n1,2,3,bf16,4\n", "missing column 'kind'"),
    ("kind,m,n,dtype,time_us\ngemm,1,2,bf16,4\n", "need column(s) k"),
    (HEADER + "gemm,1,8192,8192,bf16,,,,,,fast\n", "not a number"),
    (HEADER + "gemm,1,8192,8192,bf16,,,,,,0\n", "not a positive time"),
    (HEADER + "gemm,1,8192,8192,bf16,,,,,,-3\n", "not a positive time"),
    (HEADER + "conv,1,8192,8192,bf16,,,,,,3\n", "not one the model runs"),
    (HEADER + "gemm,1,8192,8192,int4,,,,,,3\n", "not one the model runs"),
    (HEADER + "gemm,0,8192,8192,bf16,,,,,,3\n", "not an integer in [1, 2^40]"),
    (HEADER + "attention,,,,bf16,1,6,4,128,4096,3\n", "do not group"),
    (HEADER + "attention,,,,fp4,1,8,8,128,4096,3\n", "weight dtype"),
    (HEADER + "gemm,1,8192,8192,bf16,,,,,,3\n", "two different sizes"),
    (HEADER, "no rows"),
    (HEADER + "gemm,1,8192,8192,fp4,,,,,,20\ngemm,1,28672,8192,fp4,,,,,,60\n",
     "lines 2, 3: fp4 GEMMs on H100"),
    # a field over csv's own limit (128 KiB)
    (HEADER + "gemm,1,8192,8192,bf16,,,,,," + "9" * 200_000 + "\n", "not a CSV table"),
    # 2^60 and 2^60 + 1: distinct integers, one float; and dimensions of 400 digits, whose
    # bytes overflow a float (bf16 weights as integers, fp4's 4.5 bits as floats)
    (HEADER + f"gemm,1,{2**60},8192,bf16,,,,,,20\ngemm,1,{2**60 + 1},8192,bf16,,,,,,60\n",
     "not an integer in [1, 2^40]"),
    (HEADER + f"gemm,1,{'9' * 400},8192,bf16,,,,,,20\ngemm,1,8192,8192,bf16,,,,,,60\n",
     "not an integer in [1, 2^40]"),
    (HEADER + f"gemm,1,8192,{'9' * 400},fp8,,,,,,20\ngemm,1,8192,8192,fp8,,,,,,60\n",
     "not an integer in [1, 2^40]"),
    (HEADER + f"attention,,,,bf16,{'9' * 400},8,8,128,4096,3\n",
     "not an integer in [1, 2^40]"),
    # fits a profile cannot hold, so predict would refuse what calibrate wrote: nanoseconds
    # for 33 and 470 MB (a rate of ~1e17 B/s, beyond any HBM), and 1e300 µs (a fixed cost
    # beyond any kernel)
    (HEADER + "gemm,1,8192,8192,fp8,,,,,,0.001\ngemm,1,28672,16384,fp8,,,,,,0.002\n",
     "outside what a profile holds"),
    (HEADER + "gemm,1,8192,8192,fp8,,,,,,1e300\ngemm,1,28672,8192,fp8,,,,,,2e300\n",
     "outside what a profile holds"),
])
def test_a_bad_table_is_one_error_line(tmp_path, capsys, body, needle):
    path, out = tmp_path / "bad.csv", tmp_path / "bad.json"
    path.write_text(body)
    assert main(["calibrate", "--kernels", str(path), "--topology", "dgx-h100", "-o",
                 str(out)]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("error: ") and needle in captured.err
    assert len(captured.err.strip().splitlines()) == 1 and "Traceback" not in captured.err
    assert not out.exists()


def test_sizes_one_float_apart_are_no_fit():
    """Rows built past the reader's bound (2^60 and 2^60 + 1 columns): two integers, one
    float, so no variance to fit a rate on; a SimError, not a division by zero."""
    rows = [{"kind": "gemm", "dtype": "bf16", "m": 1, "n": n, "k": 8192, "time_s": t,
             "line": line} for line, (n, t) in enumerate([(2**60, 2e-5), (2**60 + 1, 6e-5)], 2)]
    with pytest.raises(SimError, match="different sizes|tell apart"):
        fit_kernels(rows)


def test_every_fit_calibrate_writes_is_one_predict_reads(tmp_path_factory):
    """Any two GEMM rows: calibrate either refuses them with one error line and writes
    nothing, or writes a profile that predict --token accepts (the schema's bounds)."""
    from hypothesis import example, given, settings
    from hypothesis import strategies as st

    dims = st.one_of(st.integers(1, 1 << 16), st.integers(1, 1 << 70),
                     st.sampled_from(["0", "-1", "x", "9" * 60, ""]))
    times = st.one_of(st.floats(1e-9, 1e9), st.sampled_from(["1e-300", "1e300", "0", "nan"]))
    row = st.tuples(dims, dims, times)

    @settings(max_examples=40, deadline=None, database=None, derandomize=True)
    @given(st.lists(row, min_size=1, max_size=3), st.sampled_from(["bf16", "fp8"]))
    @example([(8192, 8192, "1e300"), (28672, 8192, "2e300")], "fp8")
    @example([(8192, 8192, 0.001), (28672, 16384, 0.002)], "bf16")
    def check(rows, dtype):
        folder = tmp_path_factory.mktemp("fuzz")
        path, out = folder / "t.csv", folder / "t.json"
        path.write_text(HEADER + "".join(f"gemm,1,{n},{k},{dtype},,,,,,{t}\n"
                                         for n, k, t in rows))
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            rc = main(["calibrate", "--kernels", str(path), "--topology", "dgx-h100", "-o",
                       str(out)])
            if rc == 0:
                rc_predict = main(["predict", "--topology", "dgx-h100", "--model",
                                   "llama-3.1-8b", "--seq-len", "4k", "--token", "--tp", "8",
                                   "--profile", str(out)])
        if rc == 0:
            assert rc_predict == 0, err.getvalue()
        else:
            assert rc == 2 and not out.exists()
            lines = err.getvalue().strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("error: "), err.getvalue()

    check()


def test_a_fit_whose_times_fall_with_the_bytes_is_refused():
    text = HEADER + "gemm,1,8192,8192,bf16,,,,,,30\ngemm,1,4096,4096,bf16,,,,,,40\n"
    with pytest.raises(SimError, match="do not grow"):
        fit_kernels(read_kernel_table("t.csv", text))


def test_times_too_small_for_a_finite_rate_are_one_error_line_and_nothing_written(
        tmp_path, capsys):
    """1e-300 µs and 1e-299 µs: the line through them has a slope that underflows, so its
    rate is infinite (no JSON number); refused naming the rows, no profile written."""
    path, out = tmp_path / "tiny.csv", tmp_path / "tiny.json"
    path.write_text(HEADER + "gemm,1,8192,8192,fp8,,,,,,1e-300\n"
                             "gemm,1,28672,8192,fp8,,,,,,1e-299\n")
    assert main(["calibrate", "--kernels", str(path), "--topology", "dgx-h100", "-o",
                 str(out)]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("error: ") and len(captured.err.strip().splitlines()) == 1
    assert "lines 2, 3" in captured.err and "outside what a profile holds" in captured.err
    assert not out.exists()
    with pytest.raises(SimError, match="lines 2, 3"):
        fit_kernels(read_kernel_table(str(path)))


def test_fp4_weights_on_hopper_are_refused_with_a_measured_profile(tmp_path, capsys):
    """A profile with an FP4 GEMM fit (calibrated on a B200) relabelled as an H100's:
    predict refuses FP4 weights on Hopper even when the profile carries an FP4 rate."""
    b200 = tmp_path / "b200.json"
    table = tmp_path / "fp4.csv"
    table.write_text(HEADER + "gemm,1,8192,8192,fp4,,,,,,20\ngemm,1,28672,8192,fp4,,,,,,60\n")
    assert main(["calibrate", "--kernels", str(table), "--topology", "dgx-b200", "-o",
                 str(b200)]) == 0
    profile = json.loads(b200.read_text())
    profile.update(gpu_model="H100", backend="nccl")
    h100 = tmp_path / "h100.json"
    h100.write_text(json.dumps(profile))
    capsys.readouterr()
    assert main(["predict", "--topology", "dgx-h100", "--model", "llama-3.1-8b", "--seq-len",
                 "4k", "--token", "--tp", "8", "--weights-dtype", "fp4", "--profile",
                 str(h100)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith("error: ")
    assert len(captured.err.strip().splitlines()) == 1 and "FP4 tensor cores" in captured.err
