"""Typed messages that cross the Ray boundary between the router and the workers. Small on purpose.

The disaggregated hand-off, one attempt of one request (ids are the router's attempt ids):
  router -> decode   `Reservation`      blocks for prompt + outputs + 1, held as a lease
  router -> prefill  `PrefillTask`      compute the KV, sample the next token, push the KV
  prefill -> router  `PrefillResult`    the next token (the client streams it at once)
  prefill -> decode  KV blocks over kv_transfer, or `TransferFailed` when the send fails
  router -> decode   `StartDecode`      tokens and sampling; admitted once the KV has landed
  decode -> router   `RequestOutput`s   tokens, then finished / failed (retryable or not)
  prefill -> router  `TransferFailed`   every failed send, also told to the decode side
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.request import SamplingParams


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
class Reservation:
    request_id: str
    num_tokens: int
    lease_s: float  # freed, and the request failed (retryable), unless started and landed by then


@dataclass(frozen=True)
class PrefillTask:
    """Compute prompt + outputs (outputs: tokens already streamed by an earlier attempt)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    decode_name: str  # where the KV goes
    output_token_ids: list[int] = field(default_factory=list)
    emitted_chars: int = 0  # characters of text already streamed to the client


@dataclass(frozen=True)
class PrefillResult:
    request_id: str
    token_id: int
    text: str
    finish_reason: str | None  # "prefilled" = KV is on its way to the decode worker
    prefill_s: float  # worker-side time from arrival to first token (queueing + compute)


@dataclass(frozen=True)
class StartDecode:
    """Continue a request on the decode worker that holds its reservation (KV of all but the
    last output token)."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling: SamplingParams
    emitted_chars: int
    kv_timeout_s: float  # the KV must land within this after start, else the lease ends


@dataclass(frozen=True)
class TransferFailed:
    request_id: str
    reason: str
