"""Typed errors of `pdserve bench`; the CLI turns each into a one-line message and exit 2."""

from __future__ import annotations


class BenchError(Exception):
    """A problem with the bench's input or environment that the user can fix."""


class WorkloadError(BenchError, ValueError):
    """A workload option or preset that cannot produce requests."""


class TraceError(WorkloadError):
    """A malformed line in a trace file; names the file and the 1-based line number."""

    def __init__(self, path: str, line: int, reason: str) -> None:
        super().__init__(f"{path}:{line}: {reason}")
        self.path = path
        self.line = line
        self.reason = reason


class SloError(BenchError, ValueError):
    """An `--slo` string that cannot be read."""


class RouterUnreachable(BenchError):
    """The router did not accept a connection within the timeout."""
