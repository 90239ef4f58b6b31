"""Mooncake request traces (JSONL: timestamp ms, input_length, output_length, hash_ids).

Each hash id names a 512-token prompt block; requests whose hash ids agree at the start
share that much prompt. Replay builds every prompt as the concatenation of one token block per
hash id, seeded by (seed, hash id) alone, so a hash id is the same tokens in every request and
every run and shared prefixes are really shared token ids; a prompt that ends inside a block
takes that block's leading tokens, and one longer than its blocks is padded with tokens of its
own. Prefix caching sees the reuse the trace records. `TraceScaling` fits an hour of
production traffic onto a small model: lengths (and the block size with them) are divided by
`length_scale`, timestamps by `time_scale`, and only `window` is kept.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.errors import TraceError, WorkloadError
from bench.workload import RequestSpec, Workload, clip_lengths, make_workload, random_tokens

TRACE_BLOCK_TOKENS = 512
_PROMPT_BLOCK_STREAM = 0
_PADDING_STREAM = 1


@dataclass(frozen=True)
class TraceRecord:
    """One trace line, unscaled."""

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


@dataclass(frozen=True)
class TraceScaling:
    """How a trace is fitted to the bench; `as_dict` goes into the report verbatim."""

    length_scale: float = 1.0
    time_scale: float = 1.0
    window_start_s: float = 0.0
    window_end_s: float | None = None

    def __post_init__(self) -> None:
        if self.length_scale <= 0 or self.time_scale <= 0:
            raise WorkloadError("--length-scale and --time-scale must be positive")
        if self.window_end_s is not None and self.window_end_s <= self.window_start_s:
            raise WorkloadError("--window END must be after START")

    @property
    def block_tokens(self) -> int:
        """Tokens per hash-id block after scaling (512 / length_scale, at least 1)."""
        return max(1, round(TRACE_BLOCK_TOKENS / self.length_scale))

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {
            "block_tokens": self.block_tokens,
            "lengths": f"trace lengths / {self.length_scale:g}",
            "time": f"trace timestamps / {self.time_scale:g}, relative to the window start",
        }


def parse_window(text: str) -> tuple[float, float | None]:
    """'START:END' in seconds of the trace ('60:' = from 60 s to the end)."""
    start, sep, end = text.partition(":")
    try:
        if not sep:
            raise ValueError("missing ':'")
        return float(start or 0.0), float(end) if end else None
    except ValueError as err:
        raise WorkloadError(f"--window {text!r}: expected START:END in seconds ({err})") from err


def read_trace(path: str | Path) -> list[TraceRecord]:
    """Every record of a trace file; `TraceError` names the first malformed line."""
    try:
        with Path(path).open(encoding="utf-8") as handle:
            return list(_parse_lines(str(path), handle))
    except OSError as err:
        raise WorkloadError(f"cannot read trace {path}: {err.strerror or err}") from err
    except UnicodeDecodeError as err:
        raise WorkloadError(f"trace {path} is not UTF-8 text") from err


def _parse_lines(path: str, lines: Iterator[str]) -> Iterator[TraceRecord]:
    for line_no, line in enumerate(lines, start=1):
        if line.strip():
            yield parse_trace_line(line, path, line_no)


def parse_trace_line(line: str, path: str, line_no: int) -> TraceRecord:
    """One JSON object -> TraceRecord, with each field's type and range checked."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as err:
        raise TraceError(path, line_no, f"not valid JSON ({err.msg})") from err
    if not isinstance(obj, dict):
        raise TraceError(path, line_no, "expected a JSON object")
    timestamp = obj.get("timestamp")
    if not _is_number(timestamp) or timestamp < 0:
        raise TraceError(path, line_no, f"'timestamp' must be a number >= 0, got {timestamp!r}")
    lengths = [obj.get(key) for key in ("input_length", "output_length")]
    for key, value in zip(("input_length", "output_length"), lengths, strict=True):
        if not _is_int(value) or value < 1:
            raise TraceError(path, line_no, f"'{key}' must be an integer >= 1, got {value!r}")
    hash_ids = obj.get("hash_ids", [])
    if not isinstance(hash_ids, list) or not all(_is_int(h) and h >= 0 for h in hash_ids):
        raise TraceError(path, line_no, "'hash_ids' must be a list of integers >= 0")
    return TraceRecord(float(timestamp), lengths[0], lengths[1], tuple(hash_ids))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


def trace_workload(
    records: list[TraceRecord], scaling: TraceScaling, *, max_context: int,
    vocab: tuple[int, int], seed: int, num_requests: int | None = None,
    concurrency: int | None = None, name: str = "trace", source: str = "",
) -> Workload:
    """Requests of the records inside the window, scaled, prompts built from hash blocks."""
    start, end = scaling.window_start_s, scaling.window_end_s
    chosen = [r for r in records
              if start <= r.timestamp_ms / 1000 and (end is None or r.timestamp_ms / 1000 < end)]
    chosen = chosen[:num_requests] if num_requests is not None else chosen
    if not chosen:
        raise WorkloadError(f"trace {source or name}: no requests in window {start:g}:{end or ''}")
    builder = _PromptBuilder(scaling.block_tokens, vocab, seed)
    specs = [_trace_spec(index, record, scaling, builder, max_context)
             for index, record in enumerate(chosen)]
    metadata = {"preset": name, "seed": seed, "trace": source, "max_context": max_context,
                "scaling": scaling.as_dict(), "trace_requests_in_window": len(chosen)}
    return make_workload(name, specs, concurrency, metadata)


def _trace_spec(index: int, record: TraceRecord, scaling: TraceScaling,
                builder: _PromptBuilder, max_context: int) -> RequestSpec:
    prompt_len, output_len = clip_lengths(
        max(1, round(record.input_length / scaling.length_scale)),
        max(1, round(record.output_length / scaling.length_scale)),
        max_context,
    )
    arrival = (record.timestamp_ms / 1000 - scaling.window_start_s) / scaling.time_scale
    prompt = builder.prompt(index, record.hash_ids, prompt_len)
    return RequestSpec(f"trace-{index:05d}", arrival, prompt, output_len)


class _PromptBuilder:
    """Deterministic token block per hash id (cached), plus per-request padding."""

    def __init__(self, block_tokens: int, vocab: tuple[int, int], seed: int) -> None:
        self.block_tokens = block_tokens
        self.vocab = vocab
        self.seed = seed
        self._blocks: dict[int, tuple[int, ...]] = {}

    def block(self, hash_id: int) -> tuple[int, ...]:
        if hash_id not in self._blocks:
            rng = np.random.default_rng([self.seed, _PROMPT_BLOCK_STREAM, hash_id])
            self._blocks[hash_id] = random_tokens(self.block_tokens, self.vocab, rng)
        return self._blocks[hash_id]

    def prompt(self, index: int, hash_ids: tuple[int, ...], length: int) -> tuple[int, ...]:
        needed = math.ceil(length / self.block_tokens)
        tokens = tuple(t for hash_id in hash_ids[:needed] for t in self.block(hash_id))
        if len(tokens) < length:
            rng = np.random.default_rng([self.seed, _PADDING_STREAM, index])
            tokens += random_tokens(length - len(tokens), self.vocab, rng)
        return tokens[:length]
