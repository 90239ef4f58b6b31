"""The HTTP door's bytes in flight: request bodies being read and parsed, bounded before any is read.

A body costs memory from its first byte until its JSON has become a request (its raw bytes, then
the parsed objects, several times bigger for a list of token ids). `BodyBudget` holds at most
`router.max_body_bytes_in_flight` of them: a body declares its size (Content-Length) and is
charged that much before a byte of it is read; a chunked body is charged as its pieces arrive.
A body that does not fit gets 429 (QueueFull) at once, before it is read; every charge is given
back once the body is parsed (or refused). `in_flight` and `peak` are what /metrics-style checks
and the hostile bench read.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from router.lifecycle.outcomes import QueueFull

RETRY_AFTER_S = 1


class BodyBudget:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.in_flight = self.peak = 0

    def charge(self, size: int) -> None:
        """Take `size` more bytes, or QueueFull (nothing taken) when they do not fit."""
        if self.in_flight + size > self.max_bytes:
            raise QueueFull(f"the router is already reading {self.in_flight} bytes of request bodies "
                            f"(router.max_body_bytes_in_flight {self.max_bytes}); retry later",
                            retry_after_s=RETRY_AFTER_S)
        self.in_flight += size
        self.peak = max(self.peak, self.in_flight)

    @contextlib.contextmanager
    def held(self) -> Iterator[BodyCharge]:
        """A charge given back whole when the block ends, however it ends."""
        charge = BodyCharge(self)
        try:
            yield charge
        finally:
            self.in_flight -= charge.size


class BodyCharge:
    """One body's share of the budget."""

    def __init__(self, budget: BodyBudget):
        self.budget, self.size = budget, 0

    def add(self, size: int) -> None:
        self.budget.charge(size)
        self.size += size
