"""Placement policy: pure functions over the router's view of each worker.

Decode: most free KV blocks (ties: fewest running). Prefill: shortest queue (requests the
router has sent and not yet got a first token for), at most `limit` per worker. Draining
workers take nothing new; a worker whose last call timed out is skipped for a while.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from engine.messages import WorkerInfo, WorkerStats

SUSPECT_S = 5.0  # how long a worker whose call timed out gets no new requests


@dataclass(eq=False)
class WorkerView:
    info: WorkerInfo
    actor: object
    state: str = "ready"  # "ready" | "draining" | "stopped"
    free_blocks: int = 0  # estimate: last stats, minus reservations made since
    running: int = 0
    waiting: int = 0
    inflight: set[str] = field(default_factory=set)  # attempt ids placed here and not yet left
    peers: set[str] = field(default_factory=set)  # prefill: decode workers it holds a handle of
    stats: WorkerStats | None = None
    last_seen: float = field(default_factory=time.monotonic)  # last answered call
    suspect_until: float = 0.0

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def accepting(self) -> bool:
        return self.state == "ready" and time.monotonic() >= self.suspect_until

    def observe(self, stats: WorkerStats) -> None:
        self.stats = stats
        self.free_blocks = stats.blocks_free
        self.running = stats.running
        self.waiting = stats.waiting
        self.last_seen = time.monotonic()

    def suspect(self) -> None:
        self.suspect_until = time.monotonic() + SUSPECT_S


def decode_candidates(workers: list[WorkerView], blocks_needed: int = 0, limit: int | None = None) -> list[WorkerView]:
    """Accepting decode workers that look able to hold `blocks_needed`, best first."""
    fits = [w for w in workers if w.accepting and w.free_blocks >= blocks_needed
            and (limit is None or len(w.inflight) < limit)]
    return sorted(fits, key=lambda w: (-w.free_blocks, w.running + len(w.inflight), w.name))


def pick_prefill(workers: list[WorkerView], limit: int | None = None) -> WorkerView | None:
    ready = [w for w in workers if w.accepting and (limit is None or len(w.inflight) < limit)]
    return min(ready, key=lambda w: (len(w.inflight), w.name), default=None)
