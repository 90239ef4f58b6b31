"""One attempt to serve a request: place it, run the hand-off, stream its tokens.

Disaggregated: wait (FIFO, bounded) for a prefill slot and a decode reservation -> prefill
prompt + tokens already streamed -> stream the next token at once -> `start` on the decode
worker -> its tokens. With router.prefill_during_reserve, the prefill of a pair that already
has a channel starts while the reservation is in flight; the prefill worker holds the KV back
until `aim` tells it how many leading blocks the reservation found cached. If that reservation
finds no room after all, the prefill is aborted and the request placed again (`Respin`; once:
after that its reservations come first again). With router.decode_reservation: after_prefill the
order turns: wait for a prefill slot -> prefill (its worker holds the KV, the slot stays taken) ->
stream its first token at once -> wait (a FIFO of their own, under the same deadline) for a decode
worker with room, chosen then -> `aim` names it to the prefill worker -> `start`
(router/lifecycle/prefill_first.py; a worker with room while it computes is reserved then).
Colocated: wait for a decode-pool worker with room -> `generate` there. Disaggregated with router.local_prefill, a request whose prefill is
short or whose prefill pool is backed up runs as colocated on its decode worker
(router/lifecycle/local_prefill.py).
Any failure another worker may not have raises `Retry`; the router then starts the next
attempt (router/lifecycle/service.py). Workers are recorded as holders BEFORE a call that may leave
state on them, so a cancel at any moment reaches every worker that may hold some.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator

from protocol import clock
from protocol.deadline import within
from protocol.messages import (
    GenerateTask,
    PrefillResult,
    PrefillTask,
    Reservation,
    Reserved,
    StartDecode,
)
from protocol.outputs import FinishReason, RequestOutput
from router.config.schema import ClusterConfig
from router.lifecycle.admission import Admission, QueueWaits
from router.lifecycle.life import Phase, RequestLife, observe_first_token, queued_failure
from router.lifecycle.local_prefill import LocalPlacement, LocalPrefill
from router.lifecycle.outcomes import (
    Chunk,
    Respin,
    Retry,
    Unavailable,
)
from router.lifecycle.prefill_first import PrefillFirst
from router.lifecycle.reserve_turn import Pair, ReserveInTurn, Reserving
from router.lifecycle.tokens import Tokens
from router.lifecycle.worker_calls import call
from router.observability.metrics import RouterMetrics
from router.pools.manager import PoolManager
from router.pools.worker_view import WorkerView


class Attempts(PrefillFirst, ReserveInTurn):
    def __init__(self, config: ClusterConfig, pools: PoolManager, admission: Admission, metrics: RouterMetrics,
                 accepting):
        self.config = config
        self.rc = config.router
        self.pools = pools
        self.admission = admission
        self.metrics = metrics
        self.accepting = accepting  # () -> bool
        self.placer = pools.placer
        self.tokens = Tokens(pools.placer, metrics, config.router.prefill_timeout_s)
        self.local = LocalPrefill(config.router.local_prefill)  # conditional disaggregation's thresholds
        self._early: set[asyncio.Task] = set()  # calls read by nobody's await (the loop keeps tasks weakly)

    async def run(self, life: RequestLife) -> AsyncIterator[Chunk]:
        runner = self._colocated if self.config.mode == "colocated" else self._disaggregated
        async for chunk in runner(life):
            yield chunk

    # ---- disaggregated ------------------------------------------------------------------
    async def _disaggregated(self, life: RequestLife) -> AsyncIterator[Chunk]:
        waits = QueueWaits(life)
        try:
            pair, waited = await self._placed(life, waits)
        except Respin:  # placed again next: the wait so far stays in its usage split
            self._charge_queue(life, waits.close(), waits)
            raise
        self._observe_queue(life, waited, waits)
        if isinstance(pair, LocalPlacement):  # the decode worker prefills it (conditional disaggregation)
            self.metrics.observe_local_prefill(pair.reason)
            async for chunk in self._generate(life, pair.worker):
                yield chunk
            return
        if pair.decode is None:  # router.decode_reservation: after_prefill
            async for chunk in self._prefill_first(life, pair.prefill):
                yield chunk
            return
        aid, prefill, decode, skip = life.attempt_id, pair.prefill, pair.decode, pair.cached_blocks
        life.to(Phase.PREFILLING)
        try:
            if pair.early is None:
                handle = None if decode.name in prefill.peers else decode.actor  # travels once per pair
                ref = prefill.actor.prefill.remote(self._prefill_task(life, decode, skip), handle)
            else:  # computing already: the KV may leave now (an `aim` Ray delivers first is kept)
                ref = pair.early
                await call(prefill, prefill.actor.aim.remote(aid, skip), self.rc.call_timeout_s, "aim")
                self.metrics.observe_early_prefill("aimed")
            res = await call(prefill, ref, self.rc.prefill_timeout_s, "prefill")
        finally:
            prefill.release(aid)
        prefill.peers.add(decode.name)
        chunk = self._prefilled(life, res, Phase.HANDOFF)
        if chunk.finish_reason is not None:
            life.prefill = None  # a finished prefill-only request freed its blocks; the service
            yield chunk          # aborts the decode reservation it never needed
            return
        started = self._start(life, decode)
        try:
            yield chunk  # before the decode worker confirms `start`: that round trip is not TTFT
        except BaseException:  # the client left at its first token: `start` is still read, never dropped
            self._read_later(started, self.rc.call_timeout_s)
            raise
        async for chunk in self._decode(life, decode, started):
            yield chunk

    async def _place_pair(self, life: RequestLife, waits: QueueWaits,
                          deadline: float) -> Reserving | Pair | LocalPlacement | None:
        """In the queue's turn: a prefill worker and a decode worker whose reservation is sent
        (`Reserving`; with after_prefill a `Pair` with no decode worker yet), a decode worker that
        prefills the request itself (router.local_prefill), or None; no reservation waits past
        `deadline` (the router's clock), when the request is refused."""
        prefill_ready = self._ready_or_wait("prefill", life)
        decode_ready = self._ready_or_wait("decode", life)
        if not decode_ready:
            return waits.failed("workers")
        bs = decode_ready[0].info.block_size
        hashes = life.context_hashes(bs)
        context = life.num_context_tokens()
        local = self._place_local(life, prefill_ready, decode_ready, hashes) if self.local.enabled else None
        if local is not None:
            return local
        if not prefill_ready:
            return waits.failed("workers")
        prefill = self.placer.pick_prefill(prefill_ready, hashes, context, self.rc.max_prefill_inflight)
        if prefill is None:
            return waits.failed("prefill")
        if self.rc.decode_reservation == "after_prefill":  # the decode worker is chosen once it is computed
            self._claim_prefill(life, prefill, hashes)
            self.placer.placed(prefill, hashes)
            return Pair(prefill, None, 0, None)
        needed, reservation = self._reservation(life, bs, deadline)
        final = len(life.prompt_token_ids) + life.sampling.max_tokens
        fits = self.placer.decode_candidates(decode_ready, hashes, needed, final_tokens=final)
        wait_s = deadline - clock.now()
        if not fits or wait_s <= 0:
            return waits.failed("kv")
        decode = fits[0]
        self._hold(life, decode, Phase.RESERVING)  # holders before the calls: a cancel reaches both
        self._claim_prefill(life, prefill, hashes)  # its work counted before `placed` predicts its cache
        decode.took_blocks(needed)  # until its answer: the next placement in turn sees them taken
        self.placer.placed(prefill, hashes)
        ref = decode.actor.reserve.remote(dataclasses.replace(reservation, wait_s=wait_s))
        return Reserving(prefill, decode, needed, ref, self._prefill_early(life, prefill, decode, hashes))

    def _reservation(self, life: RequestLife, block_size: int, deadline: float,
                     pushed: int | None = None) -> tuple[int, Reservation]:
        """The blocks a decode reservation needs for the KV of `life`'s first `pushed` context
        tokens (None: all of them, the prefill still to come) and the token after them, and the
        reservation (its lease covers a prefill, the transfer and a call; its wait_s is the time
        to `deadline`)."""
        pushed = life.num_context_tokens() if pushed is None else pushed
        num_tokens = pushed + 1  # the KV pushed, plus the next token
        lease_s = self.rc.prefill_timeout_s + self.config.kv_transfer.timeout_s + self.rc.call_timeout_s
        return -(-num_tokens // block_size), Reservation(life.attempt_id, num_tokens, lease_s,
                                                          tuple(life.context_token_ids()[:pushed]),
                                                          life.sampling.cache_salt, deadline - clock.now())

    def _prefilled(self, life: RequestLife, res: PrefillResult, then: Phase) -> Chunk:
        """The first token's chunk from a prefill's result (its usage and metrics observed); the
        phase becomes FINISHED if the request ended there, else `then`."""
        life.usage.prefill_ms += res.prefill_s * 1e3
        life.usage.cached_tokens = res.cached_tokens
        observe_first_token(life, res.step_kind, res.timing)
        self.metrics.observe_prefill(res.prefill_s)
        self.metrics.observe_prefix("prefill", life.num_context_tokens(), res.cached_tokens)
        finish = None if res.finish_reason is FinishReason.PREFILLED else res.finish_reason
        life.to(Phase.FINISHED if finish else then)
        return self.tokens.chunk(life, RequestOutput(life.attempt_id, [res.token_id], res.text, finish))

    def _start(self, life: RequestLife, decode: WorkerView):
        """`start` sent to the decode worker holding the reservation (the next token's ref)."""
        return decode.actor.start.remote(StartDecode(life.attempt_id, life.prompt_token_ids,
                                                     list(life.output_token_ids), life.sampling,
                                                     life.emitted_chars, self.config.kv_transfer.timeout_s))

    async def _decode(self, life: RequestLife, decode: WorkerView, started) -> AsyncIterator[Chunk]:
        """The tokens after the hand-off, once the decode worker confirmed `started`."""
        try:
            await call(decode, started, self.rc.call_timeout_s, "start")
        except Retry as e:  # the reservation ended first: say why, when a worker told us
            raise queued_failure(life) or e from None
        async for chunk in self.tokens.stream(life, decode):
            yield chunk

    def _place_local(self, life: RequestLife, prefill_ready: list[WorkerView], decode_ready: list[WorkerView],
                     hashes: list[bytes]) -> LocalPlacement | None:
        """The decode worker the request would go to, placed whole there when `self.local` says
        its prefill should run locally (it then holds blocks for the context and next token)."""
        bs = decode_ready[0].info.block_size
        needed = -(-(life.num_context_tokens() + 1) // bs)
        final = len(life.prompt_token_ids) + life.sampling.max_tokens
        limit = self.config.scheduler.max_num_seqs + self.rc.max_prefill_inflight
        fits = self.placer.decode_candidates(decode_ready, hashes, needed, limit, final)
        w = fits[0] if fits else None
        held = self.placer.matched_blocks("decode", hashes, [w])[w.name] if w is not None else 0
        placed = self.local.choose(w, held, life.num_context_tokens(), prefill_ready)
        if placed is None:
            return None
        self._hold(life, w, Phase.DECODING)
        w.hold(life.attempt_id, placed.uncached_tokens)  # its prefill work, until the first token
        w.took_blocks(needed)
        self.placer.placed(w, hashes)
        return placed

    def _prefill_early(self, life: RequestLife, prefill: WorkerView, decode: WorkerView,
                       hashes: list[bytes]) -> asyncio.Task | None:
        """The prefill call, sent while `decode`'s reservation is in flight, as a task whose outcome
        is read even when nobody awaits it (an early prefill dropped by a failed reservation fails
        after its abort); or None: only where the pair has its channel already (no handle to ship,
        no connect on the path), and not after a Respin (each attempt not a migration was one)."""
        respun = life.attempt > life.migrations
        if not self.rc.prefill_during_reserve or decode.name not in prefill.peers or respun:
            return None
        ref = prefill.actor.prefill.remote(self._prefill_task(life, decode, None), None)  # claimed in turn
        return self._read_later(ref, self.rc.prefill_timeout_s + self.rc.call_timeout_s)

    def _read_later(self, ref, timeout_s: float) -> asyncio.Task:
        """A task that awaits `ref` (within `timeout_s`) whether or not anybody awaits the task, so
        its outcome is always read: an unread failed Ray call is a dropped error."""
        task = asyncio.get_running_loop().create_task(within(ref, timeout_s))
        self._early.add(task)
        task.add_done_callback(self._early_done)
        return task

    def _early_done(self, task: asyncio.Task) -> None:
        self._early.discard(task)
        if not task.cancelled():
            task.exception()  # read: an abandoned one's failure is expected, an awaited one's is raised there

    @staticmethod
    def _prefill_task(life: RequestLife, decode: WorkerView | None, skip_blocks: int | None) -> PrefillTask:
        return PrefillTask(life.attempt_id, life.prompt_token_ids, life.sampling, decode and decode.name,
                           list(life.output_token_ids), life.emitted_chars, skip_blocks=skip_blocks)

    def _claim_prefill(self, life: RequestLife, prefill: WorkerView, hashes: list[bytes]) -> None:
        life.prefill = prefill
        prefill.hold(life.attempt_id, self.placer.prefill_work(prefill, hashes, life.num_context_tokens()))

    def _reserved(self, life: RequestLife, prefill: WorkerView, decode: WorkerView, reserved: Reserved,
                  hashes: list[bytes], counted: int = 0) -> None:
        """`counted`: blocks the router already took off `decode`'s view when it picked it."""
        decode.took_blocks(reserved.num_blocks - reserved.cached_blocks - counted)
        life.usage.kv_cached_blocks = reserved.cached_blocks
        context = life.num_context_tokens()
        self.metrics.observe_prefix("decode", context, reserved.cached_blocks * decode.info.block_size)
        self.metrics.observe_kv_saved(reserved.cached_blocks * decode.info.block_bytes)
        if life.prefill is None:
            self._claim_prefill(life, prefill, hashes)
        self.placer.placed(prefill, hashes)
        self.placer.placed(decode, hashes)

    # ---- colocated ------------------------------------------------------------------------
    async def _colocated(self, life: RequestLife) -> AsyncIterator[Chunk]:
        waits = QueueWaits(life)
        w, waited = await self.admission.place(lambda deadline: self._place_colocated(life, waits), self.accepting,
                                               self.rc.queue_timeout_s, life.queued_since)
        self._observe_queue(life, waited, waits)
        async for chunk in self._generate(life, w):
            yield chunk

    async def _generate(self, life: RequestLife, w: WorkerView) -> AsyncIterator[Chunk]:
        """Prefill (after the tokens already streamed) and decode on `w`, its tokens streamed."""
        task = GenerateTask(life.attempt_id, life.prompt_token_ids, life.sampling, list(life.output_token_ids),
                            life.emitted_chars)
        await call(w, w.actor.generate.remote(task), self.rc.call_timeout_s, "generate")
        async for chunk in self.tokens.stream(life, w):
            yield chunk

    async def _place_colocated(self, life: RequestLife, waits: QueueWaits) -> WorkerView | None:
        """A worker with a turn for the request and free KV blocks for its context, or None: the
        request waits here, under the queue deadline, not in an engine's queue where nothing
        bounds its wait (past saturation those waits were what broke the SLO, not refusals)."""
        limit = self.config.scheduler.max_num_seqs + self.rc.max_prefill_inflight
        workers = self._ready_or_wait("decode", life)
        if not workers:
            return waits.failed("workers")
        bs = workers[0].info.block_size
        hashes = life.context_hashes(bs)
        needed = -(-(life.num_context_tokens() + 1) // bs)
        final = len(life.prompt_token_ids) + life.sampling.max_tokens
        turns = self.placer.decode_candidates(workers, hashes, 0, limit, final)
        if not turns:  # every worker has its fill of requests: a turn, like a prefill slot
            return waits.failed("prefill")
        ready = self.placer.decode_candidates(turns, hashes, needed, limit, final)
        if not ready:
            return waits.failed("kv")
        w, work = self.placer.pick_colocated(ready, hashes, life.num_context_tokens())
        self._hold(life, w, Phase.DECODING, work)  # its prefill's tokens until its first token (Tokens.stream)
        w.took_blocks(needed)  # until its next stats: cached blocks show there as not taken
        self.placer.placed(w, hashes)
        return w

    # ---- shared -------------------------------------------------------------------------
    def _ready_or_wait(self, pool: str, life: RequestLife) -> list[WorkerView]:
        """Ready workers, leaving out those whose work for `life` failed while others are ready; []
        while replacements are on their way; Unavailable when none can come."""
        ready = self.pools.ready(pool)
        health = self.pools.health[pool]
        if not ready and not self.pools.live(pool) and health.starting == 0 and health.failures_in_a_row > 0:
            raise Unavailable(f"the {pool} pool has no worker and cannot start one: {health.last_failure}")
        return [w for w in ready if w.name not in life.failed_on] or ready

    @staticmethod
    def _hold(life: RequestLife, w: WorkerView, phase: Phase, prefill_tokens: int | None = None) -> None:
        life.to(phase)
        life.decode = w
        w.hold(life.attempt_id, prefill_tokens)

    @staticmethod
    def _unhold(life: RequestLife, w: WorkerView) -> None:
        life.to(Phase.QUEUED)
        life.decode = None
        w.release(life.attempt_id)

    def _observe_queue(self, life: RequestLife, waited: float, waits: QueueWaits) -> None:
        waits.close()
        self._charge_queue(life, waited, waits)
        self.metrics.observe_queue(waited)
        if life.decode is not None:
            life.usage.decode_worker = life.decode.name
        if life.prefill is not None:
            life.usage.prefill_worker = life.prefill.name

    def _charge_queue(self, life: RequestLife, waited: float, waits: QueueWaits) -> None:
        """`waited` into the usage, split as docs/metrics.md says: a prefill slot is prefill
        queueing, anything else KV capacity (`waits` closed). With after_prefill the queue waits
        for no decode KV: behind the others, too, it waits for prefill slots."""
        life.usage.queue_ms += waited * 1e3
        prefill_s = min(waited, waits.spent.get("prefill", 0.0))
        if self.config.mode == "disaggregated" and self.rc.decode_reservation == "after_prefill":
            prefill_s = max(0.0, waited - waits.spent.get("kv", 0.0))
        if not life.output_token_ids:
            life.usage.prefill_queue_ms += prefill_s * 1e3
            life.usage.kv_wait_ms += max(0.0, waited - prefill_s) * 1e3
