"""Conditional disaggregation: whether a disaggregated request's prefill runs on its decode worker.

Per request, before any reservation: the decode worker the request would go to computes the
prefill itself (its engine's chunked prefill under its token budget, as colocated mode does, then
decodes on) instead of the prefill pool, when either

- `short`: the part of the context that worker does not hold cached is at most
  `max_uncached_tokens` (a short prompt, or a conversation's next turn on the worker holding the
  turns before), so shipping KV would cost more than computing it (Dynamo's
  `max_local_prefill_length`, counted after the cache hit as its disaggregated router does); or
- `prefill_wait`: the prefill pool's work ahead of it, the tokens the router has queued on its
  least busy accepting worker (none accepting: unbounded), exceeds `factor` x the local cost,
  this request's uncached tokens. Both are tokens of prefill work: the rule assumes both pools'
  workers compute prefill at the same rate (the same device); a factor above 1 keeps more
  prefills off the decode workers. And the decode
  worker's rows pay for it: while a prompt is prefilled there, each of its steps carries a chunk
  of it (up to `scheduler.chunk_size` tokens) and every row it decodes waits for that chunk. So
  the wait rule sends a decode worker one prompt at a time (none while a local prefill longer than
  `max_uncached_tokens` is still computing there): its rows' ITL grows by one chunk at most, and
  it lends the prefill pool its spare time without giving up its own (docs/roles.md).

`LocalPrefill.set` changes the thresholds at run time; nothing calls it yet (`auto`, k = 1, wins on
every workload measured with the one-at-a-time rule: docs/roles.md), so they stay the config's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from router.config.schema import LocalPrefillSection
from router.pools.placement import uncached_tokens
from router.pools.worker_view import WorkerView

Reason = Literal["short", "prefill_wait"]


@dataclass(frozen=True)
class LocalPlacement:
    """A disaggregated attempt placed whole on one decode worker (prefill there, chunked)."""

    worker: WorkerView
    reason: Reason
    uncached_tokens: int


class LocalPrefill:
    def __init__(self, section: LocalPrefillSection):
        self.max_uncached_tokens = 0
        self.wait_factor: float | None = None  # None: the wait rule is off
        self.set(section.max_uncached_tokens, section.when_prefill_wait_exceeds)

    def set(self, max_uncached_tokens: int, when_prefill_wait_exceeds: Literal["auto", "off"] | float) -> None:
        """New thresholds, as `router.local_prefill` takes them (ValueError on a bad one)."""
        if max_uncached_tokens < 0:
            raise ValueError(f"max_uncached_tokens must be >= 0, got {max_uncached_tokens}")
        factor = {"auto": 1.0, "off": None}.get(when_prefill_wait_exceeds, when_prefill_wait_exceeds)
        if factor is not None and (isinstance(factor, str) or factor <= 0):
            raise ValueError(f"when_prefill_wait_exceeds must be auto, off or a factor > 0, "
                             f"got {when_prefill_wait_exceeds!r}")
        self.max_uncached_tokens, self.wait_factor = max_uncached_tokens, factor

    @property
    def enabled(self) -> bool:
        return self.max_uncached_tokens > 0 or self.wait_factor is not None

    def reason(self, uncached: int, local_ahead: int, remote_ahead: int | None) -> Reason | None:
        """Why the prefill should run locally, or None (the prefill pool computes it).
        `local_ahead`: the uncomputed tokens of the long prompts the decode worker is prefilling
        already (its short ones are not counted); `remote_ahead`: tokens queued on the least busy
        prefill worker, None when none accepts."""
        if uncached <= self.max_uncached_tokens:
            return "short"
        if self.wait_factor is None or local_ahead > 0:  # one long local prefill at a time (docstring)
            return None
        if remote_ahead is None or remote_ahead > self.wait_factor * uncached:
            return "prefill_wait"
        return None

    def choose(self, decode: WorkerView | None, held_blocks: int, context: int,
               prefill: Sequence[WorkerView]) -> LocalPlacement | None:
        """`decode`: the worker the request would be placed on (None: none fits), holding
        `held_blocks` leading blocks of its `context` tokens; `prefill`: the prefill pool's
        ready workers. The local placement, or None."""
        if decode is None or not self.enabled:
            return None
        uncached = uncached_tokens(context, held_blocks, decode.info.block_size)
        accepting = [w for w in prefill if w.accepting]
        remote_ahead = min((sum(w.prefill_tokens.values()) for w in accepting), default=None)
        long_ahead = sum(n for n in decode.prefill_tokens.values() if n > self.max_uncached_tokens)
        why = self.reason(uncached, long_ahead, remote_ahead)
        return None if why is None else LocalPlacement(decode, why, uncached)
