"""What a worker streams back for one request: `RequestOutput`."""

from __future__ import annotations

from dataclasses import dataclass

from protocol.telemetry import PrefillTiming


@dataclass
class RequestOutput:
    """What one step produced for one request: new tokens, their text, and the finish state."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "prefilled" | "error"
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
