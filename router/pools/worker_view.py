"""The router's view of one worker: its info, last stats, in-flight work, and health marks.

`WorkerState` is the worker's place in its pool: READY -> DRAINING -> STOPPED, or READY ->
STOPPED when it fails. Other modules change a view through its methods: the state transitions,
the attempts it holds, the estimate of its free blocks between two stats replies.
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field

from protocol import clock
from protocol.messages import EngineBeat, WorkerInfo, WorkerStats

SUSPECT_S = 5.0  # how long a worker whose call timed out gets no new requests


class WorkerState(enum.StrEnum):  # the values are what Admin/Status reports
    READY = "ready"        # takes new requests (unless suspected)
    DRAINING = "draining"  # takes nothing new; stops once what it holds has finished or moved
    STOPPED = "stopped"    # out of its pool (stopped, or failed and killed): nothing is sent to it


@dataclass(eq=False)
class WorkerView:
    info: WorkerInfo
    actor: object
    state: WorkerState = WorkerState.READY
    free_blocks: int = 0  # estimate: last stats (free less what admitted requests owe), minus placements since
    running: int = 0
    waiting: int = 0
    inflight: set[str] = field(default_factory=set)  # attempt ids placed here and not yet left
    prefill_tokens: dict[str, int] = field(default_factory=dict)  # prefill: attempt id -> tokens to compute
    peers: set[str] = field(default_factory=set)  # prefill: decode workers it holds a handle of
    stats: WorkerStats | None = None
    last_seen: float = field(default_factory=clock.now)  # last answered call
    ready_at: float = field(default_factory=clock.now)  # when it reported ready (the view is made then)
    engine_steps: int = 0  # steps its engine had run at its last beat (progress, per worker)
    engine_quiet: bool = False  # its engine's last beat was long ago: a call to it would wait
    suspect_until: float = 0.0
    cache_resync: bool = True  # ask for the whole prefix cache on the next stats call
    # held across one stats call and the apply of its reply: the worker numbers its cache deltas as
    # it answers, so one call at a time keeps them in order (router/pools/prefix_index.py)
    stats_turn: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def stopped(self) -> bool:
        return self.state is WorkerState.STOPPED

    @property
    def accepting(self) -> bool:
        return self.state is WorkerState.READY and not self.engine_quiet and clock.now() >= self.suspect_until

    @property
    def load(self) -> int:
        return self.running + len(self.inflight)

    # ---- state -------------------------------------------------------------------------
    def drain(self) -> None:
        """Take nothing new (a scale down or a shutdown chose it)."""
        if not self.stopped:
            self.state = WorkerState.DRAINING

    def stop(self) -> bool:
        """Out of the pool; False if it already was."""
        if self.stopped:
            return False
        self.state = WorkerState.STOPPED
        return True

    def suspect(self) -> None:
        self.suspect_until = clock.now() + SUSPECT_S

    # ---- what it answered ----------------------------------------------------------------
    def answered(self) -> None:
        self.last_seen = clock.now()

    def heard(self, beat: EngineBeat, quiet_s: float) -> None:
        """Its engine's beat: `quiet_s` or more of silence takes it off placement until it beats again."""
        self.engine_steps = beat.steps
        self.engine_quiet = beat.silent_s >= quiet_s
        self.answered()

    def observe(self, stats: WorkerStats) -> None:
        self.stats = stats
        self.free_blocks = stats.blocks_free - stats.blocks_owed  # room a new request has
        self.running = stats.running
        self.waiting = stats.waiting
        self.answered()

    # ---- the router's own bookkeeping ------------------------------------------------------
    def hold(self, attempt_id: str, prefill_tokens: int | None = None) -> None:
        """An attempt placed here (a prefill: with the tokens it has to compute)."""
        self.inflight.add(attempt_id)
        if prefill_tokens is not None:
            self.prefill_tokens[attempt_id] = prefill_tokens

    def release(self, attempt_id: str) -> None:
        """The attempt left this worker (finished, moved, cancelled); idempotent."""
        self.inflight.discard(attempt_id)
        self.prefill_tokens.pop(attempt_id, None)

    def took_blocks(self, num_blocks: int) -> None:
        """A reservation took `num_blocks` new blocks (until the next stats say how many are free)."""
        self.free_blocks -= num_blocks

    def had_no_room(self, num_blocks: int) -> None:
        """A reservation of `num_blocks` was refused: fewer are free than the estimate said."""
        self.free_blocks = min(self.free_blocks, num_blocks - 1)
