"""An emulated link on the receiving side: each transfer completes (on_complete, then the reply)
no sooner than its modelled time after its blocks were resolved, and the receiver counts how
faithful that was. A transfer whose real landing took longer overran and is late by the difference.
One `LinkClock` per receiver, shared by its channel threads.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

from kv_transfer.config import LinkPace

RATIOS_KEPT = 10_000


@dataclass(frozen=True)
class LinkStats:
    transfers: int = 0
    overruns: int = 0
    lateness_s: float = 0.0  # summed over the overrun transfers: real - modelled x time_scale
    max_lateness_s: float = 0.0
    ratio_max: float = 0.0  # the largest real / modelled (unscaled) over the latest transfers


class LinkClock:
    def __init__(self, pace: LinkPace | None) -> None:
        self.pace = pace
        self._lock = threading.Lock()
        self._stats = LinkStats()
        self._ratios: deque[float] = deque(maxlen=RATIOS_KEPT)

    def hold(self, num_blocks: int, started_at: float) -> None:
        """Channel thread, once the blocks landed: sleep out the transfer's modelled time since
        `started_at` (time.monotonic(), once its blocks were resolved); nothing without an
        emulated link."""
        if self.pace is None:
            return
        target = self.pace.seconds(num_blocks)
        real = time.monotonic() - started_at
        with self._lock:
            late = max(real - target, 0.0)
            s = self._stats
            self._ratios.append(real * self.pace.time_scale / target if target > 0 else 0.0)
            self._stats = LinkStats(s.transfers + 1, s.overruns + (late > 0), s.lateness_s + late,
                                    max(s.max_lateness_s, late), max(self._ratios))
        if real < target:
            time.sleep(target - real)

    def stats(self) -> LinkStats:
        with self._lock:
            return self._stats
