"""What each engine step did, and what each output token and first token waited for.

`StepLog` keeps the last `capacity` `StepRecord`s of one engine in a ring: when a step ended
(wall clock, so the records of several workers and a client on one host line up), its wall
time, decode rows, prefill chunks and tokens, KV blocks used and free after it, and the
preemptions its scheduling made. `since(seq)` returns the records after `seq`, so a poller
that remembers the last seq it saw never gets one twice (a jump in seq says the ring overflowed).

Every output token carries one character (`TokenKind`) naming what the gap before it was made
of, decided where it is known, in the step that sampled it. Every first token carries a
`PrefillTiming`: where the time from the engine accepting the request to that token went.
The router joins both into the request's usage (router/lifecycle/attempt.py); `pdserve bench` turns them
into the bottleneck report (bench/bottleneck.py).
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

from protocol import clock
from protocol.telemetry import PrefillTiming, StepRecord, TokenKind


class StepLog:
    """A bounded ring of step records, numbered from 1."""

    def __init__(self, capacity: int = 100_000):
        self._records: deque[StepRecord] = deque(maxlen=capacity)
        self.last_seq = 0

    def append(self, **fields) -> StepRecord:
        self.last_seq += 1
        record = StepRecord(self.last_seq, clock.unix(), **fields)
        self._records.append(record)
        return record

    def since(self, seq: int) -> list[StepRecord]:
        """The records numbered after `seq`, oldest first (those still in the ring). Reads only
        those, from the newest end: a poller asking for the last few steps of a full ring (it
        runs on the engine's thread) costs a few records, not the ring's capacity."""
        newer = min(self.last_seq - seq, len(self._records))
        if newer <= 0:
            return []
        return list(itertools.islice(reversed(self._records), newer))[::-1]


class KVWaitClock:
    """Cumulative seconds during which admission stood still because the head of the waiting
    queue could not get KV blocks. A request's wait for KV is how much `total()` grew while it
    waited: everyone behind a blocked head waits for those blocks too (FIFO)."""

    def __init__(self) -> None:
        self._total = 0.0
        self._since: float | None = None

    def total(self, now: float | None = None) -> float:
        now = clock.now() if now is None else now
        return self._total + (now - self._since if self._since is not None else 0.0)

    def set_blocked(self, blocked: bool, now: float | None = None) -> None:
        now = clock.now() if now is None else now
        if blocked and self._since is None:
            self._since = now
        elif not blocked and self._since is not None:
            self._total += now - self._since
            self._since = None


@dataclass
class RequestTiming:
    """One request's counters for its `PrefillTiming` and the kind of its next token."""

    added_at: float = field(default_factory=clock.now)
    kv_mark: float = 0.0  # the KV clock's total when the request last started waiting
    kv_wait_s: float = 0.0
    compute_s: float = 0.0
    next_kind: str = TokenKind.FIRST  # "" once a token was made here: the step decides

    def waiting(self, clock: KVWaitClock) -> None:
        self.kv_mark = clock.total()

    def admitted(self, clock: KVWaitClock) -> None:
        self.kv_wait_s += clock.total() - self.kv_mark

    def preempted(self, clock: KVWaitClock) -> None:
        self.waiting(clock)
        self.next_kind = self.next_kind or TokenKind.PREEMPTED

    def take_kind(self, step_kind: str) -> str:
        kind, self.next_kind = self.next_kind or step_kind, ""
        return kind

    def first_token(self) -> PrefillTiming:
        total = clock.now() - self.added_at
        return PrefillTiming(max(0.0, total - self.kv_wait_s - self.compute_s), self.kv_wait_s, self.compute_s)
