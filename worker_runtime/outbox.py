"""What a worker has for the router, collected until the router's next long-poll.

`push` may be called from any thread (the engine loop, a channel thread); `poll` runs on the
actor's event loop and returns everything pushed since the last poll, waiting up to
`timeout_s` for at least one item. `bind` must run on that loop before the first push.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Generic, TypeVar

from protocol.deadline import within

T = TypeVar("T")


class Outbox(Generic[T]):
    def __init__(self) -> None:
        self._items: list[T] = []
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._event: asyncio.Event | None = None

    def bind(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._event = asyncio.Event()

    def push(self, items: list[T]) -> None:
        with self._lock:
            self._items.extend(items)
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._event.set)

    async def poll(self, timeout_s: float) -> list[T]:
        if not self._items:
            self._event.clear()
            try:
                await within(self._event.wait(), timeout_s)
            except TimeoutError:
                return []
        with self._lock:
            items, self._items = self._items, []
        return items
