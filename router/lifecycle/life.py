"""One accepted request's life as the router keeps it: a phase with explicit transitions.

    QUEUED -> RESERVING -> PREFILLING -> HANDOFF -> DECODING -> FINISHED      (disaggregated)
    QUEUED -> PREFILLING -> RESERVING -> HANDOFF -> DECODING -> FINISHED      (router.decode_reservation:
                                                                               after_prefill)
    QUEUED -> DECODING -> FINISHED                          (colocated; disaggregated, prefilled locally)
    any live phase -> QUEUED (a failed attempt: the request moves, `migrations` += 1)
    any live phase -> FAILED | CANCELLED

Each attempt has its own id (`attempt_id`, `<key>.<attempt>.<nonce>`: the random nonce makes it
unguessable on the KV network and the workers' logs): what the workers know the request by. Events
from an earlier attempt carry its old id and are ignored, so a late token or failure from a
worker the request left can never reach the client. `holders` are the workers that may hold
state of the current attempt: on a cancel or a failed attempt each gets an `abort`.
"""

from __future__ import annotations

import asyncio
import enum
import secrets
from dataclasses import dataclass, field

from protocol import clock
from protocol.block_hash import extend_hashes, salt_root
from protocol.sampling import SamplingParams
from protocol.telemetry import PrefillTiming
from protocol.usage import Usage


class Phase(enum.Enum):
    QUEUED = "queued"          # waiting for capacity (counts towards router.max_queue)
    RESERVING = "reserving"    # reserve call in flight on a decode worker (after_prefill: the KV waits for one)
    PREFILLING = "prefilling"  # prefill call in flight; the reservation is held (after_prefill: none yet)
    HANDOFF = "handoff"        # next token streamed; the KV is moving, start sent
    DECODING = "decoding"      # tokens come from the decode worker
    FINISHED = "finished"
    FAILED = "failed"
    CANCELLED = "cancelled"


ENDED = frozenset({Phase.FINISHED, Phase.FAILED, Phase.CANCELLED})
_LIVE_EXITS = {Phase.QUEUED, Phase.FAILED, Phase.CANCELLED}
TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    Phase.QUEUED: frozenset({Phase.RESERVING, Phase.PREFILLING, Phase.DECODING} | _LIVE_EXITS),
    Phase.RESERVING: frozenset({Phase.PREFILLING, Phase.HANDOFF} | _LIVE_EXITS),
    Phase.PREFILLING: frozenset({Phase.RESERVING, Phase.HANDOFF, Phase.FINISHED} | _LIVE_EXITS),
    Phase.HANDOFF: frozenset({Phase.DECODING, Phase.FINISHED} | _LIVE_EXITS),
    Phase.DECODING: frozenset({Phase.FINISHED} | _LIVE_EXITS),
    Phase.FINISHED: frozenset(),
    Phase.FAILED: frozenset(),
    Phase.CANCELLED: frozenset(),
}


@dataclass(eq=False)
class RequestLife:
    client_id: str
    key: int  # the router's own number for the request
    prompt_token_ids: list[int]
    sampling: SamplingParams
    accepted: float
    phase: Phase = Phase.QUEUED
    attempt: int = 0
    migrations: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    emitted_chars: int = 0
    prefill: object | None = None  # WorkerView holding prefill state of this attempt
    decode: object | None = None   # WorkerView holding the reservation / the running request
    last_failure: str = ""
    failed_on: set[str] = field(default_factory=set)  # live workers whose work for it failed: placed elsewhere
    events: asyncio.Queue = field(default_factory=asyncio.Queue)  # (attempt_id, RequestOutput | Exception)
    usage: Usage = field(default_factory=Usage)  # what the client is told at the end; never read to decide
    first_token_at: float | None = None
    last_token_at: float | None = None
    block_hashes: list[bytes] = field(default_factory=list)  # of the context's full blocks, grown lazily
    nonce: str = field(default_factory=lambda: secrets.token_hex(16))
    caller: str = ""  # who sent it (router/frontdoor/access.py caller_id): client ids are unique per caller
    queued_since: float = field(default_factory=clock.now)  # its queue timeout runs from here
    # why its last placement failed while queued ("workers", "prefill" (no slot), "kv" (no room)); None: placed
    waiting_for: str | None = None

    @property
    def scoped_id(self) -> tuple[str, str]:
        return self.caller, self.client_id

    @property
    def attempt_id(self) -> str:
        return f"{self.key}.{self.attempt}.{self.nonce}"

    @property
    def ended(self) -> bool:
        return self.phase in ENDED

    @property
    def holders(self) -> list:
        return [w for w in (self.prefill, self.decode) if w is not None]

    def to(self, phase: Phase) -> None:
        assert phase in TRANSITIONS[self.phase], f"request {self.client_id}: {self.phase.name} -> {phase.name}"
        self.phase = phase

    def record(self, token_ids: list[int], text: str) -> None:
        """Tokens and text that went to the client."""
        self.output_token_ids.extend(token_ids)
        self.emitted_chars += len(text)

    def retry(self, reason: str, migrated: bool = True) -> list:
        """End this attempt (back to QUEUED under a new attempt id); returns its holders to abort.
        `migrated`: the attempt failed (not so for a Respin, whose queue timeout keeps running)."""
        held = self.holders
        if migrated:
            self.queued_since = clock.now()
        self.to(Phase.QUEUED)
        self.attempt += 1
        self.migrations += migrated
        self.last_failure = reason
        self.prefill = self.decode = None
        return held

    def end(self, phase: Phase) -> list:
        """FINISHED / FAILED / CANCELLED; returns the holders that may still hold state."""
        held = self.holders
        self.to(phase)
        self.prefill = self.decode = None
        return held

    def release(self) -> list:
        """Forget the holders (the request ended); returns them, to abort what they may hold."""
        held = self.holders
        self.prefill = self.decode = None
        return held

    def deliver(self, attempt_id: str, item) -> bool:
        """Queue a worker event if it belongs to the current attempt."""
        if attempt_id != self.attempt_id or self.ended:
            return False
        self.events.put_nowait((attempt_id, item))
        return True

    def num_context_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def context_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def context_hashes(self, block_size: int) -> list[bytes]:
        """Block hashes of prompt + outputs so far (what placement matches against the caches)."""
        n = self.num_context_tokens()
        if len(self.block_hashes) < n // block_size:
            extend_hashes(self.block_hashes, self.context_token_ids(), block_size, n,
                          salt_root(self.sampling.cache_salt))
        return self.block_hashes[:n // block_size]


def observe_first_token(life: RequestLife, kind: str, timing: PrefillTiming | None) -> None:
    """Appends the kinds of the tokens about to stream (engine/telemetry.py); before the
    request's first token, adds where the worker's time to it went."""
    life.usage.token_steps += kind
    if timing is not None and not life.output_token_ids:
        life.usage.kv_wait_ms += timing.kv_wait_s * 1e3
        life.usage.prefill_queue_ms += timing.queue_s * 1e3
        life.usage.prefill_compute_ms += timing.compute_s * 1e3


def queued_failure(life: RequestLife) -> Exception | None:
    """The first failure queued for the current attempt (the queue is emptied: the attempt is over)."""
    found = None
    while not life.events.empty():
        aid, item = life.events.get_nowait()
        if found is None and aid == life.attempt_id and isinstance(item, Exception):
            found = item
    return found
