"""Fault injection and lifecycle settings in cluster.yaml: defaults off, bad values refused with
the key named, PDSERVE_FAULTS overriding key by key; the seeded hooks are reproducible."""

from __future__ import annotations

import pytest

from router.config.loader import parse_config
from router.config.typed_yaml import ConfigError
from worker_runtime.faults import FaultConfig, Faults


def test_faults_are_off_by_default():
    faults = Faults(parse_config({}).faults, "decode-0")
    assert not any(faults.fail_transfer() for _ in range(1000))
    assert faults.transfer_delay() == 0.0
    faults.maybe_kill("decode.after_start")  # never exits


@pytest.mark.parametrize("raw, message", [
    ({"router": {"max_queue": 0}}, "router.max_queue: must be >= 1"),
    ({"router": {"migration_limit": -1}}, "router.migration_limit: must be >= 0"),
    ({"router": {"call_timeout_s": 0}}, "router.call_timeout_s: must be > 0"),
    ({"faults": {"transfer_fail_rate": 1.5}}, "faults.transfer_fail_rate: must be in [0, 1]"),
    ({"faults": {"kill_at": "decode.somewhere"}}, "faults.kill_at: must be one of"),
    ({"faults": {"bogus": 1}}, "faults.bogus: unknown key"),
])
def test_bad_values_name_the_key(raw, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_config(raw)


def test_env_overrides_key_by_key():
    base = FaultConfig(transfer_delay_s=0.5)
    merged = base.with_env("transfer_fail_rate=0.25, kill_at=decode.after_start,kill_rate=1")
    assert merged == FaultConfig(transfer_delay_s=0.5, transfer_fail_rate=0.25, kill_at="decode.after_start",
                                 kill_rate=1.0)
    assert base.with_env("") == base


@pytest.mark.parametrize("env, message", [
    ("transfer_fail_rate", "is not KEY=VALUE"),
    ("nope=1", "is not KEY=VALUE"),
    ("kill_rate=lots", "is not a float"),
    ("kill_rate=2", "kill_rate: must be in"),
])
def test_env_errors_are_clear(env, message):
    with pytest.raises(ValueError, match=message):
        FaultConfig().with_env(env)


def test_hooks_are_seeded_per_worker():
    cfg = FaultConfig(seed=3, transfer_fail_rate=0.5)
    runs = [[f.fail_transfer() for _ in range(64)] for f in (Faults(cfg, "prefill-0"), Faults(cfg, "prefill-0"))]
    other = [Faults(cfg, "prefill-1").fail_transfer() for _ in range(64)]
    assert runs[0] == runs[1] != other
    assert 10 < sum(runs[0]) < 54  # about half


def test_set_changes_the_knobs_of_a_running_worker_and_reseeds():
    cfg = FaultConfig(seed=4, transfer_fail_rate=0.5)
    fresh, changed = Faults(cfg, "prefill-1"), Faults(None, "prefill-1")
    assert not any(changed.fail_transfer() for _ in range(100))
    changed.set(cfg)  # what the workers' set_faults call does
    assert [changed.fail_transfer() for _ in range(200)] == [fresh.fail_transfer() for _ in range(200)]
    changed.set(FaultConfig())
    assert not any(changed.fail_transfer() for _ in range(100))
