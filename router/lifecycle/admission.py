"""The router's queue: requests waiting for capacity, placed strictly first come, first served.

`place(try_place)` calls `try_place()` (which returns a placement or None when nothing fits)
under a FIFO lock, and while it returns None waits for `notify()` (a request ended, a worker
started, stats changed) or a short tick. Only requests inside `place` count as queued; more
than `max_queue` of them: QueueFull. The lock is never held across anything without a
deadline: `try_place`'s worker calls carry their own.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from protocol.deadline import within
from router.lifecycle.outcomes import QueueFull, Unavailable

T = TypeVar("T")
TICK_S = 0.25


class Admission:
    def __init__(self, max_queue: int, on_waiting: Callable[[int], None] = lambda n: None):
        self.max_queue = max_queue
        self.waiting = 0
        self._on_waiting = on_waiting  # told the queue length whenever it changes (the router's gauge)
        self._lock = asyncio.Lock()  # FIFO: asyncio.Lock wakes waiters in arrival order
        self._capacity = asyncio.Event()

    def notify(self) -> None:
        self._capacity.set()

    async def place(self, try_place: Callable[[], Awaitable[T | None]], accepting: Callable[[], bool],
                    timeout_s: float) -> tuple[T, float]:
        """The placement and the seconds spent waiting for capacity (0 when it fit at once)."""
        if self.waiting >= self.max_queue:
            raise QueueFull(f"the router queue is full ({self.max_queue} requests waiting)")
        self._count(+1)
        waited_since = None
        deadline = time.monotonic() + timeout_s
        try:
            async with self._lock:
                while True:
                    placed = await try_place()
                    if placed is not None:
                        return placed, (time.perf_counter() - waited_since) if waited_since else 0.0
                    if not accepting():
                        raise Unavailable("the server is shutting down")
                    if time.monotonic() > deadline:
                        raise Unavailable(f"no worker had capacity for this request within {timeout_s:g} s")
                    waited_since = waited_since or time.perf_counter()
                    self._capacity.clear()
                    try:
                        await within(self._capacity.wait(), TICK_S)
                    except TimeoutError:
                        pass
        finally:
            self._count(-1)

    def _count(self, change: int) -> None:
        self.waiting += change
        self._on_waiting(self.waiting)
