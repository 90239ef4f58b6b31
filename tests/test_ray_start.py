"""`start_head`'s one retry of a local Ray head: Ray gives its raylet a fixed 30 s to register and
then raises a bare Exception ("timed out during startup"), which a loaded host (CI's, at the end of
a suite) can hit. The start is tried once more after what the failed one started is ended; any
other failure is raised as it was. The start is given a stand-in for `ray.init` that starts a real
process (the half-started raylet) and fails, so the retry and the clean-up are both seen, and the
session's own Ray is left alone."""

from __future__ import annotations

import subprocess
import sys

import pytest

from router.launch import start_head

TIMED_OUT = ("The current node timed out during startup. This could happen because some of the raylet "
             "failed to startup or the GCS has become overloaded.")
OPTIONS = {"num_cpus": 3, "include_dashboard": False}


class FailingStart:
    """`ray.init` whose first `failures` calls start a child process and raise `error`."""

    def __init__(self, error: Exception, failures: int = 1):
        self.error, self.failures = error, failures
        self.calls: list[dict] = []
        self.children: list[subprocess.Popen] = []
        self.shutdowns = 0

    def __call__(self, **options):
        self.calls.append(options)
        if len(self.calls) <= self.failures:
            self.children.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]))
            raise self.error

    def shutdown(self) -> None:
        self.shutdowns += 1

    def close(self) -> None:
        for child in self.children:
            child.kill()
            child.wait()


def test_a_head_that_timed_out_starting_is_ended_and_started_once_more():
    fake = FailingStart(Exception(TIMED_OUT))
    try:
        start_head(OPTIONS, init=fake, shutdown=fake.shutdown)
        assert fake.calls == [OPTIONS, OPTIONS] and fake.shutdowns == 1
        assert fake.children[0].poll() is not None  # what the failed start left was ended
    finally:
        fake.close()


def test_any_other_start_failure_is_raised_untried():
    fake = FailingStart(RuntimeError("Failed to start the GCS"))
    try:
        with pytest.raises(RuntimeError, match="Failed to start the GCS"):
            start_head(OPTIONS, init=fake, shutdown=fake.shutdown)
        assert fake.calls == [OPTIONS] and fake.shutdowns == 0
    finally:
        fake.close()
