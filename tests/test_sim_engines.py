"""``treeattn plan --emit vllm|sglang``: the flags, the documented constraints, the ratio."""

from __future__ import annotations

import json

import pytest

from treeattn.cli import main
from treeattn.schedule.payloads import SimError
from treeattn.schedule.workload import DecodeWorkload
from treeattn.sim.deploy.engines import ENGINES, check_constraints, describe, emit
from treeattn.topo import Topology

BASE = ["plan", "--model", "llama-3.1-8b", "--seq-len", "128k"]


def test_vllm_flags_realise_the_fastest_backend(capsys):
    assert main([*BASE, "--topology", "dgx-h100:nodes=2", "--tp", "8", "--emit", "vllm",
                 "--json"]) == 0
    record = json.loads(capsys.readouterr().out)["emit"]
    flags = record["flags"]
    assert flags[:4] == ["--tensor-parallel-size", "16", "--decode-context-parallel-size", "2"]
    best = min(record["backends"], key=lambda r: r["latency_s"])
    assert flags[flags.index("--dcp-comm-backend") + 1] == best["backend"]
    assert {r["backend"] for r in record["backends"]} == {"ag_rs", "a2a"}
    assert record["ratio"] == pytest.approx(best["latency_s"] / record["pick_latency_s"])
    assert record["ratio"] >= 1 - 1e-12  # the pick searches every algorithm, backends included


def test_the_text_names_version_and_source(capsys):
    assert main([*BASE, "--topology", "dgx-h100:nodes=2", "--tp", "8", "--emit", "vllm"]) == 0
    out = capsys.readouterr().out
    assert "--decode-context-parallel-size 2 --dcp-comm-backend" in out
    assert ENGINES["vllm"].docs in out and "PR #34883" in out


@pytest.mark.parametrize("args,constraint", [
    (["--topology", "dgx-h100:nodes=1", "--tp", "2", "--emit", "vllm"],
     "tp // num_kv_heads >= dcp is violated (tensor-parallel-size 8 // 8 KV heads = 1 < "
     "decode-context-parallel-size 4)"),
    (["--topology", "dgx-h100:nodes=2", "--tp", "8", "--emit", "sglang"],
     "serves MLA attention only"),
])
def test_a_broken_constraint_is_one_error_line(args, constraint, capsys):
    assert main([*BASE, *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and constraint in err[0]


def test_tp_must_be_a_multiple_of_dcp():
    with pytest.raises(SimError, match=r"tp % dcp == 0 is violated"):
        check_constraints(ENGINES["vllm"], 12, 8, 1)


def test_an_inexpressible_pick_is_said_with_the_ratio():
    topo = Topology.from_spec("dgx-h100:nodes=2")
    record = emit("vllm", topo, DecodeWorkload("llama-3.1-8b", 131072, tp=8))
    record.update(pick="tree/binomial@0", pick_algorithm="tree", pick_backend=None,
                  pick_latency_s=record["best"]["latency_s"] / 1.5, ratio=1.5)
    text = "\n".join(describe(record))
    assert "cannot be expressed in vLLM" in text and "1.50× the pick's time" in text


def test_an_expressible_pick_names_the_backend_that_runs_it():
    """On a GB200 rack SGLang's a2a and fi_a2a are both Helix. With fp32 partials (18.5 KB
    to each of 3 peers, Simple on NCCL) the pick is Helix on the LL128 fabric, fi_a2a's;
    with the bf16 o the engines move, whichever transport wins names its own backend."""
    from treeattn.sim.parallel import sub_topology

    rack = sub_topology(Topology.from_spec("gb200-nvl72"), list(range(16)))
    record = emit("sglang", rack, DecodeWorkload("deepseek-v3", 32768, tp=4,
                                                 partial_dtype="fp32"))
    assert record["pick"] == "helix@mnnvl_ll128" and record["pick_backend"] == "fi_a2a"
    row = next(r for r in record["backends"] if r["backend"] == "fi_a2a")
    assert (row["algorithm"], row["transport"]) == ("helix", "mnnvl_ll128")
    assert "runs with --dcp-comm-backend fi_a2a." in "\n".join(describe(record))
    record = emit("sglang", rack, DecodeWorkload("deepseek-v3", 32768, tp=4))
    algorithm, _, transport = record["pick"].partition("@")
    assert algorithm == "helix"
    assert record["pick_backend"] == {"mnnvl_ll128": "fi_a2a", "": "a2a"}[transport]


def test_sglang_is_priced_on_its_own_paths_not_vllms():
    """SGLang's DCP runs ag_rs on NCCL (its symmetric kernels with --enable-symm-mem), a2a
    on ncclAllToAll and fi_a2a on the MNNVL LL128 kernel; its TP all-reduce on NCCL,
    --enable-symm-mem or --enable-torch-symm-mem. vLLM's direct-store all-to-all
    (VLLM_USE_DIRECT_DCP_A2A, transport symm_mem) is not among its DCP paths."""
    runs = ENGINES["sglang"].runs()
    assert runs["algorithms"] == ("dcp", "helix")
    assert set(runs["transports"]) == {"nccl", "nccl-symm", "mnnvl_ll128"}
    assert "symm_mem" not in runs["transports"]
    assert set(runs["tp_transports"]) == {"nccl", "nccl-symm", "symm_mem"}
    flags = {t: f for t, (_, f) in ENGINES["sglang"].tp_all_reduce.items()}
    assert flags["symm_mem"] == ("--enable-torch-symm-mem",)
    assert flags["nccl-symm"] == ("--enable-symm-mem",)
    # vLLM's DCP a2a may run on its direct stores
    assert "symm_mem" in ENGINES["vllm"].runs()["transports"]


def test_a_step_priced_as_sglang_runs_it_never_uses_vllms_direct_a2a():
    from treeattn.sim.deploy.capacity import Split
    from treeattn.sim.deploy.token import predict_token

    topo = Topology.from_spec("dgx-b200")
    split = Split(tp=8, dcp=8)
    sglang = predict_token(topo, "deepseek-v3", 65536, split, **ENGINES["sglang"].runs())
    anything = predict_token(topo, "deepseek-v3", 65536, split)
    direct = predict_token(topo, "deepseek-v3", 65536, split, transports=("symm_mem",),
                           algorithms=("helix",))
    # the merge on every transport may take vLLM's direct stores; SGLang's cannot
    assert anything.tpot_s <= sglang.tpot_s
    assert sglang.parts_s["attention"] != pytest.approx(direct.parts_s["attention"])
    assert sglang.to_json()["tp_all_reduce_transport"] in ENGINES["sglang"].tp_all_reduce


def test_sglang_fuses_the_shared_expert_where_its_defaults_do():
    """SGLang's ``determine_num_fused_shared_experts``: the DeepSeek-V3 layout (256 routed
    experts, one shared) on compute capability 8.0 or newer, not on Blackwell (its default
    MoE runner there disables it), nor on Volta; AMD CDNA 3 too. vLLM never fuses it by
    default. A step priced as an engine runs it names that engine."""
    from dataclasses import replace

    from treeattn.schedule.workload import ModelConfig

    v3 = ModelConfig.from_name("deepseek-v3")
    sglang, vllm = ENGINES["sglang"], ENGINES["vllm"]
    fuses = {g: sglang.fuses_shared_experts(v3, g)
             for g in ("A100", "H100", "H200", "B200", "GB200", "MI300X", "V100")}
    assert fuses == {"A100": True, "H100": True, "H200": True, "B200": False,
                     "GB200": False, "MI300X": True, "V100": False}
    assert not any(vllm.fuses_shared_experts(v3, g) for g in fuses)
    v2_like = replace(v3, n_routed_experts=160, n_shared_experts=2)
    assert not sglang.fuses_shared_experts(v2_like, "H200")
    assert not sglang.fuses_shared_experts(ModelConfig.from_name("llama-3.1-70b"), "H200")
    assert sglang.runs()["engine"] == "sglang" and vllm.runs()["engine"] == "vllm"
