"""Typed messages that cross the Ray boundary between the router and the workers. Small on purpose."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerInfo:
    name: str
    pool: str  # "prefill" | "decode"
    node_ip: str
    num_blocks: int
    block_size: int
    cpu: int | None = None  # the core it is pinned to


@dataclass(frozen=True)
class WorkerStats:
    name: str
    running: int
    waiting: int
    blocks_used: int
    blocks_free: int
    blocks_total: int
    channels: int
    served: int


@dataclass(frozen=True)
class PrefillResult:
    request_id: str
    token_id: int
    text: str
    finish_reason: str | None  # "prefilled" = KV is on its way to the decode worker
    prefill_s: float  # worker-side time from arrival to first token (queueing + compute)
