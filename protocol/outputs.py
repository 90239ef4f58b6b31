"""What a worker streams back for one request: `RequestOutput`, and why it ended: `FinishReason`.

A `FinishReason`'s value is its text on the wire and in logs and metrics labels; what a client
reads is `public` (an abort reads "cancelled"), the one mapping both front doors use.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from protocol.telemetry import PrefillTiming


class FinishReason(enum.StrEnum):
    STOP = "stop"            # EOS, a stop token, or a stop string
    LENGTH = "length"        # max_tokens
    ABORT = "abort"          # dropped on the worker (cancelled)
    PREFILLED = "prefilled"  # a prefill worker's hand-off: the KV is on its way; never reaches a client
    ERROR = "error"          # this request failed on a worker; never reaches a client as a finish

    @property
    def public(self) -> str:
        """The finish_reason a client reads (gRPC and OpenAI alike)."""
        return "cancelled" if self is FinishReason.ABORT else self.value


@dataclass
class RequestOutput:
    """What one step produced for one request: new tokens, their text, and the finish state."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    kv_transfer_s: float = 0.0  # set by a decode worker on the last output of a pushed request
    kv_transfer_bytes: int = 0
    retryable: bool = False  # set by workers on an error another worker may retry; never by the engine
    num_cached_tokens: int = 0  # prompt (+ resumed output) tokens whose KV the prefix cache supplied
    step_kind: str = ""  # one engine.telemetry.TokenKind per token in token_ids
    prefill_timing: PrefillTiming | None = None  # on the output carrying a request's first token

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
