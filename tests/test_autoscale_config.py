"""`router.autoscale` loaded from cluster.yaml: off by default, and a `measured` profile read from
the `emulate:` section `pdserve plan --measure` prints (relative to cluster.yaml), whose cost
model then sizes the workers. Bad values: tests/test_autoscale_live.py (exit 2 naming the key)."""

from __future__ import annotations

import math

import yaml

from router.autoscale.loop import build_profile
from router.config.autoscale import read_measured_profile
from router.config.emulate import emulation
from router.config.loader import load_config
from sizing.cost_model import StepTotals

# what `pdserve plan --measure` prints for a host (bench/calibrate.py HostFit.emulate_section)
HOST_FIT = {"device": "custom", "model": "llama-3.2-1b", "dtype": "bfloat16", "bandwidth": "2e+10",
            "flops": "1e+12", "memory": "64GiB", "bandwidth_efficiency": 1.0, "compute_efficiency": 1.0,
            "step_overhead_s": 0.002}


def test_autoscale_is_off_by_default(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump({"router": {"port": 0}}))
    assert load_config(path).router.autoscale.enabled is False


def test_a_measured_profile_sizes_by_this_hosts_fit(tmp_path):
    (tmp_path / "fits").mkdir()
    (tmp_path / "fits" / "host.yaml").write_text(yaml.safe_dump({"emulate": HOST_FIT}))
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump({"router": {"autoscale": {
        "enabled": True, "profile": "measured", "measured_profile": "fits/host.yaml"}}}))
    cfg = load_config(path)
    assert cfg.router.autoscale.measured_profile == str(tmp_path / "fits" / "host.yaml")
    profile = build_profile(cfg, None)
    step = StepTotals(1, 100, 100)
    expected = emulation(read_measured_profile(cfg.router.autoscale.measured_profile, 16, "t")).cost
    weights_s = expected.weights_bytes / 2e10  # a decode step of the 1B model reads its weights at 20 GB/s
    assert math.isclose(profile.step_s("decode", step), profile.models["decode"].step_s(step))
    assert weights_s < profile.step_s("decode", step) < weights_s * 1.01 + 0.002
