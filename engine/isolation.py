"""Finding the request that breaks a forward pass, when the failure names none.

A forward that raises has changed nothing the engine counts (no token computed, no block cached),
so its items can run again. `isolate` runs them again in halves: a half whose forward succeeds is
that half's step (its tokens count, as they would have), a half that fails is halved again, and an
item whose forward fails alone is a culprit. One culprit among n items costs about 2·log2(n)
forwards more than the step; the others lose nothing but the time.

Until one forward succeeds, a worker whose every forward fails (a device gone bad) cannot be told
from a step full of culprits, so isolation gives up after `bit_length(n) + 1` failures with no
success (one culprit fails at most that many before some half succeeds, however it lies) and the
caller fails the whole step as before: retryably, so the requests move. A step of one item fails
that way at once: alone, it cannot be told from a broken worker either.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

Item = TypeVar("Item")
Output = TypeVar("Output")


class ForwardFailed(RuntimeError):
    """The forward itself raised `cause` (nothing of the step was counted)."""

    def __init__(self, cause: Exception):
        super().__init__(str(cause))
        self.cause = cause


@dataclass
class Isolated(Generic[Item, Output]):
    outputs: list[Output] = field(default_factory=list)          # of the halves that ran
    culprits: list[tuple[Item, Exception]] = field(default_factory=list)  # items that failed alone
    gave_up: bool = False  # no forward succeeded within the limit: the step fails as a whole


def isolate(items: list[Item], run: Callable[[list[Item]], list[Output]]) -> Isolated[Item, Output]:
    """Run `items` (a step whose forward failed) again in halves, in their order; `run(part)`
    returns that part's outputs or raises ForwardFailed. Parts keep the items' order, so a part
    of a step scheduled decodes-first is too."""
    found: Isolated[Item, Output] = Isolated()
    limit = len(items).bit_length() + 1
    failures, succeeded = 0, False
    pending = _halves(items) if len(items) > 1 else []
    found.gave_up = not pending
    while pending and not found.gave_up:
        part = pending.pop(0)
        try:
            found.outputs += run(part)
            succeeded = True
        except ForwardFailed as e:
            failures += 1
            if len(part) == 1:
                found.culprits.append((part[0], e.cause))
            else:
                pending[:0] = _halves(part)
            found.gave_up = not succeeded and failures >= limit
    found.gave_up = found.gave_up or not succeeded
    return found


def _halves(items: list[Item]) -> list[list[Item]]:
    mid = len(items) // 2
    return [items[:mid], items[mid:]]
