"""Request specs for a bench run: when each request is sent, its prompt ids and output length.

Arrivals are Poisson at a rate, gamma with a burstiness factor (< 1 burstier), or all at
time 0 for a closed loop (the client then caps in-flight requests at `concurrency`). Prompts
are seeded token ids drawn from a vocab range; every request runs with ignore_eos, so
`max_tokens` is its exact output length. Lengths are clipped so prompt + output fits
`max_context`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from bench.errors import WorkloadError

DEFAULT_VOCAB: tuple[int, int] = (16, 256)


@dataclass(frozen=True)
class RequestSpec:
    """One request to send `arrival_s` seconds after the run starts."""

    request_id: str
    arrival_s: float
    prompt_token_ids: tuple[int, ...]
    max_tokens: int

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(frozen=True)
class Workload:
    """Requests sorted by arrival; `concurrency` caps in-flight requests (closed loop if
    every arrival is 0); `metadata` (preset, seed, scaling, burst window) goes in the report."""

    name: str
    requests: tuple[RequestSpec, ...]
    concurrency: int | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)

    def describe(self) -> dict[str, Any]:
        prompt = [r.num_prompt_tokens for r in self.requests]
        output = [r.max_tokens for r in self.requests]
        return dict(self.metadata) | {
            "name": self.name,
            "num_requests": len(self.requests),
            "concurrency": self.concurrency,
            "duration_s": self.requests[-1].arrival_s if self.requests else 0.0,
            "prompt_tokens_total": sum(prompt),
            "output_tokens_total": sum(output),
        }


def arrival_times(n: int, rate: float | None, burstiness: float,
                  rng: np.random.Generator) -> np.ndarray:
    """n send offsets (s), the first at 0. Gamma gaps with shape=burstiness and
    scale=1/(rate*burstiness) (mean 1/rate; burstiness 1 is Poisson). No rate: all at 0."""
    if n < 0:
        raise WorkloadError(f"number of requests must not be negative, got {n}")
    if rate is None or math.isinf(rate):
        return np.zeros(n)
    if rate <= 0 or burstiness <= 0:
        raise WorkloadError(f"rate and burstiness must be positive, got {rate}, {burstiness}")
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    return np.concatenate(([0.0], np.cumsum(gaps[:-1]))) if n else gaps


def sample_lengths(n: int, mean: int, range_ratio: float,
                   rng: np.random.Generator) -> np.ndarray:
    """n integer lengths uniform in [mean*(1-r), mean*(1+r)], each at least 1."""
    if mean < 1 or not 0 <= range_ratio < 1:
        raise WorkloadError(f"length must be >= 1 and range ratio in [0, 1), "
                            f"got {mean}, {range_ratio}")
    low = max(1, math.floor(mean * (1 - range_ratio)))
    high = max(low, math.ceil(mean * (1 + range_ratio)))
    return rng.integers(low, high + 1, size=n)


def random_tokens(count: int, vocab: tuple[int, int],
                  rng: np.random.Generator) -> tuple[int, ...]:
    """`count` token ids uniform in [vocab[0], vocab[1])."""
    low, high = vocab
    if not 0 <= low < high:
        raise WorkloadError(f"vocab range must satisfy 0 <= low < high, got {low}:{high}")
    return tuple(int(t) for t in rng.integers(low, high, size=count))


def clip_lengths(prompt_len: int, output_len: int, max_context: int) -> tuple[int, int]:
    """Shrinks (prompt, output) so their sum fits `max_context`: the output keeps at most
    half of the context, the prompt takes the rest."""
    if max_context < 2:
        raise WorkloadError(f"max context must be at least 2 tokens, got {max_context}")
    if prompt_len + output_len <= max_context:
        return prompt_len, output_len
    output_len = max(1, min(output_len, max_context // 2))
    return max(1, min(prompt_len, max_context - output_len)), output_len


def synthetic_requests(
    prefix: str, arrivals: np.ndarray, prompt_lens: np.ndarray, output_lens: np.ndarray,
    max_context: int, vocab: tuple[int, int], rng: np.random.Generator,
    shared_prefix: tuple[int, ...] = (),
) -> list[RequestSpec]:
    """Random-token prompts (after an optional common prefix), clipped to the context."""
    specs = []
    for index, (arrival, prompt_len, output_len) in enumerate(
            zip(arrivals, prompt_lens, output_lens, strict=True)):
        prompt_len, output_len = clip_lengths(int(prompt_len), int(output_len), max_context)
        head = shared_prefix[:prompt_len]
        tokens = head + random_tokens(prompt_len - len(head), vocab, rng)
        specs.append(RequestSpec(f"{prefix}-{index:05d}", float(arrival), tokens, output_len))
    return specs


def make_workload(name: str, specs: list[RequestSpec], concurrency: int | None,
                  metadata: Mapping[str, Any]) -> Workload:
    """Sorts by arrival (ties by id) and checks the ids are unique."""
    ordered = tuple(sorted(specs, key=lambda spec: (spec.arrival_s, spec.request_id)))
    if len({spec.request_id for spec in ordered}) != len(ordered):
        raise WorkloadError(f"workload {name!r} has duplicate request ids")
    if concurrency is not None and concurrency < 1:
        raise WorkloadError(f"concurrency must be at least 1, got {concurrency}")
    return Workload(name, ordered, concurrency, dict(metadata))
