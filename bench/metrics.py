"""What users feel, computed from client-side timestamps (definitions: docs/metrics.md).

Pure functions over `RequestRecord`s: TTFT, ITL (pooled over requests), TPOT, E2E,
numpy-style linear percentiles, throughput, goodput and SLO attainment. A streamed message
that carries k tokens delivers all k at its arrival time (k-1 inter-token gaps of 0 s).
Times are seconds; `summarize_run` reports latencies in milliseconds. Prefix caching: the
hit rate the server reports (`prefix_cache_summary`) against what an unbounded cache would
reach on the same prompts (`ideal_hit_rate`).
"""

from __future__ import annotations

import re
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from bench.errors import SloError
from protocol.block_hash import block_hashes

PERCENTILES = (50, 95, 99)
_SLO_KEYS = ("ttft", "tpot", "e2e")
_SLO_VALUE = re.compile(r"^([0-9]*\.?[0-9]+)(ms|s)?$")


@dataclass(frozen=True)
class RequestRecord:
    """One request as the client saw it; times are seconds since the run started."""

    request_id: str
    arrangement: str
    send_s: float
    message_times_s: tuple[float, ...]
    message_tokens: tuple[int, ...]
    prompt_tokens: int
    max_tokens: int
    finish_reason: str = ""
    error: str | None = None
    usage: Mapping[str, Any] = field(default_factory=dict)

    @property
    def output_tokens(self) -> int:
        return sum(self.message_tokens)

    @property
    def ok(self) -> bool:
        return self.error is None and self.output_tokens > 0

    @property
    def end_s(self) -> float:
        return self.message_times_s[-1] if self.message_times_s else self.send_s


@dataclass(frozen=True)
class Slo:
    """Per-request service-level objectives in seconds; None leaves a metric unconstrained."""

    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None

    def as_dict(self) -> dict[str, float]:
        return {f"{key}_ms": value * 1000 for key, value in
                (("ttft", self.ttft_s), ("tpot", self.tpot_s), ("e2e", self.e2e_s))
                if value is not None}


def parse_slo(text: str) -> Slo:
    """'ttft=1.0,tpot=50ms' -> Slo(ttft_s=1.0, tpot_s=0.05); bare numbers are seconds."""
    values: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, _, raw = item.partition("=")
        match = _SLO_VALUE.match(raw.strip().lower())
        if key.strip() not in _SLO_KEYS or match is None:
            raise SloError(f"--slo {item!r}: expected KEY=VALUE[s|ms] with KEY in "
                           f"{', '.join(_SLO_KEYS)}, e.g. ttft=1.0,tpot=50ms")
        scale = 0.001 if match.group(2) == "ms" else 1.0
        values[f"{key.strip()}_s"] = float(match.group(1)) * scale
    return Slo(**values)


def token_times(record: RequestRecord) -> np.ndarray:
    """Arrival time of every output token (a message's tokens share its arrival)."""
    return np.repeat(np.asarray(record.message_times_s, dtype=float),
                     np.asarray(record.message_tokens, dtype=int))


def ttft(record: RequestRecord) -> float | None:
    return record.message_times_s[0] - record.send_s if record.message_times_s else None


def e2e(record: RequestRecord) -> float | None:
    return record.message_times_s[-1] - record.send_s if record.message_times_s else None


def itls(record: RequestRecord) -> np.ndarray:
    """Gaps between consecutive tokens of one request."""
    return np.diff(token_times(record))


def itls_between(record: RequestRecord, start_s: float, end_s: float) -> np.ndarray:
    """The gaps of one request that end inside [start_s, end_s] (e.g. while a burst lands)."""
    times = token_times(record)
    gaps = np.diff(times)
    return gaps[(times[1:] >= start_s) & (times[1:] <= end_s)]


def rolling_percentile(times_s: np.ndarray, values: np.ndarray, window_s: float, q: float = 99,
                       points: int = 200) -> tuple[np.ndarray, np.ndarray]:
    """At `points` evenly spaced times from the first to the last, the q-th percentile of the
    values whose time lies in (t - window_s, t]; NaN where that window holds none."""
    times_s, values = np.asarray(times_s, dtype=float), np.asarray(values, dtype=float)
    if times_s.size == 0:
        return np.array([]), np.array([])
    order = np.argsort(times_s, kind="stable")
    times_s, values = times_s[order], values[order]
    grid = np.linspace(times_s[0], times_s[-1], points if times_s[-1] > times_s[0] else 1)
    starts = np.searchsorted(times_s, grid - window_s, side="right")
    ends = np.searchsorted(times_s, grid, side="right")
    return grid, np.array([np.percentile(values[a:b], q) if b > a else np.nan
                           for a, b in zip(starts, ends, strict=True)])


def tpot(record: RequestRecord) -> float | None:
    """(E2E - TTFT) / (output_tokens - 1); None for requests with fewer than two tokens."""
    if record.output_tokens < 2:
        return None
    return (record.message_times_s[-1] - record.message_times_s[0]) / (record.output_tokens - 1)


def latency_stats_ms(values_s: Iterable[float]) -> dict[str, float | None]:
    """mean, p50, p95, p99 in ms (linear interpolation, numpy's default); None when empty."""
    values = np.asarray(list(values_s), dtype=float) * 1000.0
    if values.size == 0:
        return {"mean": None} | {f"p{q}": None for q in PERCENTILES}
    stats = {"mean": float(values.mean())}
    return stats | {f"p{q}": float(np.percentile(values, q)) for q in PERCENTILES}


def meets_slo(record: RequestRecord, slo: Slo) -> bool:
    """A failed request never meets it; TPOT is unconstrained for single-token requests."""
    if not record.ok:
        return False
    checks = ((slo.ttft_s, ttft(record)), (slo.tpot_s, tpot(record)), (slo.e2e_s, e2e(record)))
    return all(limit is None or value is None or value <= limit for limit, value in checks)


def run_wall_s(records: Sequence[RequestRecord]) -> float:
    """First send to last token received, over the whole run."""
    if not records:
        return 0.0
    return max(r.end_s for r in records) - min(r.send_s for r in records)


def _per_second(count: float, wall_s: float) -> float:
    return count / wall_s if wall_s > 0 else 0.0


def summarize_run(records: Sequence[RequestRecord], slo: Slo,
                  wall_s: float | None = None) -> dict[str, Any]:
    """The per-arrangement summary written to summary.json (latencies in ms)."""
    wall = run_wall_s(records) if wall_s is None else wall_s
    done = [r for r in records if r.ok]
    good = sum(meets_slo(r, slo) for r in records)
    tpots = [value for r in done if (value := tpot(r)) is not None]
    return {
        "num_requests": len(records),
        "num_errors": len(records) - len(done),
        "wall_s": wall,
        "ttft_ms": latency_stats_ms(ttft(r) for r in done),
        "itl_ms": latency_stats_ms(np.concatenate([itls(r) for r in done]) if done else []),
        "tpot_ms": latency_stats_ms(tpots),
        "e2e_ms": latency_stats_ms(e2e(r) for r in done),
        "output_tokens": sum(r.output_tokens for r in done),
        "output_tok_per_s": _per_second(sum(r.output_tokens for r in done), wall),
        "request_per_s": _per_second(len(done), wall),
        "goodput_req_per_s": _per_second(good, wall),
        "good_output_tokens": sum(r.output_tokens for r in records if meets_slo(r, slo)),
        "slo_attainment": good / len(records) if records else 0.0,
        "slo": slo.as_dict(),
        "server_ms": _server_breakdown(done),
    } | prefix_cache_summary(done)


def _server_breakdown(records: Sequence[RequestRecord]) -> dict[str, float | None]:
    """Mean of the router's own per-stage timings (Usage), where the router reported them."""
    keys = ("queue_ms", "prefill_ms", "kv_transfer_ms", "ttft_ms")
    means: dict[str, float | None] = {}
    for key in keys:
        values = [float(r.usage[key]) for r in records if key in r.usage]
        means[f"mean_{key}"] = float(np.mean(values)) if values else None
    return means


def cached_tokens(usage: Mapping[str, Any]) -> int | None:
    """Prompt tokens the server's prefix cache supplied: pdserve's `Usage.cached_tokens`, or
    OpenAI's `prompt_tokens_details.cached_tokens`; None when the server does not say."""
    details = usage.get("prompt_tokens_details")
    if "cached_tokens" not in usage and isinstance(details, Mapping):
        usage = details
    return int(usage["cached_tokens"]) if "cached_tokens" in usage else None


def prefix_cache_summary(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """Over the successful requests: prompt tokens, the share the prefix caches served
    (`prefix_hit_rate`), the prompt tokens prefill computed, and the KV bytes pushed to decode.
    A figure no request's usage reports is None (a request without it counts 0 where others do)."""
    done = [r for r in records if r.ok]
    prompt = sum(r.prompt_tokens for r in done)
    cached = [c for r in done if (c := cached_tokens(r.usage)) is not None]
    pushed = [int(r.usage["kv_transfer_bytes"]) for r in done if "kv_transfer_bytes" in r.usage]
    return {
        "prompt_tokens": prompt,
        "prefix_hit_rate": (sum(cached) / prompt if prompt else 0.0) if cached else None,
        "prefill_tokens_computed": prompt - sum(cached) if cached else None,
        "kv_transfer_bytes": sum(pushed) if pushed else None,
    }


def ideal_hit_rate(prompts: Iterable[Sequence[int]], block_size: int) -> float:
    """The prefix hit rate of one unbounded cache that every prompt, in this order, could use:
    each reuses its longest leading run of full blocks some earlier prompt had (a chained block
    hash names its whole prefix), at most (n - 1) // block_size blocks because the engine always
    computes a prompt's last token itself; hit tokens over all prompt tokens."""
    return ideal_hit_rate_blocks(((block_hashes(list(tokens), block_size), len(tokens)) for tokens in prompts),
                                 block_size)


def ideal_hit_rate_blocks(prompts: Iterable[tuple[Sequence[Hashable], int]], block_size: int) -> float:
    """`ideal_hit_rate` over (ids of a prompt's blocks, its length in tokens): chained block
    hashes, or a Mooncake trace's hash_ids (512-token blocks), where an equal id at an equal
    position means an equal prefix. Ids past the prompt's full blocks are ignored."""
    seen: set[Hashable] = set()
    hit = total = 0
    for ids, length in prompts:
        reusable = list(ids[:(length - 1) // block_size]) if length > 0 else []
        hit += block_size * next((i for i, h in enumerate(reusable) if h not in seen), len(reusable))
        total += length
        seen.update(ids[:length // block_size])
    return hit / total if total else 0.0
