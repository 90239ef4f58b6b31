"""One request as it flows scheduler -> block allocator -> model runner -> sampler.

`Request` carries explicit counters (`num_computed_tokens`, `block_ids`) and the content hashes
of its full blocks (prompt and output tokens alike: a later turn's prompt holds earlier
outputs); everything else is derived. `SamplingParams.validate` turns bad user input into `InvalidRequest`.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.block_hash import extend_hashes
from engine.limits import (
    FLOAT32_SMALLEST_NORMAL,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
)
from engine.telemetry import PrefillTiming, RequestTiming

if TYPE_CHECKING:
    import torch

    from engine.detokenizer import IncrementalDetokenizer


class InvalidRequest(ValueError):
    """A request the engine refuses; the message is meant for the person who sent it."""


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        if self.max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be at least 1, got {self.max_tokens}")
        _check_normal_number("temperature", self.temperature)
        if self.temperature < 0:
            raise InvalidRequest(f"temperature must be >= 0, got {self.temperature}")
        _check_normal_number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidRequest(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        self._validate_stops()

    def _validate_stops(self) -> None:
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequest(f"{len(self.stop)} stop strings given; at most {MAX_STOP_STRINGS} are allowed")
        if any(s == "" for s in self.stop):
            raise InvalidRequest("stop strings must not be empty")
        longest = max((len(s) for s in self.stop), default=0)
        if longest > MAX_STOP_STRING_CHARS:
            raise InvalidRequest(f"a stop string is {longest} characters; at most {MAX_STOP_STRING_CHARS} are allowed")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequest(f"{len(self.stop_token_ids)} stop_token_ids given; at most "
                                 f"{MAX_STOP_TOKEN_IDS} are allowed")


def _check_normal_number(name: str, value: float) -> None:
    """Refuse nan, +-inf and float32 denormals: the sampler cannot divide by them safely."""
    if not math.isfinite(value):
        raise InvalidRequest(f"{name} must be a finite number, got {value}")
    if 0 < abs(value) < FLOAT32_SMALLEST_NORMAL:
        raise InvalidRequest(f"{name} must be 0 or at least {FLOAT32_SMALLEST_NORMAL} in size (smaller numbers "
                             f"are denormal), got {value}")


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


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    detokenizer: IncrementalDetokenizer
    eos_token_ids: frozenset[int] = frozenset()
    prefill_only: bool = False  # finish after the first token, keeping the KV blocks
    arrival: int = 0  # FIFO order among waiting requests
    output_token_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: Status = Status.WAITING
    finish_reason: str | None = None
    generator: torch.Generator | None = None  # a seeded request's own; the sampler re-seeds it per draw
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # tokens found in the prefix cache at the first admission
    block_hashes: list[bytes] = field(default_factory=list)  # of the leading full blocks; grown lazily
    timing: RequestTiming = field(default_factory=RequestTiming)  # TTFT split and the next token's kind

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefilling(self) -> bool:
        return self.num_uncomputed_tokens > 1

    def token_slice(self, start: int, end: int) -> list[int]:
        p = self.prompt_token_ids
        if end <= len(p):  # no copy of the whole sequence: a decode step slices one token
            return p[start:end]
        return p[start:] + self.output_token_ids[max(start - len(p), 0):end - len(p)]

    def hashes(self, block_size: int, upto_tokens: int) -> list[bytes]:
        """The block hashes, extended to cover the full blocks among the first `upto_tokens` tokens."""
        if len(self.block_hashes) < upto_tokens // block_size:
            extend_hashes(self.block_hashes, self.prompt_token_ids + self.output_token_ids, block_size, upto_tokens)
        return self.block_hashes
