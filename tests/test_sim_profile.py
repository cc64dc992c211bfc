"""Calibration profiles: loading, and α counted exactly once."""

from __future__ import annotations

import json

import pytest

from treeattn.sim import DecodeWorkload, SimError, build_schedule, simulate
from treeattn.sim.files.profiles import load_profile
from treeattn.testbed.host.profiles import (
    backend_from_profile,
    hardware_from_profile,
    topology_from_profile,
)

PROFILE = {
    "version": 1, "backend": "gloo", "world": 2, "cores": 2,
    "p2p": {"latency_s": 40e-6, "bandwidth_Bps": 2e9, "sizes": [8, 1 << 20],
            "times_s": [40e-6, 564e-6]},
    "allreduce": {"latency_s": 90e-6, "sizes": [8], "times_s": [90e-6]},
    "attention": {"bandwidth_Bps": 8e9, "launch_s": 15e-6, "threads_per_rank": 1},
    "machine": {"cpu": "test"},
}


def test_one_message_costs_alpha_plus_n_over_beta(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(PROFILE))
    topo = topology_from_profile(str(path))
    hw, backend = hardware_from_profile(PROFILE), backend_from_profile(PROFILE)
    w = DecodeWorkload("debug", 64)
    r = simulate(build_schedule("tree", topo, w, shape="chain"), topo, w, hw, backend)
    attn = w.attention_bytes(32) / 8e9 + 15e-6
    merge = 3 * w.partial_bytes / 8e9 + 15e-6
    message = 40e-6 + w.partial_bytes / 2e9
    assert r.makespan_s == pytest.approx(attn + 2 * message + merge, rel=1e-12)


def test_more_ranks_than_cores_share_them():
    hw = hardware_from_profile(dict(PROFILE, cores=1))
    assert hw.host.cores == 1
    hw = hardware_from_profile(dict(PROFILE, cores=8, attention=dict(PROFILE["attention"],
                                                                      threads_per_rank=4)))
    assert hw.host.cores == 2


@pytest.mark.parametrize("bad", [
    {}, dict(PROFILE, version=2), dict(PROFILE, world=0),
    dict(PROFILE, p2p={"latency_s": 1e-5}), dict(PROFILE, attention={"bandwidth_Bps": -1}),
])
def test_invalid_profiles_are_sim_errors(bad):
    with pytest.raises(SimError):
        load_profile(bad)


def test_unreadable_profile(tmp_path):
    with pytest.raises(SimError, match="cannot read"):
        load_profile(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(SimError, match="cannot read"):
        load_profile(tmp_path / "bad.json")


def test_concurrent_exchange_bandwidth_prices_the_links():
    from treeattn.testbed.host.profiles import topology_from_profile

    base = {"version": 1, "backend": "gloo", "world": 2, "cores": 2,
            "p2p": {"latency_s": 4e-5, "bandwidth_Bps": 4e9},
            "attention": {"bandwidth_Bps": 1e10, "launch_s": 1e-5}}
    lone = topology_from_profile(base, 3)
    assert lone.path_bandwidth(0, 1) == 4e9
    busy = topology_from_profile({**base, "exchange": {"bandwidth_Bps": 1.5e9}}, 3)
    assert busy.path_bandwidth(0, 2) == 1.5e9


def test_executor_step_overhead_is_optional_and_charged_per_message_end():
    from treeattn.testbed.host.profiles import backend_from_profile

    base = {"version": 1, "backend": "gloo", "world": 2, "cores": 2,
            "p2p": {"latency_s": 4e-5, "bandwidth_Bps": 1e9},
            "attention": {"bandwidth_Bps": 1e10, "launch_s": 1e-5}}
    old = backend_from_profile(base)  # a profile without the key: unchanged
    assert old.send_s == old.recv_s == 2e-5
    new = backend_from_profile({**base, "executor": {"step_overhead_s": 3e-6}})
    assert new.send_s == pytest.approx(2.3e-5) and new.recv_s == pytest.approx(2.3e-5)
    with pytest.raises(SimError):
        backend_from_profile({**base, "executor": {"step_overhead_s": -1.0}})


def test_attention_rate_follows_the_calibrated_shard_size():
    # A shard a cache holds reads faster than one only DRAM holds: the profile's per-size
    # times price each size at its own rate, and the spread bound scales them all alike.
    from treeattn.testbed.host.profiles import profile_bound

    launch = 10e-6
    profile = json.loads(json.dumps(PROFILE))
    profile["attention"].update(
        bandwidth_Bps=6e9, launch_s=launch, spread=[0.9, 1.2],
        sizes=[4096, 100 << 20, 400 << 20],  # the launch probe, a cached and a DRAM shard
        times_s=[launch, launch + (100 << 20) / 8e9, launch + (400 << 20) / 4e9])
    hw = hardware_from_profile(profile)
    assert hw.compute_time(50 << 20) == pytest.approx((50 << 20) / 8e9 + launch)
    assert hw.compute_time(1 << 30) == pytest.approx((1 << 30) / 4e9 + launch)
    between = hw.bandwidth_at(200 << 20)
    assert 4e9 < between < 8e9
    slow = hardware_from_profile(profile_bound(profile, "hi"))
    assert slow.bandwidth_at(1 << 30) == pytest.approx(4e9 / 1.2, rel=1e-3)  # launch moves too
    flat = json.loads(json.dumps(PROFILE))  # no per-size times: one bandwidth, as before
    assert hardware_from_profile(flat).bandwidth_at(1 << 30) == 8e9
