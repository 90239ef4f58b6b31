"""What the router keeps per accepted request, what it streams, and how it fails.

`Stream` is one request between acceptance and its last chunk; `Chunk` is one streamed
message's worth (new tokens, their text, and on the last one the finish reason and usage).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from engine.request import RequestOutput


class QueueFull(Exception):
    """The router's bounded queue is full (RESOURCE_EXHAUSTED)."""


class Unavailable(Exception):
    """Shutting down, an empty pool, or a worker failure (UNAVAILABLE)."""


@dataclass
class Chunk:
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    usage: dict | None = None  # on the last chunk


@dataclass
class Stream:
    """One accepted request as the router tracks it."""

    request_id: str
    num_prompt_tokens: int
    accepted: float
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    usage: dict = field(default_factory=dict)
    first_token_at: float | None = None
    last_token_at: float | None = None
    completion_tokens: int = 0


def merge_outputs(outputs: list[RequestOutput]) -> RequestOutput:
    if len(outputs) == 1:
        return outputs[0]
    last = outputs[-1]
    return RequestOutput(last.request_id, [t for o in outputs for t in o.token_ids], "".join(o.text for o in outputs),
                         last.finish_reason, last.num_prompt_tokens, last.num_output_tokens,
                         sum(o.kv_transfer_s for o in outputs), sum(o.kv_transfer_bytes for o in outputs))
