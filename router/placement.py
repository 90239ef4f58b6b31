"""Placement policy: pure functions over the router's view of each worker.

Decode: most free KV blocks (ties: fewest running). Prefill: shortest queue (requests the
router has sent and not yet got a first token for). Draining workers take nothing new.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.messages import WorkerInfo, WorkerStats


@dataclass
class WorkerView:
    info: WorkerInfo
    actor: object
    state: str = "ready"  # "ready" | "draining" | "stopped"
    free_blocks: int = 0  # estimate: last stats, minus reservations made since
    running: int = 0
    waiting: int = 0
    inflight: set[str] = field(default_factory=set)  # request ids the router placed here
    peers: set[str] = field(default_factory=set)  # prefill: decode workers it holds a handle of
    stats: WorkerStats | None = None

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def accepting(self) -> bool:
        return self.state == "ready"

    def observe(self, stats: WorkerStats) -> None:
        self.stats = stats
        self.free_blocks = stats.blocks_free
        self.running = stats.running
        self.waiting = stats.waiting


def decode_candidates(workers: list[WorkerView], blocks_needed: int = 0) -> list[WorkerView]:
    """Accepting decode workers that look able to hold `blocks_needed`, best first."""
    fits = [w for w in workers if w.accepting and w.free_blocks >= blocks_needed]
    return sorted(fits, key=lambda w: (-w.free_blocks, w.running + len(w.inflight), w.name))


def pick_prefill(workers: list[WorkerView]) -> WorkerView | None:
    ready = [w for w in workers if w.accepting]
    return min(ready, key=lambda w: (len(w.inflight), w.name), default=None)
