"""router.decode_reservation: before_prefill, pick-then-reserve: the part of an attempt
(router/lifecycle/attempt.py) that awaits a decode reservation outside the queue's turn.

In the turn (`Attempts._place_pair`) the router picks a prefill worker and a decode worker from
its view, claims the prefill slot, counts the blocks as taken on the decode worker's view and
sends `reserve` (`Reserving`); the answer is awaited here, after the turn, so the next request
is placed meanwhile and many reservations are in flight at once. A busy decode engine takes a
`reserve` only at its next step boundary: awaited in the turn, that capped placement at about
one request per decode step (~200/s at 64 H100s, docs/simulate.md). A refused reservation (the
view was stale) releases both workers and the request is placed again in turn, under its first
deadline; if its prefill started meanwhile (router.prefill_during_reserve), a `Respin`.
`ReserveInTurn` is a base of `Attempts` and uses its helpers (`admission`, `_place_pair`,
`_reserved`, `_unhold`, `metrics`).
"""

from __future__ import annotations

import asyncio
import dataclasses

from protocol import clock
from router.lifecycle.admission import QueueWaits
from router.lifecycle.life import RequestLife
from router.lifecycle.local_prefill import LocalPlacement
from router.lifecycle.outcomes import Respin
from router.lifecycle.worker_calls import call
from router.pools.worker_view import WorkerView


class ReserveInTurn:
    async def _placed(self, life: RequestLife, waits: QueueWaits) -> tuple[Pair | LocalPlacement, float]:
        """The attempt's placement and the seconds it waited for capacity. A decode reservation
        (router.decode_reservation: before_prefill) is sent in the queue's turn, from the router's
        view of free blocks, and awaited outside it, so the reservations of many requests are in
        flight at once and placement never waits for a busy decode engine's step; a refused one
        is placed again in turn (a Respin if its prefill started meanwhile)."""
        began, refused = clock.now(), False
        while True:
            placed, waited = await self.admission.place(lambda deadline: self._place_pair(life, waits, deadline),
                                                        self.accepting, self.rc.queue_timeout_s, life.queued_since,
                                                        admitted=refused)
            if not isinstance(placed, Reserving):
                return placed, waited
            pair = await self._reserve_outside(life, placed)
            if pair is not None:
                return pair, (clock.now() - began) if refused else waited
            waits.failed("kv")
            refused = True

    async def _reserve_outside(self, life: RequestLife, r: Reserving) -> Pair | None:
        """`r`'s reservation answered: the pair, or None (no room after all: both released)."""
        reserved = await call(r.decode, r.ref, self.rc.call_timeout_s, "reserve")  # raises: both are aborted
        hashes = life.context_hashes(r.decode.info.block_size)
        if reserved is not None:
            self._reserved(life, r.prefill, r.decode, reserved, hashes, counted=r.needed)
            return Pair(r.prefill, r.decode, reserved.cached_blocks, r.early)
        r.decode.had_no_room(r.needed)
        if r.early is not None:  # the service aborts the prefill and places the request again
            self.metrics.observe_early_prefill("dropped")
            raise Respin(f"{r.decode.name} had no room for the KV after all; the prefill started on "
                         f"{r.prefill.name} meanwhile is dropped")
        self._unhold(life, r.decode)
        life.prefill = None
        r.prefill.release(life.attempt_id)
        return None


@dataclasses.dataclass(frozen=True)
class Pair:
    """Where a disaggregated attempt was placed: its workers, the leading blocks the decode
    reservation found cached (the prefill sends none of them), and the prefill call already sent
    during the reservation (None: not sent yet)."""

    prefill: WorkerView
    decode: WorkerView | None  # None: chosen after the prefill (router.decode_reservation: after_prefill)
    cached_blocks: int
    early: asyncio.Task | None


@dataclasses.dataclass(frozen=True)
class Reserving:
    """A before_prefill placement made in the queue's turn: its prefill slot claimed, `needed`
    blocks taken off the decode worker's view, and the reservation `ref` in flight (awaited
    outside the turn); `early`: the prefill sent meanwhile (router.prefill_during_reserve)."""

    prefill: WorkerView
    decode: WorkerView
    needed: int
    ref: object
    early: asyncio.Task | None
