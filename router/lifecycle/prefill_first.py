"""router.decode_reservation: after_prefill, the part of an attempt (router/lifecycle/attempt.py)
where the prompt is computed before its decode KV is reserved: the prefill worker holds the KV;
a decode worker with room while it computes is reserved and aimed at then; otherwise, after the
first token, the request waits in Admission.place_handoff's FIFO, where a decode worker is picked
from the router's view and reserved on outside the turn (many reservations in flight at once).
`PrefillFirst` is a base of `Attempts` and uses its placement and hand-off helpers
(`_prefill_task`, `_prefilled`, `_reservation`, `_reserved`, `_start`, `_decode`, `_early`).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator

from protocol import clock
from protocol.messages import Reserved
from router.lifecycle.admission import QueueWaits
from router.lifecycle.life import Phase, RequestLife
from router.lifecycle.outcomes import Chunk, Retry
from router.lifecycle.worker_calls import call
from router.pools.worker_view import WorkerView


class PrefillFirst:
    async def _prefill_first(self, life: RequestLife, prefill: WorkerView) -> AsyncIterator[Chunk]:
        """router.decode_reservation: after_prefill. The prompt is computed first and its worker
        holds the KV (its slot stays taken meanwhile: max_prefill_inflight bounds the KV it holds).
        A decode worker with room now is reserved and aimed at while it computes (`_reserve_early`);
        otherwise, after the first token (streamed at once), one is reserved when it has room,
        chosen then (its cache as it is then), under the queue deadline, and aimed at."""
        aid = life.attempt_id
        life.to(Phase.PREFILLING)
        deadline = life.queued_since + self.rc.queue_timeout_s  # the wait for capacity, in all
        hold_s = max(0.0, deadline - clock.now()) + self.rc.prefill_timeout_s + 2 * self.rc.call_timeout_s
        task = dataclasses.replace(self._prefill_task(life, None, None), hold_s=hold_s)
        pushed = life.num_context_tokens()  # the tokens whose KV it computes (not the one it samples)
        try:
            ref = prefill.actor.prefill.remote(task, None)
            early = self._reserve_early(life, prefill, pushed)
            res = await call(prefill, ref, self.rc.prefill_timeout_s, "prefill")
            prefill.prefill_tokens.pop(aid, None)  # computed: no more work there, only its KV
            chunk = self._prefilled(life, res, Phase.RESERVING)
            if chunk.finish_reason is not None:
                life.prefill = None  # it ended at its first token: the worker freed its blocks
                yield chunk
                return
            yield chunk  # at once: a wait for decode KV comes after the first token
            got = None if early is None else await early
            if got is None:
                decode, skip = await self._reserve_after(life, prefill, pushed)
                got = decode, await self._aim(life, prefill, decode, skip)
        finally:
            prefill.release(aid)
        decode, aimed = got
        if not aimed:
            raise Retry(f"{prefill.name} dropped the KV of {life.client_id} before its decode reservation came")
        life.to(Phase.HANDOFF)
        async for chunk in self._decode(life, decode, self._start(life, decode)):
            yield chunk

    def _reserve_early(self, life: RequestLife, prefill: WorkerView, pushed: int) -> asyncio.Task | None:
        """While the prefill computes, when no computed KV waits for a decode worker: the task that
        reserves on the one with room now (the router's view) and aims the KV there, so it leaves
        as it is computed, and `aim` meets no busy prefill step after it; the task's result is
        (that worker, aimed), or None when it had no room after all. None: no worker with room."""
        if self.admission.handoff_waiting:
            return None
        picked = self._pick_now(life, pushed)
        if picked is None:
            return None
        task = asyncio.get_running_loop().create_task(self._reserve_and_aim(life, prefill, *picked, pushed))
        self._early.add(task)
        task.add_done_callback(self._early_done)
        return task

    async def _reserve_and_aim(self, life: RequestLife, prefill: WorkerView, decode: WorkerView, needed: int,
                               pushed: int) -> tuple[WorkerView, bool] | None:
        reserved = await self._reserve_on(life, decode, needed, pushed)
        if reserved is None:
            return None
        self._took(life, prefill, decode, reserved, needed, pushed)
        self.metrics.observe_early_prefill("aimed")
        return decode, await self._aim(life, prefill, decode, reserved.cached_blocks)

    async def _aim(self, life: RequestLife, prefill: WorkerView, decode: WorkerView, skip: int) -> bool:
        """`aim` the prefill worker's KV of `life` at `decode`, whose handle travels once per pair."""
        handle = None if decode.name in prefill.peers else decode.actor
        aimed = await call(prefill, prefill.actor.aim.remote(life.attempt_id, skip, decode.name, handle),
                           self.rc.call_timeout_s, "aim")
        prefill.peers.add(decode.name)
        return aimed

    async def _reserve_after(self, life: RequestLife, prefill: WorkerView, pushed: int) -> tuple[WorkerView, int]:
        """The decode worker that took the reservation of the KV of `life`'s first `pushed` context
        tokens (and the token after them), and the leading blocks it holds cached. A worker is
        picked in turn (Admission.place_handoff) from the router's view of free blocks alone, and
        reserved on outside the turn, so the reservations of many requests are in flight at once;
        one refused is picked again in turn."""
        waits = QueueWaits(life)  # `life.waiting_for` says "kv" meanwhile (the autoscaler reads it)
        try:
            while True:
                (decode, needed), _ = await self.admission.place_handoff(
                    lambda deadline: self._pick_decode(life, waits, pushed), self.accepting,
                    self.rc.queue_timeout_s, life.queued_since)
                reserved = await self._reserve_on(life, decode, needed, pushed)
                if reserved is not None:
                    break
                waits.failed("kv")
        finally:  # the wait follows the first token: it is in the second token's gap, not in the usage's
            waits.close()  # queue and KV waits, which are parts of TTFT (docs/metrics.md)
        self._took(life, prefill, decode, reserved, needed, pushed)
        return decode, reserved.cached_blocks

    def _took(self, life: RequestLife, prefill: WorkerView, decode: WorkerView, reserved: Reserved, needed: int,
              pushed: int) -> None:
        bs = decode.info.block_size
        self._reserved(life, prefill, decode, reserved, life.context_hashes(bs)[:pushed // bs], counted=needed)
        life.usage.decode_worker = decode.name

    async def _pick_decode(self, life: RequestLife, waits: QueueWaits, pushed: int) -> tuple[WorkerView, int] | None:
        """`_pick_now`, or None with the reason of the wait."""
        if not self._ready_or_wait("decode", life):
            return waits.failed("workers")
        return self._pick_now(life, pushed) or waits.failed("kv")

    def _pick_now(self, life: RequestLife, pushed: int) -> tuple[WorkerView, int] | None:
        """The decode worker, in placement order, whose free blocks (as the router sees them) fit
        the KV of `pushed` tokens and the next, held and those blocks counted as taken until its
        answer; and the blocks. None."""
        decode_ready = self._ready_or_wait("decode", life)
        if not decode_ready:
            return None
        bs = decode_ready[0].info.block_size
        needed = -(-(pushed + 1) // bs)
        final = len(life.prompt_token_ids) + life.sampling.max_tokens
        fits = self.placer.decode_candidates(decode_ready, life.context_hashes(bs)[:pushed // bs], needed,
                                             final_tokens=final)
        if not fits:
            return None
        life.decode = fits[0]  # a holder before the call: a cancel reaches it
        fits[0].hold(life.attempt_id)
        fits[0].took_blocks(needed)
        return fits[0], needed

    async def _reserve_on(self, life: RequestLife, decode: WorkerView, needed: int, pushed: int) -> Reserved | None:
        """`decode`'s reservation (no room: None, and it no longer holds the request)."""
        _, reservation = self._reservation(life, decode.info.block_size, life.queued_since + self.rc.queue_timeout_s,
                                           pushed)
        reserved = await call(decode, decode.actor.reserve.remote(reservation), self.rc.call_timeout_s, "reserve")
        if reserved is None:
            decode.had_no_room(needed)
            life.decode = None
            decode.release(life.attempt_id)
        return reserved
