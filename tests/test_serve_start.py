"""SIGTERM while `pdserve serve` starts (issue 46, finding 8): it stops at once instead of after
the pools are up, exits 0, and leaves nothing running: no Ray head, no worker actor. The workers
here load emulated weights for ten times router.worker_start_timeout_s (emulate.load_bandwidth),
so a stop that waited for them could only end by the test's hang bound; the signal goes when Ray's
head runs (Ray may still be starting) or when the workers' processes run (the pools starting)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

import pytest
import yaml

from tests.cluster_util import wait_until
from tests.process_util import alive, descendants

pytestmark = pytest.mark.usefixtures("no_shared_ray")  # it starts a Ray head of its own
PDSERVE = [sys.executable, "-m", "cli"]
START_TIMEOUT_S = 300  # router.worker_start_timeout_s; the emulated load takes 10x that
HANG_S = 120  # bounds a hang only


def _config(tmp_path, llama_dir):
    config = tmp_path / "cluster.yaml"
    config.write_text(yaml.safe_dump({
        "model": {"path": llama_dir, "dtype": "float32"},
        "prefill": {"num_cpus": 0.5, "torch_threads": 1}, "decode": {"num_cpus": 0.5, "torch_threads": 1},
        "kv_cache": {"num_blocks": 64},
        # 16 GB of emulated weights at 5 MB/s: 3,200 s before a worker is ready
        "emulate": {"device": "h100", "model": "llama-3.1-8b", "load_bandwidth": "5MB/s"},
        "router": {"port": 0, "http_port": 0, "metrics_port": 0, "worker_start_timeout_s": START_TIMEOUT_S}}))
    return config


@pytest.mark.parametrize("when", ["ray", "workers"])
def test_sigterm_while_starting_stops_at_once_and_leaves_nothing(tmp_path, llama_dir, when):
    marks = {"ray": ("raylet",), "workers": ("ray::WorkerHost",)}[when]  # each pool worker: worker_host/host.py
    log = tmp_path / "serve.log"
    with log.open("w") as stderr:
        proc = subprocess.Popen([*PDSERVE, "serve", "--config", str(_config(tmp_path, llama_dir))],
                                stdout=subprocess.PIPE, stderr=stderr, text=True, start_new_session=True)
    started: dict = {}
    try:
        def seen() -> bool:
            started.update(descendants(proc.pid))
            programs = {cmd.split()[0].rsplit("/", 1)[-1].split(".")[0] for cmd in started.values() if cmd.strip()}
            assert proc.poll() is None, log.read_text()[-3000:]
            return all(m in programs for m in marks)
        wait_until(seen, HANG_S, f"{' and '.join(marks)} to run", every=0.05)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=HANG_S)
        started.update(descendants(proc.pid))
        assert proc.returncode == 0, log.read_text()[-3000:]
        assert "ready in" not in out and "pdserve: stopped" in out, out
        wait_until(lambda: not alive(started), 30, "every process pdserve serve started to exit")
        with pytest.raises(ProcessLookupError):
            os.killpg(proc.pid, 0)
        text = log.read_text()
        assert "Traceback" not in text, text[-3000:]
        if when == "workers":
            assert "stopped while starting" in text, text[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if alive(started):  # a failed check: end what this test started, by its process group only
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
