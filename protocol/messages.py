"""Typed messages that cross the Ray boundary between the router and the workers. Small on purpose.

The disaggregated hand-off, one attempt of one request (ids are the router's attempt ids):
  router -> decode   `Reservation`      blocks for prompt + outputs + 1, held as a lease; the
                                        reply (`Reserved`) says how many leading blocks its
                                        prefix cache already holds
  router -> prefill  `PrefillTask`      compute the KV, sample the next token, push the KV
                                        blocks the decode worker does not hold
  prefill -> router  `PrefillResult`    the next token (the client streams it at once)
  prefill -> decode  KV blocks over kv_transfer, or `TransferFailed` when the send fails
  router -> decode   `StartDecode`      tokens and sampling; admitted once the KV has landed
  decode -> router   `RequestOutput`s   tokens, then finished / failed (retryable or not)
  prefill -> router  `TransferFailed`   every failed send, also told to the decode side

Colocated, one attempt is one call: router -> decode `GenerateTask` (prefill and decode there),
then `RequestOutput`s as above.

Prefix cache state reaches the router as diffs: each `WorkerStats` carries a `CacheDelta` with the
next sequence number; a gap (a lost or reordered reply) means the router's copy is stale and it
asks for a snapshot (`stats(resync=True)`), which replaces its copy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from protocol.outputs import FinishReason
from protocol.sampling import SamplingParams
from protocol.telemetry import PrefillTiming


@dataclass(frozen=True)
class WorkerInfo:
    name: str
    pool: str  # "prefill" | "decode"
    node_ip: str
    num_blocks: int
    block_size: int
    cpu: int | None = None  # the core it is pinned to
    prefix_caching: bool = False  # whether its engine caches KV blocks by content hash
    block_bytes: int = 0  # KV bytes of one block (all layers, K and V)
    kernels: str = ""  # the best instruction set its CPU kernels run (AMX, AVX512-BF16, AVX-512, AVX2), or "torch"


@dataclass(frozen=True)
class CacheDelta:
    """Block hashes (protocol/block_hash.py) a worker cached and evicted since its previous delta.

    `seq` counts deltas from 1. A snapshot's `stored` is every cached hash and `removed` is empty:
    replace, don't apply. Otherwise stored and removed are disjoint (net changes): apply both.
    """

    seq: int
    stored: tuple[bytes, ...]
    removed: tuple[bytes, ...]
    snapshot: bool = False


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
    blocks_cached: int = 0  # blocks holding a cached hash, in use or evictable
    prefix_query_tokens: int = 0  # tokens looked up in the prefix cache since start
    prefix_hit_tokens: int = 0  # of those, tokens whose KV was found
    cache: CacheDelta | None = None  # None when prefix caching is off
    blocks_owed: int = 0  # of the free ones, what admitted requests will take for their context (a prompt mid-prefill)


@dataclass(frozen=True)
class EngineBeat:
    """The engine thread's own sign of life, read without it (a `beat` call never waits for the
    engine): how long since its loop last came round (a step ended, a call ran, or an idle wait
    ticked), how many steps it has run, and how many failed in a row. A hung step (a stuck CUDA or
    NCCL call) shows as a growing `silent_s` while the actor itself still answers."""

    name: str
    silent_s: float
    steps: int
    failed_steps_in_a_row: int


@dataclass(frozen=True)
class Reservation:
    request_id: str
    num_tokens: int
    lease_s: float  # freed, and the request failed (retryable), unless started and landed by then
    token_ids: tuple[int, ...] = ()  # the tokens whose KV will be pushed: leading cached blocks are reused
    cache_salt: str = field(default="", repr=False)  # ... when cached under this salt (protocol/block_hash.py)
    wait_s: float = math.inf  # "no room" if the engine has not taken the call by then (the queue deadline)


@dataclass(frozen=True)
class Reserved:
    num_blocks: int
    cached_blocks: int  # leading blocks the decode worker's prefix cache already holds (not sent)


@dataclass(frozen=True)
class PrefillTask:
    """Compute prompt + outputs (outputs: tokens already streamed by an earlier attempt)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    decode_name: str | None  # where the KV goes; None: chosen after the prefill, named by `aim`
    output_token_ids: list[int] = field(default_factory=list)
    emitted_chars: int = 0  # characters of text already streamed to the client
    # leading blocks the decode worker already holds: not sent. None: its reservation is still in
    # flight (the prefill computes meanwhile); the router says it with `aim` and nothing leaves before
    skip_blocks: int | None = 0
    # seconds from the task's arrival that an un-aimed KV is kept; then the request is dropped there
    # (its blocks freed): a router that never aims cannot leak them. None: no limit
    hold_s: float | None = None


@dataclass(frozen=True)
class PrefillResult:
    request_id: str
    token_id: int
    text: str
    finish_reason: FinishReason | None  # PREFILLED: the KV is on its way to the decode worker
    prefill_s: float  # worker-side time from arrival to first token (queueing + compute)
    cached_tokens: int = 0  # context tokens whose KV came from the prefill worker's prefix cache
    step_kind: str = "F"  # protocol.telemetry.TokenKind of the token: F, or M after a migration
    timing: PrefillTiming | None = None  # where the engine's time to this first token went


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
class GenerateTask:
    """Colocated: prefill prompt + outputs and decode on one decode-pool worker (outputs: tokens
    already streamed by an earlier attempt)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    emitted_chars: int = 0  # characters of text already streamed to the client


@dataclass(frozen=True)
class TransferFailed:
    request_id: str
    reason: str
