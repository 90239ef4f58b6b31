"""One request as it flows scheduler -> block allocator -> model runner -> sampler.

`Request` carries explicit counters (`num_computed_tokens`, `block_ids`) and the content hashes
of its full blocks (prompt and output tokens alike: a later turn's prompt holds earlier
outputs); everything else is derived. What users send is validated before it gets here (protocol/sampling.py, protocol/validation.py).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.telemetry import RequestTiming
from protocol.block_hash import extend_hashes, salt_root
from protocol.outputs import FinishReason
from protocol.sampling import SamplingParams

if TYPE_CHECKING:
    import torch

    from engine.detokenizer import IncrementalDetokenizer


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


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
    finish_reason: FinishReason | None = None
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

    def token_slice(self, start: int, end: int) -> list[int]:
        p = self.prompt_token_ids
        if end <= len(p):  # no copy of the whole sequence: a decode step slices one token
            return p[start:end]
        return p[start:] + self.output_token_ids[max(start - len(p), 0):end - len(p)]

    def hashes(self, block_size: int, upto_tokens: int) -> list[bytes]:
        """The block hashes, extended to cover the full blocks among the first `upto_tokens` tokens."""
        if len(self.block_hashes) < upto_tokens // block_size:
            extend_hashes(self.block_hashes, self.prompt_token_ids + self.output_token_ids, block_size, upto_tokens,
                          salt_root(self.sampling.cache_salt))
        return self.block_hashes


@dataclass
class ScheduledItem:
    """One request's share of a step: what the scheduler hands the model runner."""

    request: Request
    num_tokens: int  # new tokens computed for this request in this step

    @property
    def start(self) -> int:
        return self.request.num_computed_tokens

    @property
    def end(self) -> int:
        return self.request.num_computed_tokens + self.num_tokens

    @property
    def is_decode(self) -> bool:
        return self.num_tokens == 1 and self.start > 0

    @property
    def samples(self) -> bool:
        return self.end == self.request.num_tokens
