"""`within(aw, timeout_s)`: await with a deadline, and never lose a cancellation.

`asyncio.wait_for` before Python 3.12 returns the inner result when the awaited thing finishes
in the same loop turn as a cancel of the waiting task: the cancel is lost (CPython gh-86296),
so a client that leaves while a token arrives keeps its request running to the end. Awaiting
inside `asyncio.timeout` delivers every cancel; on expiry it raises TimeoutError, like wait_for.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def within(aw: Awaitable[T], timeout_s: float | None) -> T:
    async with asyncio.timeout(timeout_s):
        return await aw
