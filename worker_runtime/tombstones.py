"""`Tombstones`: a worker's bounded, time-limited memory of request ids, each with a value.

Ray does not keep an async actor's calls in order, so a call about a request may come after
the call that ended it, or before the one that starts it: an `abort` before its `prefill`,
`reserve` or `generate`; an `aim` before its early prefill opened the KV stream. A worker
remembers such ids here for `ttl_s` (long enough for any call in flight to arrive) and at most
`max_size` of them (the newest kept), so the memory stays bounded under any load.

Entries are kept in arrival order (a re-added id moves to the back with a fresh time), so the
oldest are always in front: expiry pops from the front only, and every operation is O(1)
amortized (each entry is popped at most once). Not thread-safe: the caller holds its own lock
or stays on one thread.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

from protocol.clock import now as clock_now

V = TypeVar("V")
TOMBSTONE_S = 120.0  # longer than any call's deadline: a late call finds its id still here
# at 120 s, over 800 ended requests a second per worker before one is forgotten early; a forgotten
# id costs a reservation held until its lease ends or a prefill computed for nothing, not a leak
MAX_TOMBSTONES = 100_000


class Tombstones(Generic[V]):
    def __init__(self, ttl_s: float = TOMBSTONE_S, max_size: int = MAX_TOMBSTONES,
                 clock: Callable[[], float] = clock_now) -> None:
        self._ttl_s = ttl_s
        self._max_size = max_size
        self._clock = clock
        self._entries: OrderedDict[str, tuple[float, V]] = OrderedDict()  # id -> (when added, value)

    def __len__(self) -> int:
        self._expire(self._clock())
        return len(self._entries)

    def __contains__(self, request_id: str) -> bool:
        self._expire(self._clock())
        return request_id in self._entries

    def add(self, request_id: str, value: V | None = None) -> None:
        """Remember `request_id` with `value` from now on (again, if it was already here)."""
        now = self._clock()
        self._expire(now)
        self._entries.pop(request_id, None)  # to the back: the front stays the oldest
        self._entries[request_id] = (now, value)
        if len(self._entries) > self._max_size:
            self._entries.popitem(last=False)

    def get(self, request_id: str, default: V | None = None) -> V | None:
        self._expire(self._clock())
        entry = self._entries.get(request_id)
        return default if entry is None else entry[1]

    def pop(self, request_id: str, default: V | None = None) -> V | None:
        """The value of `request_id`, forgotten now; `default` if it is not here."""
        self._expire(self._clock())
        entry = self._entries.pop(request_id, None)
        return default if entry is None else entry[1]

    def _expire(self, now: float) -> None:
        while self._entries:
            _, (added, _) = next(iter(self._entries.items()))
            if now - added < self._ttl_s:
                return
            self._entries.popitem(last=False)
