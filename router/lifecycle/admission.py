"""The router's queue: requests waiting for capacity, placed strictly first come, first served.

`place(try_place)` calls `try_place(deadline)` (which returns a placement or None when nothing
fits) under a FIFO lock, and while it returns None waits for `notify()` (a request ended, a worker
started, stats changed) or a short tick. Only requests inside `place` count as queued; more
than `max_queue` of them: QueueFull. The lock is never held across anything without a
deadline: `try_place`'s worker calls carry their own, and `deadline` (the router's clock) is the
request's own, so an attempt never waits for an answer past it. A request placed again without
having failed (a Respin) passes `since`, the start of its first wait: its queue timeout runs once.
`place_handoff` is the second wait of router.decode_reservation: after_prefill (a computed prompt
waiting for decode KV), in its own FIFO under the same deadline.

Overload is refused at once, not after `timeout_s`: the queue measures its service rate (the
mean of the last RATE_WINDOW intervals between two placements while requests stayed queued
between them), and a request that
would wait longer than `timeout_s` behind those already queued gets QueueFull at arrival, with
a Retry-After of the excess. With nobody queued, or no rate measured yet, a request is let in.
"""

from __future__ import annotations

import asyncio
import math
import statistics
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TypeVar

from protocol import clock
from protocol.deadline import within
from router.lifecycle.life import RequestLife
from router.lifecycle.outcomes import QueueFull, Unavailable

T = TypeVar("T")
TICK_S = 0.25
RATE_WINDOW = 16  # service intervals averaged
RESPIN_SHOWN_S = 0.05  # a refusal names the time left when the request already waited longer


class Admission:
    def __init__(self, max_queue: int, on_waiting: Callable[[int], None] = lambda n: None):
        self.max_queue = max_queue
        self.waiting = 0
        self._on_waiting = on_waiting  # told the queue length whenever it changes (the router's gauge)
        self._lock = asyncio.Lock()  # FIFO: asyncio.Lock wakes waiters in arrival order
        self._handoff_lock = asyncio.Lock()  # the computed prompts waiting for a decode reservation
        self.handoff_waiting = 0  # requests in place_handoff
        self._capacity = asyncio.Event()
        self._intervals: deque[float] = deque(maxlen=RATE_WINDOW)  # seconds between placements under a queue
        self._last_departure: float | None = None  # the last placement, if it left others queued

    @property
    def service_interval_s(self) -> float | None:
        """Seconds between two placements while the queue is saturated; None before any."""
        return statistics.fmean(self._intervals) if self._intervals else None

    def predicted_wait_s(self) -> float:
        """How long a request arriving now would wait: one service interval per request queued
        ahead of it, and its own; 0 with nobody queued or no interval measured yet."""
        if not self.waiting or self.service_interval_s is None:
            return 0.0
        return (self.waiting + 1) * self.service_interval_s

    def notify(self) -> None:
        self._capacity.set()

    async def place(self, try_place: Callable[[float], Awaitable[T | None]], accepting: Callable[[], bool],
                    timeout_s: float, since: float | None = None, admitted: bool = False) -> tuple[T, float]:
        """The placement and the seconds spent waiting for capacity (0 when it fit at once).
        `since`: when this request's wait began (the router's clock), if before this call;
        `admitted`: it was placed once already and its decode reservation refused (no QueueFull)."""
        if self.waiting >= self.max_queue and not admitted:
            raise QueueFull(f"the router queue is full ({self.max_queue} requests waiting)")
        now = clock.now()
        deadline = (now if since is None else since) + timeout_s
        timed_out = f"no worker had capacity for this request within {timeout_s:g} s"
        if deadline <= now:
            raise Unavailable(timed_out)
        wait_s, left = self.predicted_wait_s(), (timeout_s if since is None else deadline - now)
        if wait_s > left and not admitted:
            limit = f"router.queue_timeout_s ({timeout_s:g} s)"
            waited_before = timeout_s - left > RESPIN_SHOWN_S
            raise QueueFull(f"the cluster is saturated: this request would wait about {wait_s:.2f} s for capacity "
                            f"({self.waiting} requests queued ahead), more than "
                            + (f"the {left:.2f} s left of its {limit}" if waited_before else limit),
                            retry_after_s=math.ceil(wait_s - left))
        self._count(+1)
        try:
            placed, waited = await self._in_turn(self._lock, try_place, accepting, deadline, timed_out)
            self._departed()
            return placed, waited
        finally:
            self._count(-1)

    async def place_handoff(self, try_place: Callable[[float], Awaitable[T | None]], accepting: Callable[[], bool],
                            timeout_s: float, since: float) -> tuple[T, float]:
        """As `place`, for a request whose prompt is computed and whose KV waits on its prefill
        worker for a decode reservation (router.decode_reservation: after_prefill): FIFO among such
        requests only (never behind one waiting for the prefill slot it holds), under the same
        deadline (`since` + `timeout_s`); not counted in `waiting`, QueueFull or the service rate."""
        deadline = since + timeout_s
        timed_out = f"no decode worker had room for this request's KV within {timeout_s:g} s"
        if deadline <= clock.now():
            raise Unavailable(timed_out)
        self.handoff_waiting += 1
        try:
            return await self._in_turn(self._handoff_lock, try_place, accepting, deadline, timed_out)
        finally:
            self.handoff_waiting -= 1

    async def _in_turn(self, lock: asyncio.Lock, try_place: Callable[[float], Awaitable[T | None]],
                       accepting: Callable[[], bool], deadline: float, timed_out: str) -> tuple[T, float]:
        """`try_place` in turn behind `lock`'s earlier waiters until it places, or Unavailable at
        `deadline`; the placement and the seconds waited (0 when it fit at once)."""
        arrived, waited = clock.now(), lock.locked()  # waits from arrival if others are ahead
        try:  # behind the requests queued first, but never past this one's own deadline
            await within(lock.acquire(), max(0.0, deadline - clock.now()))
        except TimeoutError:
            raise Unavailable(timed_out) from None
        try:
            while True:
                placed = await try_place(deadline)
                if placed is not None:
                    return placed, (clock.now() - arrived) if waited else 0.0
                if not accepting():
                    raise Unavailable("the server is shutting down")
                left = deadline - clock.now()
                if left <= 0:
                    raise Unavailable(timed_out)
                waited = True
                self._capacity.clear()
                try:
                    await within(self._capacity.wait(), min(TICK_S, left))  # wakes at the deadline
                except TimeoutError:
                    pass
        finally:
            lock.release()

    def _departed(self) -> None:
        """A placement. The interval since the previous one is a service interval if requests
        stayed queued between them: one that spans an empty queue measures arrivals, not service."""
        now = clock.now()
        if self._last_departure is not None:
            self._intervals.append(now - self._last_departure)
        self._last_departure = now if self.waiting > 1 else None  # others queued: the next interval counts

    def _count(self, change: int) -> None:
        self.waiting += change
        self._on_waiting(self.waiting)


class QueueWaits:
    """What one request waited for in the router's queue: each failed placement names its reason,
    and the time until the next try is charged to it (`spent`, seconds per reason)."""

    def __init__(self, life: RequestLife | None = None) -> None:
        self.life = life  # told the reason of its current wait (the autoscaler reads it)
        self.spent: dict[str, float] = {}
        self._reason: str | None = None
        self._since = 0.0

    def failed(self, reason: str | None, now: float | None = None) -> None:
        """A placement failed for `reason` (None: it succeeded; the last wait ends)."""
        now = clock.now() if now is None else now
        if self._reason is not None:
            self.spent[self._reason] = self.spent.get(self._reason, 0.0) + now - self._since
        self._reason, self._since = reason, now
        if self.life is not None:
            self.life.waiting_for = reason

    def close(self) -> float:
        """End the last wait; the seconds waited in all."""
        self.failed(None)
        return sum(self.spent.values())
