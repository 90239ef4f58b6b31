"""`init_ray`'s one retry of a local head: Ray gives its raylet a fixed 30 s to register and then
raises a bare Exception ("timed out during startup"), which a loaded host (CI's, at the end of a
suite) can hit. The start is tried once more after what the failed one started is ended; any other
failure is raised as it was. `ray.init` is replaced here by a stand-in that starts a real process
(the half-started raylet) and fails, so the retry and the clean-up are both seen."""

from __future__ import annotations

import subprocess
import sys

import pytest

from router import launch
from router.config.schema import ClusterConfig

TIMED_OUT = ("The current node timed out during startup. This could happen because some of the raylet "
             "failed to startup or the GCS has become overloaded.")


class FailingStart:
    """`ray.init` whose first `failures` calls start a child process and raise `error`."""

    def __init__(self, error: Exception, failures: int = 1):
        self.error, self.failures = error, failures
        self.calls: list[dict] = []
        self.children: list[subprocess.Popen] = []

    def __call__(self, **options):
        self.calls.append(options)
        if len(self.calls) <= self.failures:
            self.children.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]))
            raise self.error


@pytest.fixture
def start(monkeypatch):
    def make(error: Exception) -> FailingStart:
        fake = FailingStart(error)
        monkeypatch.setattr(launch.ray, "init", fake)
        monkeypatch.setattr(launch.ray, "is_initialized", lambda: False)
        monkeypatch.setattr(launch.ray, "shutdown", lambda: None)
        return fake
    yield make


def test_a_head_that_timed_out_starting_is_ended_and_started_once_more(start):
    fake = start(Exception(TIMED_OUT))
    try:
        assert launch.init_ray(ClusterConfig()) is True
        assert len(fake.calls) == 2 and fake.calls[0] == fake.calls[1]
        assert fake.children[0].wait(timeout=10) is not None  # what the failed start left was ended
    finally:
        for child in fake.children:
            child.kill()
            child.wait()


def test_any_other_start_failure_is_raised_untried(start):
    fake = start(RuntimeError("Failed to start the GCS"))
    try:
        with pytest.raises(RuntimeError, match="Failed to start the GCS"):
            launch.init_ray(ClusterConfig())
        assert len(fake.calls) == 1
    finally:
        for child in fake.children:
            child.kill()
            child.wait()
