"""Timing records that cross processes: the per-token gap kind, a step's record, a first token's timing split,
an emulating worker's pacing counters."""

from __future__ import annotations

from dataclasses import dataclass


class TokenKind:
    """One character per output token: what the gap before the token was made of."""

    FIRST = "F"  # the request's first token: no gap (its wait is TTFT)
    DECODE = "D"  # a step of decodes only
    INTERFERENCE = "I"  # a decode step that also computed prefill chunks of other requests
    RECOMPUTE = "R"  # a decode step that also recomputed a preempted request's context (KV memory ran out)
    KV_HANDOFF = "K"  # a decode worker's first token: it waited for the KV transfer and `start`
    PREEMPTED = "P"  # the first token after a preemption: the request's context was recomputed
    MIGRATED = "M"  # the first token on another worker after a failure moved the request


@dataclass(frozen=True, slots=True)
class StepRecord:
    seq: int
    end_unix: float  # time.time() when the step ended
    wall_s: float  # scheduling + forward + sampling
    decode_rows: int
    prefill_rows: int  # prefill chunks (of any length) computed in this step
    prefill_tokens: int
    blocks_used: int  # after the step
    blocks_free: int
    preemptions: int  # requests preempted while scheduling this step
    waiting: int  # requests left waiting for admission
    context_tokens: int = 0  # KV tokens the step read: every item's context after it
    attended_pairs: int = 0  # (new token, key) pairs its attention computed (sizing/cost_model.py)


@dataclass(frozen=True, slots=True)
class PrefillTiming:
    """Engine accepted -> first token, split: kv_wait_s (admission blocked on KV blocks),
    compute_s (wall time of the steps that computed the request's prompt chunks) and queue_s
    (the rest: waiting behind other requests, and between chunks while other work ran)."""

    queue_s: float
    kv_wait_s: float
    compute_s: float


@dataclass(frozen=True, slots=True)
class EmulationStats:
    """How faithfully one worker kept to its emulated device's timings (worker_runtime/pacing.py).
    A step overran when its real work took longer than its modelled time x time_scale; it is then
    late by the difference and nothing was slept."""

    time_scale: float
    steps: int  # steps paced (those that computed something)
    overruns: int
    real_s: float  # the steps' real work, summed
    modelled_s: float  # their modelled time, unscaled, summed
    lateness_s: float  # summed over the overrun steps: real - modelled x time_scale
    max_lateness_s: float
    ratio_p99: float  # p99 over steps of real / modelled (unscaled): the time_scale 99% of steps fit in
    startup_s: float  # the modelled weights load at start-up, unscaled
    # KV transfers landed here over the emulated link (a decode worker's; kv_transfer/pace.py)
    transfers: int = 0
    transfer_overruns: int = 0
    transfer_lateness_s: float = 0.0
    transfer_max_lateness_s: float = 0.0
    transfer_ratio_max: float = 0.0  # the largest real / modelled (unscaled) landing time

    @property
    def overrun_share(self) -> float:
        return self.overruns / self.steps if self.steps else 0.0
