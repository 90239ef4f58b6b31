"""The router's view of one worker: its info, last stats, in-flight work, and health marks."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from protocol.messages import WorkerInfo, WorkerStats

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
    prefill_tokens: dict[str, int] = field(default_factory=dict)  # prefill: attempt id -> tokens to compute
    peers: set[str] = field(default_factory=set)  # prefill: decode workers it holds a handle of
    stats: WorkerStats | None = None
    last_seen: float = field(default_factory=time.monotonic)  # last answered call
    suspect_until: float = 0.0
    cache_resync: bool = True  # ask for the whole prefix cache on the next stats call

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def accepting(self) -> bool:
        return self.state == "ready" and time.monotonic() >= self.suspect_until

    @property
    def load(self) -> int:
        return self.running + len(self.inflight)

    def observe(self, stats: WorkerStats) -> None:
        self.stats = stats
        self.free_blocks = stats.blocks_free
        self.running = stats.running
        self.waiting = stats.waiting
        self.last_seen = time.monotonic()

    def suspect(self) -> None:
        self.suspect_until = time.monotonic() + SUSPECT_S
