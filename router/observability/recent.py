"""What the router saw since the autoscaler last looked: arrivals with their lengths, finished
requests' output lengths, and TTFT and token gaps in log-spaced buckets (5% wide: a quantile read
from them is at most 5% high, in constant memory however many tokens stream).

Only kept while an autoscaler reads it (`RouterMetrics.recent` is None otherwise), and `take()`
empties it, so it holds one interval at most.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

BUCKET_RATIO = 1.05
MAX_LENGTHS = 20_000  # lengths kept per window (beyond, only counted)
BUNCH_S = 0.001  # an arrival this soon after the one before joins its bunch (sent together)


class LogHistogram:
    def __init__(self) -> None:
        self.counts: Counter[int] = Counter()
        self.zeros = 0
        self.total = 0

    def add(self, value: float) -> None:
        self.total += 1
        if value <= 0:
            self.zeros += 1
        else:
            self.counts[math.floor(math.log(value) / math.log(BUCKET_RATIO))] += 1

    def quantile(self, q: float) -> float | None:
        """The q-quantile (0-1), read as its bucket's upper edge; None when empty."""
        if not self.total:
            return None
        rank, seen = q * self.total, self.zeros
        if seen >= rank:
            return 0.0
        for bucket in sorted(self.counts):
            seen += self.counts[bucket]
            if seen >= rank:
                return BUCKET_RATIO ** (bucket + 1)
        return BUCKET_RATIO ** (max(self.counts) + 1)


@dataclass
class Window:
    arrivals: int = 0
    # the sum of the squares of its arrival bunches' sizes (arrivals within BUNCH_S of the one
    # before): equal to `arrivals` when none coincide; a trace sent in batches reads larger
    bunch_sq: int = 0
    prompt_lengths: list[int] = field(default_factory=list)
    asked_output: list[int] = field(default_factory=list)  # max_tokens of the arrivals
    output_lengths: list[int] = field(default_factory=list)  # completion tokens of finished requests
    ttft: LogHistogram = field(default_factory=LogHistogram)
    itl: LogHistogram = field(default_factory=LogHistogram)


class RecentLoad:
    def __init__(self) -> None:
        self.window = Window()
        self._last_at: float | None = None
        self._bunch = 0  # the size of the bunch the last arrival joined (in this window)

    def arrived(self, prompt_tokens: int, max_tokens: int, at: float) -> None:
        """One arrival, accepted at `at` (the router's clock)."""
        w = self.window
        w.arrivals += 1
        joins = self._last_at is not None and at - self._last_at <= BUNCH_S and self._bunch > 0
        self._bunch = self._bunch + 1 if joins else 1
        w.bunch_sq += 2 * self._bunch - 1  # (b + 1)^2 - b^2: the bunch grew by one
        self._last_at = at
        if len(w.prompt_lengths) < MAX_LENGTHS:
            w.prompt_lengths.append(prompt_tokens)
            w.asked_output.append(max_tokens)

    def finished(self, completion_tokens: int) -> None:
        if len(self.window.output_lengths) < MAX_LENGTHS:
            self.window.output_lengths.append(completion_tokens)

    def first_token(self, seconds: float) -> None:
        self.window.ttft.add(seconds)

    def token_gap(self, seconds: float) -> None:
        self.window.itl.add(seconds)

    def take(self) -> Window:
        """The window so far; a new one starts."""
        window, self.window, self._bunch = self.window, Window(), 0
        return window
