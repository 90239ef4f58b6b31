"""A CPU worker's allocator (worker_runtime/malloc.py): the setting's values, the refusal of
`tcmalloc` on a host without it, and the environment a worker starts with. That a started worker
really runs with it is checked on the shared cluster (tests/test_cluster.py)."""

from __future__ import annotations

import pytest

from router.config.loader import parse_config
from router.config.typed_yaml import ConfigError
from worker_runtime import malloc


def test_an_unknown_allocator_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match="decode.malloc: must be auto, tcmalloc or system"):
        parse_config({"decode": {"malloc": "jemalloc"}}, where="cluster.yaml")


def test_tcmalloc_asked_for_on_a_host_without_it_is_a_config_error(monkeypatch):
    monkeypatch.setattr("router.config.checks.tcmalloc", lambda: None)
    with pytest.raises(ConfigError, match=r"prefill.malloc: is tcmalloc, but this host has no libtcmalloc \(Debian"):
        parse_config({"prefill": {"malloc": "tcmalloc"}}, where="cluster.yaml")
    assert parse_config({"prefill": {"malloc": "auto"}}).prefill.malloc == "auto"  # auto: glibc's, no error


def test_the_worker_environment_preloads_tcmalloc_only_where_asked_and_found(monkeypatch):
    monkeypatch.setattr(malloc, "tcmalloc", lambda: "libtcmalloc_minimal.so.4")
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    assert malloc.worker_env("auto", on_gpu=False) == {"LD_PRELOAD": "libtcmalloc_minimal.so.4"}
    assert malloc.worker_env("tcmalloc", on_gpu=False) == {"LD_PRELOAD": "libtcmalloc_minimal.so.4"}
    assert malloc.worker_env("system", on_gpu=False) == {}
    assert malloc.worker_env("auto", on_gpu=True) == {}
    monkeypatch.setenv("LD_PRELOAD", "libother.so")  # what this process preloads, workers keep
    assert malloc.worker_env("auto", on_gpu=False) == {"LD_PRELOAD": "libtcmalloc_minimal.so.4:libother.so"}
    monkeypatch.setattr(malloc, "tcmalloc", lambda: None)
    assert malloc.worker_env("auto", on_gpu=False) == {}
