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


@pytest.mark.parametrize("choice", ["auto", "system"])
def test_a_benchmark_restarts_itself_with_the_allocator_a_worker_would_run(choice):
    """bench_step and profile_step measure with a worker's allocator: exec_as_worker restarts the
    process (same interpreter, same arguments) with tcmalloc preloaded (auto, where the host has
    it) or without it (system), and returns at once in a process that already runs it."""
    import os
    import subprocess
    import sys

    code = "import sys; from worker_runtime import malloc; malloc.exec_as_worker(sys.argv[1]); print(malloc.in_use(), sys.argv[1:])"
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "PDSERVE_MALLOC_REEXEC")}
    if choice == "system" and malloc.tcmalloc():
        env["LD_PRELOAD"] = malloc.tcmalloc()  # started with it: the restart drops it
    done = subprocess.run([sys.executable, "-c", code, choice, "x"], capture_output=True, text=True, env=env,
                          timeout=60, check=True)
    expected = "tcmalloc" if choice == "auto" and malloc.tcmalloc() else "system"
    assert done.stdout.strip() == f"{expected} ['{choice}', 'x']"
