"""Which limit sets a run's p99 TTFT and p99 ITL: the router's per-request timings and the
engines' token kinds (engine/telemetry.py, carried in Usage), with the workers' step records.

TTFT of one request splits into (docs/metrics.md, "Bottlenecks"):
  kv_capacity      waiting for KV blocks: the router's queue for a decode reservation, the engine's admission
  prefill_queue    waiting for a prefill slot, behind other prompts, between its chunks
  prefill_compute  the engine steps that computed its prompt
  transfer         the rest of the client's TTFT: the hops client -> router -> worker -> client
                   (gRPC, Ray) and the router's placement round trips (a decode `reserve`)
  retry            that rest instead, when an attempt failed before the first token and the request
                   moved: the failed attempt's time is in it
p99 TTFT's limit is the component with the largest share of the time of the requests at or
above the p95 TTFT (the tail that sets p99). Each inter-token gap takes the kind of the token
that ends it (decode, interference, recompute, kv_transfer, preemption, migration); p99 ITL's limit is
the kind most of the gaps at or above the p95 gap have. The limit is named in one sentence
with its numbers; the step records add the evidence (steps with prefill vs without).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from bench.metrics import RequestRecord, itls, token_times, ttft
from protocol.deadline import within

TTFT_PARTS = ("kv_capacity", "prefill_queue", "prefill_compute", "transfer", "retry")
GAP_KINDS = {"D": "decode", "I": "interference", "R": "recompute", "K": "kv_transfer", "P": "preemption",
             "M": "migration"}
LIMITS = {
    "kv_capacity": ("waiting for KV capacity", "KV memory"),
    "prefill_queue": ("waiting in the prefill queue", "prefill capacity"),
    "prefill_compute": ("prefill compute", "prefill compute"),
    "transfer": ("moving the request and its first token between client, router and workers "
                 "(RPC hops, placement round trips)", "request transfer and placement overhead"),
    "retry": ("spent in attempts that failed before the first token", "worker failures and timeouts"),
    "decode": ("plain decode steps", "decode step time (HBM bandwidth and batch size)"),
    "interference": ("steps that also ran prefill chunks", "scheduling interference"),
    "kv_transfer": ("the second token's wait for the KV transfer", "KV transfer"),
    "recompute": ("steps that also recomputed a preempted request's context", "KV memory (preemption recompute)"),
    "preemption": ("tokens recomputed after a preemption", "KV memory (preemptions)"),
    "migration": ("tokens after a move to another worker", "worker failures"),
}
TAIL_PERCENTILE = 95


def ttft_parts_ms(record: RequestRecord) -> dict[str, float] | None:
    """The TTFT components of one request (ms), or None when its usage lacks the timings."""
    first, u = ttft(record), record.usage
    if first is None or not record.ok or "prefill_compute_ms" not in u or not u.get("token_steps"):
        return None
    parts = {"kv_capacity": float(u["kv_wait_ms"]), "prefill_queue": float(u["prefill_queue_ms"]),
             "prefill_compute": float(u["prefill_compute_ms"])}
    rest = max(0.0, first * 1e3 - sum(parts.values()))
    moved = u.get("migrations", 0) > 0 and u["token_steps"][0] == "F"  # it moved before its first token
    return parts | {"transfer": 0.0 if moved else rest, "retry": rest if moved else 0.0}


def ttft_limit(records: Sequence[RequestRecord]) -> dict[str, Any] | None:
    """Shares of the TTFT components over the requests at or above the p95 TTFT."""
    split = [(ttft(r) * 1e3, parts) for r in records if (parts := ttft_parts_ms(r)) is not None]
    if not split:
        return None
    values = np.array([t for t, _ in split])
    tail = [(t, p) for t, p in split if t >= np.percentile(values, TAIL_PERCENTILE)]
    total = sum(sum(p.values()) for _, p in tail) or 1.0
    shares = {k: sum(p[k] for _, p in tail) / total for k in TTFT_PARTS}
    limit = max(shares, key=shares.__getitem__)
    p99 = float(np.percentile(values, 99))
    sentence = (f"p99 TTFT {p99:.0f} ms: {shares[limit]:.0%} of the time to first token of the requests at or "
                f"above p95 ({np.percentile(values, TAIL_PERCENTILE):.0f} ms) was {LIMITS[limit][0]}: "
                f"{LIMITS[limit][1]}.")
    return {"limit": limit, "shares": shares, "p99_ms": p99, "tail_requests": len(tail), "sentence": sentence}


def labelled_gaps(record: RequestRecord) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(gap s, the time its token arrived, the kind letter of that token), or None when the
    request's usage carries no kind per token."""
    kinds = record.usage.get("token_steps") or ""
    if not record.ok or len(kinds) != record.output_tokens or record.output_tokens < 2:
        return None
    return itls(record), token_times(record)[1:], np.array(list(kinds[1:]))


def itl_limit(records: Sequence[RequestRecord], window_s: tuple[float, float] | None = None,
              label: str = "p99 ITL") -> dict[str, Any] | None:
    """Shares of gap kinds among the gaps at or above the p95 gap (only gaps whose token arrived
    inside `window_s`, when given)."""
    labelled = [g for r in records if (g := labelled_gaps(r)) is not None]
    if not labelled:
        return None
    gaps, times, kinds = (np.concatenate(parts) for parts in zip(*labelled, strict=True))
    if window_s is not None:
        inside = (times >= window_s[0]) & (times <= window_s[1])
        gaps, kinds = gaps[inside], kinds[inside]
    if gaps.size == 0:
        return None
    p95 = float(np.percentile(gaps, TAIL_PERCENTILE))
    tail = kinds[gaps >= p95]
    shares = {name: float(np.mean(tail == letter)) for letter, name in GAP_KINDS.items()}
    limit = max(shares, key=shares.__getitem__)
    p99 = float(np.percentile(gaps, 99)) * 1e3
    sentence = (f"{label} {p99:.0f} ms: {shares[limit]:.0%} of gaps at or above p95 ({p95 * 1e3:.0f} ms) "
                f"fall on {LIMITS[limit][0]}: {LIMITS[limit][1]}.")
    return {"limit": limit, "shares": shares, "p99_ms": p99, "tail_gaps": int(tail.size), "sentence": sentence}


def step_summary(workers: Mapping[str, Mapping[str, Any]], wall_s: float) -> dict[str, Any]:
    """Per pool, from the workers' step records: steps, step time with and without prefill work,
    the share of steps that ran prefill, mean decode rows, preemptions, peak KV blocks used, and
    how busy the engines were (step time over the run's wall time)."""
    pools: dict[str, list[tuple[Mapping[str, Any], int]]] = {}
    for w in workers.values():
        pools.setdefault(w["pool"], []).append((w, w["blocks_total"]))
    return {pool: _pool_steps([w for w, _ in ws], sum(t for _, t in ws), wall_s) for pool, ws in pools.items()}


def _ms(values: np.ndarray) -> dict[str, float | None]:
    if values.size == 0:
        return {"p50": None, "p99": None}
    return {"p50": float(np.percentile(values, 50)) * 1e3, "p99": float(np.percentile(values, 99)) * 1e3}


def _pool_steps(workers: list[Mapping[str, Any]], blocks_total: int, wall_s: float) -> dict[str, Any]:
    steps = [s for w in workers for s in w["steps"]]
    wall = np.array([s["wall_s"] for s in steps])
    mixed = np.array([s["prefill_rows"] > 0 for s in steps], dtype=bool)
    decoding = np.array([s["decode_rows"] > 0 for s in steps], dtype=bool)
    return {
        "workers": len(workers),
        "steps": len(steps),
        "step_ms_decode_only": _ms(wall[decoding & ~mixed] if steps else wall),
        "step_ms_with_prefill": _ms(wall[mixed] if steps else wall),
        "share_with_prefill": float(mixed.mean()) if steps else None,
        "mean_decode_rows": float(np.mean([s["decode_rows"] for s in steps])) if steps else None,
        "preemptions": int(sum(s["preemptions"] for s in steps)),
        "kv_blocks_used_peak": max((s["blocks_used"] for s in steps), default=0),
        "kv_blocks_total": blocks_total,
        "busy": float(wall.sum()) / (wall_s * len(workers)) if wall_s > 0 and workers else None,
    }


def analyze(records: Sequence[RequestRecord], steps: Mapping[str, Any] | None = None,
            burst_window_s: tuple[float, float] | None = None) -> dict[str, Any]:
    """summary.json's `bottleneck` of one run: {"ttft_p99": {"limit", "shares", ...}, "itl_p99":
    {...}, "itl_during_burst" (the other requests' gaps while a burst lands), "steps" (per pool)};
    a limit is None when the server reported no timings (e.g. an OpenAI endpoint)."""
    done = [r for r in records if r.ok]
    streams = [r for r in done if not r.request_id.startswith("burst")]
    result: dict[str, Any] = {"ttft_p99": ttft_limit(done), "itl_p99": itl_limit(done)}
    if burst_window_s is not None:
        result["itl_during_burst"] = itl_limit(streams, burst_window_s, "p99 ITL while the burst lands")
    if steps:
        result["steps"] = steps
        _add_step_evidence(result)
    return result


def _add_step_evidence(result: dict[str, Any]) -> None:
    """Appends what the decode pool's step records say about an interference or decode limit."""
    decode = result["steps"].get("decode")
    itl = result["itl_p99"]
    if decode is None or itl is None or decode["steps"] == 0:
        return
    plain, mixed = decode["step_ms_decode_only"]["p50"], decode["step_ms_with_prefill"]["p50"]
    if itl["limit"] == "interference" and plain is not None and mixed is not None:
        itl["evidence"] = (f"decode-pool steps that ran prefill chunks took {mixed:.0f} ms at p50, decode-only "
                           f"steps {plain:.0f} ms; {decode['share_with_prefill']:.0%} of steps ran prefill")
    elif itl["limit"] == "decode" and plain is not None:
        itl["evidence"] = (f"decode-only steps took {plain:.0f} ms at p50 with {decode['mean_decode_rows']:.1f} "
                           f"decode rows on average; the decode pool was busy {decode['busy']:.0%} of the run")
    if "evidence" in itl:
        itl["sentence"] = itl["sentence"].removesuffix(".") + f" ({itl['evidence']})."


def step_records_to_dicts(records: Sequence[Any], run_start_unix: float) -> list[dict[str, Any]]:
    """protocol.telemetry.StepRecord -> plain dicts, with `t_s`: seconds since the run started."""
    return [{"seq": r.seq, "t_s": r.end_unix - run_start_unix, "wall_s": r.wall_s, "decode_rows": r.decode_rows,
             "prefill_rows": r.prefill_rows, "prefill_tokens": r.prefill_tokens, "blocks_used": r.blocks_used,
             "blocks_free": r.blocks_free, "preemptions": r.preemptions, "waiting": r.waiting,
             "context_tokens": r.context_tokens, "attended_pairs": r.attended_pairs} for r in records]


def fetch_step_records(cluster: Any) -> dict[str, tuple[Any, list]]:
    """Every live worker's view and its step records (engine/telemetry.py), by worker name; a
    worker that does not answer is left out (its requests still count)."""
    async def fetch() -> dict[str, tuple[Any, list]]:
        workers = [w for w in cluster.router.pools.all() if not w.stopped]
        replies = await asyncio.gather(*(within(w.actor.telemetry.remote(0), 30) for w in workers),
                                       return_exceptions=True)
        return {w.name: (w, reply) for w, reply in zip(workers, replies, strict=True)
                if not isinstance(reply, BaseException)}
    return cluster.call(fetch(), timeout=60)


def collect_steps(cluster: Any, started_unix: float) -> dict[str, Any]:
    """`fetch_step_records` as plain dicts, times relative to the run's start."""
    return {name: {"pool": w.info.pool, "blocks_total": w.info.num_blocks,
                   "steps": step_records_to_dicts(records, started_unix)}
            for name, (w, records) in fetch_step_records(cluster).items()}
