"""The router's queue (router/lifecycle/admission.py) without a cluster: FIFO placement, the service
interval it measures while saturated, and overload refused at arrival with a Retry-After instead
of after router.queue_timeout_s.

Each runs on a virtual clock (looptime, as `pdserve simulate` does; protocol.clock reads the
loop's time): every sleep and deadline is exact, so the timings are checked exactly, whatever
the host's load, and a wait of seconds costs none."""

from __future__ import annotations

import asyncio
import math

import pytest

from protocol import clock
from router.lifecycle.admission import Admission
from router.lifecycle.outcomes import QueueFull, Unavailable
from simulate.run import run_virtual


class _Slots:
    """Capacity that frees one slot every `every_s` (a saturated cluster finishing requests)."""

    def __init__(self, admission: Admission, every_s: float):
        self.free = 0
        self.admission = admission
        self.every_s = every_s

    async def try_place(self, deadline):
        if self.free > 0:
            self.free -= 1
            return "placed"
        return None

    async def serve(self, count: int) -> None:
        for _ in range(count):
            await asyncio.sleep(self.every_s)
            self.free += 1
            self.admission.notify()


def test_a_request_that_would_wait_past_the_queue_timeout_is_refused_at_arrival():
    """Eight requests queue on a cluster that places one every 0.1 s; once it measured that, a
    ninth that would wait about 0.9 s behind them with a 0.3 s queue timeout is refused at once
    (RESOURCE_EXHAUSTED, retry after the excess), and those queued are placed as before."""
    async def run() -> tuple:
        admission = Admission(max_queue=100)
        slots = _Slots(admission, every_s=0.1)
        server = asyncio.get_running_loop().create_task(slots.serve(8))
        queued = [asyncio.get_running_loop().create_task(admission.place(slots.try_place, lambda: True, 5.0))
                  for _ in range(8)]
        while len(admission._intervals) < 2:  # two placements under a queue: an interval
            await asyncio.sleep(0.01)
        interval = admission.service_interval_s
        t0 = clock.now()
        with pytest.raises(QueueFull) as refused:
            await admission.place(slots.try_place, lambda: True, 0.3)
        refused_after = clock.now() - t0
        waiting_then = admission.waiting
        results = await asyncio.gather(*queued)
        await server
        return interval, refused.value, refused_after, waiting_then, results

    interval, refused, refused_after, waiting_then, results = run_virtual(run)
    assert interval == pytest.approx(0.1, abs=1e-6)
    assert refused_after == 0  # at arrival, not after the 0.3 s queue timeout
    assert "the cluster is saturated" in str(refused) and "router.queue_timeout_s (0.3 s)" in str(refused)
    assert f"({waiting_then} requests queued ahead)" in str(refused)
    # one interval per request ahead and its own, less the 0.3 s it may wait (no await between: same values)
    assert refused.retry_after_s == math.ceil((waiting_then + 1) * interval - 0.3) >= 1
    assert [placed for placed, _ in results] == ["placed"] * 8


def test_nobody_queued_or_no_rate_measured_lets_a_request_in():
    """No prediction without a measured rate: a request then waits and times out as before."""
    async def run() -> float:
        admission = Admission(max_queue=10)
        assert admission.predicted_wait_s() == 0.0

        async def never(deadline):
            return None
        t0 = clock.now()
        with pytest.raises(Unavailable, match="no worker had capacity for this request within 0.2 s"):
            await admission.place(never, lambda: True, 0.2)
        return clock.now() - t0

    assert run_virtual(run) == pytest.approx(0.2, abs=1e-6)


def test_requests_queued_behind_the_head_are_refused_at_their_own_deadline():
    """With no capacity and no rate measured (nothing refused at arrival), three requests queue:
    each is refused when its own queue timeout ends, not when the one ahead of it gives up, and
    not a tick later (before: the ones behind waited for the lock past their deadline)."""
    async def run() -> list[float]:
        admission = Admission(max_queue=10)

        async def never(deadline):
            return None

        async def timed(timeout_s: float) -> float:
            t0 = clock.now()
            with pytest.raises(Unavailable, match=f"within {timeout_s:g} s"):
                await admission.place(never, lambda: True, timeout_s)
            return clock.now() - t0
        return await asyncio.gather(timed(0.6), timed(0.15), timed(0.3))

    head, second, third = run_virtual(run)
    assert head == pytest.approx(0.6, abs=1e-6)
    assert second == pytest.approx(0.15, abs=1e-6)  # while the head still holds the queue
    assert third == pytest.approx(0.3, abs=1e-6)


def test_each_try_gets_the_request_deadline_and_a_request_placed_again_keeps_it():
    """`try_place` is given the request's queue deadline (its worker calls wait no longer), and a
    request placed again without having failed (a Respin) passes `since`: its queue timeout runs
    once from its first wait, not again from the second (before: a Respin heard after two)."""
    async def run() -> tuple:
        admission = Admission(max_queue=10)
        deadlines = []

        async def never(deadline):
            deadlines.append(deadline)
            return None
        first = since = clock.now()
        with pytest.raises(Unavailable):
            await admission.place(never, lambda: True, 0.4, since)
        await asyncio.sleep(0.1)
        t0 = clock.now()
        with pytest.raises(Unavailable, match="within 0.4 s"):
            await admission.place(never, lambda: True, 0.4, since)  # its deadline passed: at once
        again_s = clock.now() - t0
        since = clock.now() - 0.3
        t0 = clock.now()
        with pytest.raises(Unavailable):
            await admission.place(never, lambda: True, 0.4, since)  # 0.1 s of its 0.4 s left
        return first, since, deadlines, again_s, clock.now() - t0

    first, since, deadlines, again_s, left_s = run_virtual(run)
    # every try of a wait is given that wait's deadline (the second wait had none: refused at once)
    assert set(deadlines) == {first + 0.4, since + 0.4} and deadlines[0] == first + 0.4 and deadlines[-1] == since + 0.4
    assert again_s == 0
    assert left_s == pytest.approx(0.1, abs=1e-6)
