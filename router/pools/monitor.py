"""The router's background watch over its workers: events in, failures out, pools healed.

- one long-poll per worker: decode workers send every request's outputs, prefill workers
  their failed KV sends; each event goes to the request's current attempt (stale ones drop).
- the engine's beat every 0.5 s per worker (worker_runtime/engine_loop.py), read without the
  engine thread: an engine silent for `router.unresponsive_s` (a step stuck in a CUDA or NCCL
  call, an endless step) fails the worker, though the actor answers; one silent for half the
  call deadline takes no new request meanwhile (a reserve would wait behind it under the
  admission lock). STEP_FAILURES_LIMIT failed engine steps in a row fail the worker too.
- stats every 0.5 s with a deadline; a worker that answers neither stats nor beat for
  `router.unresponsive_s` is declared failed like a dead one. Each reply carries the worker's prefix-cache changes,
  which keep the placer's index current (router/pools/prefix_index.py). A round is shared:
  an Admin/Status call that arrives while one runs waits for it instead of starting another,
  so no number of Status calls sends more than one stats call per worker at a time.
- a failed worker is killed and taken out of its pool, every request holding state on it is
  told to move (`Retry`), and `heal` starts its replacement with backoff.

Failures are sorted by router/lifecycle/worker_calls.py's table. A poll or stats call that
meets REPLACE (a dead actor, its node or process gone) fails the worker. Any other failed poll
leaves the worker in its pool, suspected, but moves every request on it: the poll may have run
on the worker and taken events from its outbox that never arrived, and a stream must not skip
them. A stats call that fails otherwise only counts towards `unresponsive_s`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from protocol import clock
from protocol.deadline import within
from protocol.messages import TransferFailed
from router.lifecycle.outcomes import Retry
from router.lifecycle.worker_calls import CALL_FAILURES, Outcome, outcome, short
from router.observability.metrics import RouterMetrics
from router.pools.manager import PoolManager
from router.pools.worker_view import WorkerView

log = logging.getLogger(__name__)
POLL_WAIT_S = 0.5
BEAT_EVERY_S = 0.5
STEP_FAILURES_LIMIT = 3  # failed engine steps in a row that get a worker replaced
STATS_EVERY_S = 0.5
HEAL_EVERY_S = 0.25


class Monitor:
    def __init__(self, pools: PoolManager, metrics: RouterMetrics, call_timeout_s: float, unresponsive_s: float,
                 deliver: Callable[[str, object], None], holders_of: Callable[[WorkerView], list],
                 on_change: Callable[[], None]):
        self.pools = pools
        self.metrics = metrics
        self.call_timeout_s = call_timeout_s
        self.unresponsive_s = unresponsive_s
        self.quiet_s = min(call_timeout_s, unresponsive_s) / 2
        self._deliver = deliver  # (attempt id, RequestOutput | Exception)
        self._holders_of = holders_of  # worker -> lives holding state there
        self._on_change = on_change  # capacity may have changed
        self._tasks: set[asyncio.Task] = set()
        self._round: asyncio.Task | None = None  # the stats round in flight

    def spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def start(self) -> None:
        self.spawn(self._stats_loop())
        self.spawn(self._heal_loop())

    def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()

    def watch(self, w: WorkerView) -> None:
        """A worker started: poll it for events, watch its engine's beat."""
        self.spawn(self._poll_loop(w))
        self.spawn(self._beat_loop(w))
        self._on_change()

    def lost(self, w: WorkerView, reason: str) -> None:
        """`w` died or hung: take it out and move every request that held state there."""
        if not self.pools.worker_failed(w, reason):
            return
        self.metrics.remove_worker(w.name)
        self.metrics.observe_worker_failure(w.info.pool)
        self.move_requests(w, f"worker {w.name} failed: {reason}")

    def move_requests(self, w: WorkerView, reason: str) -> None:
        for life in self._holders_of(w):
            life.deliver(life.attempt_id, Retry(reason))
        self._on_change()

    async def _poll_loop(self, w: WorkerView) -> None:
        while not w.stopped:
            try:
                events = await within(w.actor.poll.remote(POLL_WAIT_S), POLL_WAIT_S + self.call_timeout_s)
            except CALL_FAILURES as e:
                if not w.stopped:
                    await self._poll_failed(w, e)
                continue
            w.answered()
            for event in events:
                self._route(w, event)

    async def _poll_failed(self, w: WorkerView, err: BaseException) -> None:
        """A dead worker is failed; otherwise its requests move (the poll's events may be lost)
        and the next poll waits a moment, so a worker that fails every poll is not asked in a loop."""
        timeout_s = POLL_WAIT_S + self.call_timeout_s
        reason = f"no answer within {timeout_s:g} s" if isinstance(err, TimeoutError) else short(err)
        if outcome(err) is Outcome.REPLACE:
            self.lost(w, reason)
            return
        w.suspect()
        self.move_requests(w, f"polling {w.name} failed: {reason}")
        await asyncio.sleep(POLL_WAIT_S)

    def _route(self, w: WorkerView, event) -> None:
        if isinstance(event, TransferFailed):
            self._deliver(event.request_id, Retry(f"KV transfer from {w.name} failed: {event.reason}"))
            return
        self._deliver(event.request_id, event)
        if event.finished:
            w.release(event.request_id)
            self._on_change()

    async def _beat_loop(self, w: WorkerView) -> None:
        while not w.stopped:
            try:
                beat = await within(w.actor.beat.remote(), self.call_timeout_s)
            except CALL_FAILURES as e:
                w.engine_quiet = True  # no beat: no new request until it beats again
                if not w.stopped:
                    self._silent(w, e)
                await asyncio.sleep(BEAT_EVERY_S)
                continue
            w.heard(beat, self.quiet_s)
            if beat.silent_s > self.unresponsive_s:
                self.lost(w, f"its engine made no progress for {beat.silent_s:.0f} s")
            elif beat.failed_steps_in_a_row >= STEP_FAILURES_LIMIT:
                self.lost(w, f"{beat.failed_steps_in_a_row} engine steps failed in a row")
            await asyncio.sleep(BEAT_EVERY_S)

    def _silent(self, w: WorkerView, err: BaseException) -> None:
        """A stats or beat call failed: a dead worker is failed; a silent one once `unresponsive_s` passed."""
        now = clock.now()
        if isinstance(err, CALL_FAILURES) and outcome(err) is Outcome.REPLACE:
            self.lost(w, short(err))
        elif now - w.last_seen > self.unresponsive_s:
            self.lost(w, f"no answer for {now - w.last_seen:.0f} s")

    async def _stats_loop(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(STATS_EVERY_S)

    async def refresh(self) -> None:
        """A stats round over every live worker: the one in flight if there is one, else a new one.
        A caller that is cancelled leaves the round running for the others."""
        if self._round is None or self._round.done():
            self._round = self.spawn(self._stats_round())
        await asyncio.shield(self._round)

    async def _stats_round(self) -> None:
        workers = [w for w in self.pools.all() if not w.stopped]
        results = await asyncio.gather(*(self.pools.fetch_stats(w) for w in workers), return_exceptions=True)
        for w, stats in zip(workers, results, strict=True):
            if isinstance(stats, BaseException):
                self._silent(w, stats)
            else:
                self.metrics.set_worker_gauges(w.name, stats.running, stats.waiting, stats.blocks_used,
                                               stats.blocks_free, stats.blocks_cached)
        self.pools.placer.prune()
        self._on_change()

    async def _heal_loop(self) -> None:
        while True:
            await self.pools.heal()
            await asyncio.sleep(HEAL_EVERY_S)
