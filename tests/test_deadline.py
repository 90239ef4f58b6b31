"""protocol.deadline.within: a deadline that never loses a cancellation (what a client's leave relies on)."""

from __future__ import annotations

import asyncio

import pytest

from protocol.deadline import within


def _cancel_as_the_result_lands(wait) -> str:
    """The waiting task is cancelled in the same loop turn as its awaitable gets a result."""
    async def main() -> str:
        fut = asyncio.get_running_loop().create_future()
        task = asyncio.ensure_future(wait(fut, 10))
        await asyncio.sleep(0)  # the task now waits on fut
        fut.set_result("token")
        task.cancel()
        try:
            return await task
        except asyncio.CancelledError:
            return "cancelled"
    return asyncio.run(main())


def test_a_cancel_that_meets_a_result_is_delivered():
    assert _cancel_as_the_result_lands(within) == "cancelled"


def test_the_deadline_raises_timeout_and_a_result_in_time_is_returned():
    async def main() -> None:
        never = asyncio.get_running_loop().create_future()
        with pytest.raises(TimeoutError):
            await within(never, 0.01)
        assert never.cancelled()  # the awaitable was cancelled, not left pending
        soon = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_later(0.01, soon.set_result, 7)
        assert await within(soon, 5) == 7
    asyncio.run(main())
