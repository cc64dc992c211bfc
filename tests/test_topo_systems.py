"""The NVSwitch built-ins against their datasheets; GPU rows cover every named model."""

from __future__ import annotations

import time

import pytest

from treeattn.topo import Topology, TopologyError
from treeattn.topo import hardware as hw
from treeattn.topo.builders import BUILDERS, spec_gpus
from treeattn.topo.builders_nvidia import SYSTEMS

GB = 1e9


@pytest.mark.parametrize("spec, model, per_gpu, chips, nic", [
    ("dgx-a100:nodes=2", "A100", 300 * GB, 6, 200e9 / 8),   # 600 GB/s bidirectional
    ("hgx-h200:nodes=2", "H200", 450 * GB, 4, 400e9 / 8),   # 900 GB/s bidirectional
    ("dgx-b200:nodes=2", "B200", 900 * GB, 2, 400e9 / 8),   # 1.8 TB/s bidirectional
    ("gb200-nvl72:racks=2", "GB200", 900 * GB, 9, 400e9 / 8),  # 9 trays of 2 chips
])
def test_builtin_counts_and_per_gpu_nvlink(spec, model, per_gpu, chips, nic):
    t = Topology.from_spec(spec)
    per_host = 72 if model == "GB200" else 8
    assert t.num_gpus == 2 * per_host == spec_gpus(spec) and len(t.hosts) == 2
    assert {t.gpu_model(g) for g in t.gpus} == {model}
    assert t.links()["nvlink"] == 2 * per_host * hw.GPU_SPECS[model].links
    host = t.hosts[1]
    phys = [n for n, d in t.graph.nodes(data=True)
            if d["kind"] == "nvswitch" and d["host"] == host and not d.get("logical")]
    assert len(phys) == chips
    for g in (0, per_host + 5):
        assert t.link_bandwidth_out(g) == pytest.approx(per_gpu)
        assert t.path_bandwidth(g, g ^ 1) == pytest.approx(per_gpu)
    assert t.path_bandwidth(0, per_host + 3) == pytest.approx(nic)
    leaf = t.route(0, per_host + 3)[-3]  # ... nic -> leaf -> nic -> pcie -> gpu
    assert t.graph.nodes[leaf[0]]["kind"] == "net_switch"


def test_gb200_logical_switch_routes_and_rack_hosts():
    t = Topology.from_spec("gb200-nvl72:racks=2")
    assert t.hosts == ["rack0", "rack1"]
    route = t.route(3, 70)
    assert route == [("rack0/gpu3", "rack0/nvswitch"), ("rack0/nvswitch", "rack0/gpu70")]
    assert t.path_latency(3, 70) == pytest.approx(hw.NVLINK_HOP_LATENCY)


def test_gb200_eight_racks_builds_quickly():
    start = time.perf_counter()
    t = Topology.from_spec("gb200-nvl72:racks=8")
    assert t.num_gpus == 576
    t.bandwidth_matrix()
    assert time.perf_counter() - start < 10  # ~1 s on a quiet core; generous for CI


@pytest.mark.parametrize("spec, words", [
    ("gb200-nvl72:racks=0", "between 1 and"),
    ("gb200-nvl72:nodes=2", "unknown parameter 'nodes'"),
    ("dgx-b200:nodes=1000000000", "between 1 and"),
    ("dgx-a100:nodes=x", "not an integer"),
])
def test_bad_builtin_specs(spec, words):
    with pytest.raises(TopologyError, match=words):
        Topology.from_spec(spec)


def test_every_gpu_model_has_memory_bandwidth_flops_and_capacity():
    named = {s.gpu for s in SYSTEMS.values()}
    named |= set(hw.PCI_DEVICE_MODELS.values()) | set(hw.SM_MODELS.values())
    named |= set(hw.GFX_MODELS.values()) | set(hw.NV_COUNT_MODELS.values())
    for model in named:
        spec = hw.GPU_SPECS[model]
        assert spec.memory_bandwidth > 0 and spec.peak_flops > 0
        assert spec.memory_capacity >= 16 * GB
    assert hw.GPU_SPECS["H200"].memory_capacity == 141 * GB
    assert hw.GPU_SPECS["MI250X"].memory_capacity == 64 * GB  # per GCD
    assert hw.GPU_SPECS["GB200"].memory_bandwidth == 8e12


def test_show_cli_on_gb200(capsys):
    from treeattn.cli import main

    assert main(["topo", "show", "gb200-nvl72:racks=2"]) == 0
    assert "144" in capsys.readouterr().out
    assert {"dgx-a100", "hgx-h200", "dgx-b200", "gb200-nvl72"} <= set(BUILDERS)
