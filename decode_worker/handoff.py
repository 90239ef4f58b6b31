"""The decode side of the hand-off: one `Slot` per reserved request until it is admitted.

A slot waits for two things in either order — its KV landing (from the prefill worker's
channel) and `StartDecode` (from the router) — and is admitted once it has both. It ends
early, freeing its blocks, when the router cancels it, the transfer fails (reported by the
receiver or by the prefill side), or its lease runs out. Blocks are never freed while the
receiver writes into them: an end that comes then is deferred until the write finishes.
The KV may come in pieces (a streamed prefill): the slot knows how many blocks to expect and
takes pieces only contiguous and in order; it counts as landed once the last one has.
Pure and thread-safe (channel threads and the actor's loop call it); the worker carries out
the `Action` each call returns. Ended ids are remembered for a while (worker_runtime/tombstones.py)
so a late `reserve` for a cancelled request is refused instead of leaking.
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass

from protocol import clock
from protocol.messages import StartDecode
from worker_runtime.tombstones import Tombstones


class ReservationGone(LookupError):
    """`start` for a request whose reservation ended (or never was); says why when known."""


class Action(enum.Enum):
    WAIT = "wait"    # nothing to do now
    ADMIT = "admit"  # KV landed and start came: add the request to the running batch
    FREE = "free"    # cancelled: free the blocks quietly
    FAIL = "fail"    # free the blocks and tell the router (retryable: it migrates the request)


@dataclass
class Slot:
    blocks: list[int]
    expires_at: float
    cached: int = 0  # leading blocks already holding the KV (prefix cache): the push starts after them
    expected: int = 0  # blocks the push brings, after the cached ones
    received: int = 0  # of those, blocks whose piece has landed
    landing: int = 0  # blocks of the piece the receiver is writing now (0: none)
    landed: bool = False  # all `expected` blocks have landed
    cancelled: bool = False
    failure: str | None = None  # a failure that came while landing
    start: StartDecode | None = None


@dataclass(frozen=True)
class Outcome:
    action: Action
    slot: Slot | None = None
    reason: str = ""


class HandoffTable:
    def __init__(self) -> None:
        self._slots: dict[str, Slot] = {}
        self._ended: Tombstones[str] = Tombstones()  # request id -> why it ended
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._slots)

    def add(self, request_id: str, blocks: list[int], lease_s: float, now: float | None = None,
            cached: int = 0, expected: int | None = None) -> bool:
        """Record a reservation whose first `cached` blocks already hold their KV and whose next
        `expected` (default: all the rest) will be pushed; False if the request was already ended
        (the caller frees)."""
        now = clock.now() if now is None else now
        expected = len(blocks) - cached if expected is None else expected
        assert 0 < expected <= len(blocks) - cached, f"{request_id}: {expected} blocks expected of {len(blocks)}"
        with self._lock:
            if request_id in self._ended or request_id in self._slots:
                return False
            self._slots[request_id] = Slot(list(blocks), now + lease_s, cached, expected)
            return True

    def is_ended(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._ended

    def resolve(self, request_id: str, num_blocks: int, first_block: int = 0) -> list[int] | None:
        """The receiver asks where a transfer's payload (the request's blocks from `first_block`)
        goes; None refuses it. A piece must start exactly after the blocks held so far (cached,
        then landed) and stay within the expected ones: anything else would leave holes."""
        with self._lock:
            slot = self._slots.get(request_id)
            if (slot is None or slot.cancelled or slot.landed or slot.landing or num_blocks < 1
                    or first_block != slot.cached + slot.received
                    or first_block + num_blocks > slot.cached + slot.expected):
                return None
            slot.landing = num_blocks
            return slot.blocks[first_block:first_block + num_blocks]

    def landed(self, request_id: str, error: BaseException | None) -> Outcome:
        with self._lock:
            slot = self._slots.get(request_id)
            if slot is None:
                return Outcome(Action.WAIT)
            piece, slot.landing = slot.landing, 0
            if slot.cancelled:
                return self._end(request_id, Action.FREE)
            if error is not None or slot.failure is not None:
                return self._end(request_id, Action.FAIL, slot.failure or f"KV transfer failed: {error}")
            slot.received += piece
            slot.landed = slot.received == slot.expected
            if not slot.landed:
                return Outcome(Action.WAIT, slot)
            return self._end(request_id, Action.ADMIT) if slot.start else Outcome(Action.WAIT, slot)

    def start(self, msg: StartDecode, now: float | None = None) -> Outcome:
        """Raises ReservationGone when the reservation ended (lease, failed transfer, cancel)."""
        now = clock.now() if now is None else now
        with self._lock:
            slot = self._slots.get(msg.request_id)
            if slot is None or slot.cancelled:
                why = self._ended.get(msg.request_id, "never reserved here")
                raise ReservationGone(f"no reservation for request {msg.request_id!r}: {why or 'cancelled'}")
            slot.start = msg
            if slot.landed:
                return self._end(msg.request_id, Action.ADMIT)
            slot.expires_at = now + msg.kv_timeout_s
            return Outcome(Action.WAIT, slot)

    def cancel(self, request_id: str) -> Outcome:
        with self._lock:
            slot = self._slots.get(request_id)
            if slot is None:
                self._ended.add(request_id, "cancelled")
                return Outcome(Action.WAIT)
            slot.cancelled = True
            if slot.landing:
                return Outcome(Action.WAIT, slot)  # freed by landed()
            return self._end(request_id, Action.FREE)

    def transfer_failed(self, request_id: str, reason: str) -> Outcome:
        """The prefill side could not send this request's KV."""
        with self._lock:
            slot = self._slots.get(request_id)
            if slot is None or slot.landed:
                return Outcome(Action.WAIT)
            if slot.landing:
                slot.failure = f"KV transfer failed: {reason}"
                return Outcome(Action.WAIT, slot)
            return self._end(request_id, Action.FAIL, f"KV transfer failed: {reason}")

    def expire(self, now: float | None = None) -> list[tuple[str, Outcome]]:
        """End every slot whose lease ran out (never one that is landing)."""
        now = clock.now() if now is None else now
        with self._lock:
            late = [rid for rid, s in self._slots.items() if not s.landing and s.expires_at <= now]
            out = []
            for rid in late:
                slot = self._slots[rid]
                reason = ("the router's start never came" if slot.landed
                          else "no KV arrived before the reservation's lease ended")
                out.append((rid, self._end(rid, Action.FAIL, reason)))
            return out

    def _end(self, request_id: str, action: Action, reason: str = "") -> Outcome:
        slot = self._slots.pop(request_id)
        self._ended.add(request_id, reason)
        return Outcome(action, slot, reason)
