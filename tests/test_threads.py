"""`torch_threads: auto` (worker_runtime/threads.py): a worker's Ray CPU share (twice that when
colocated), capped at the cores it may run on, one when pinned; and the config key's values."""

from __future__ import annotations

import pytest

from router.config.loader import parse_config
from router.config.typed_yaml import ConfigError
from worker_runtime.threads import auto_threads, wait_env


@pytest.mark.parametrize("share, pinned, colocated, cores, threads", [
    (1.0, False, True, 2, 2),     # 2 colocated workers on this 2-core host: 2 each
    (1.0, False, False, 2, 1),    # 1P+1D here: 1 each
    (0.5, False, True, 2, 2),     # a fractional share counts as one CPU
    (1.0, False, True, 1, 1),     # never more than the cores the process may run on
    (4.0, False, False, 64, 4),   # a bigger share on a big node
    (4.0, False, True, 64, 8),
    (2.5, False, False, 64, 3),   # a share's fraction rounds up
    (8.0, True, True, 64, 1),     # pinned to one core: one thread
])
def test_auto_threads(share, pinned, colocated, cores, threads):
    assert auto_threads(share, pinned, colocated, cores) == threads


def test_auto_is_the_default_and_an_engine_config_leaves_it_to_the_worker():
    cfg = parse_config({})
    assert cfg.prefill.torch_threads == cfg.decode.torch_threads == "auto"
    assert cfg.engine_config(cfg.decode).torch_threads is None  # resolved in the worker, on its node
    three = parse_config({"decode": {"torch_threads": 3}})
    assert three.engine_config(three.decode).torch_threads == 3


@pytest.mark.parametrize("value, message", [
    (0, "decode.torch_threads: must be auto or >= 1"),
    ("many", "decode.torch_threads: expected an integer or one of 'auto', got 'many'"),
])
def test_bad_thread_counts_name_the_key(value, message):
    with pytest.raises(ConfigError, match=message):
        parse_config({"decode": {"torch_threads": value}})


SPIN, PASSIVE = {"GOMP_SPINCOUNT": "10000"}, {"OMP_WAIT_POLICY": "PASSIVE"}


@pytest.mark.parametrize("threads, share, colocated, pinned, env", [
    (None, 1.0, True, False, PASSIVE),                          # colocated auto: 2 threads on a 1-CPU share
    (None, 1.0, False, False, {}),                              # 1P+1D auto: 1 thread, no OpenMP team
    (1, 4.0, True, False, {}),                                  # one thread, whatever its share
    (None, 2.0, False, False, SPIN),                            # 2 threads that own their 2 CPUs spin briefly
    (2, 2.0, True, False, SPIN),                                # one colocated worker owning both cores
    (3, 2.5, False, False, PASSIVE),                            # 3 threads on 2.5 CPUs
    (2, 1.0, True, False, PASSIVE),                             # bench_peer's @2x2
    (4, 2.0, False, False, PASSIVE),
    (None, 8.0, True, True, {}),                                # pinned: one thread
])
def test_a_team_spins_briefly_where_it_owns_its_cpus_and_waits_passively_where_it_outnumbers_them(
        threads, share, colocated, pinned, env, monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    assert wait_env(threads, share, colocated, pinned) == env


@pytest.mark.parametrize("name", ["OMP_WAIT_POLICY", "GOMP_SPINCOUNT"])
def test_an_openmp_wait_setting_in_the_routers_environment_wins(name, monkeypatch):
    monkeypatch.setenv(name, "ACTIVE" if name == "OMP_WAIT_POLICY" else "1000")
    assert wait_env(None, 1.0, True, False) == {}
