"""`pdserve inspect FILE`: what a workload asks of a cluster, before choosing an arrangement.

Reads a Mooncake trace (timestamp ms, input_length, output_length, hash_ids of 512-token
blocks), the router's request log (the same fields plus what the router measured:
router/observability/request_log.py) or a requests.jsonl that `pdserve bench` wrote (one run of it:
`--arrangement`). Reports the input and output length distributions; per time bucket the
arrival rate (peaks marked), the requests in flight and waiting, and the KV they hold against a
capacity (`pdserve plan`'s arithmetic for `--model`); and the prefix reuse an unbounded shared
cache would find (the ideal hit rate over the block ids), next to the measured hit rate when the
file has one. A trace says when requests arrive but not when they end: their duration is then
estimated (`--prefill-tok-s`, `--tpot-ms`) and the table says so. `--plot PNG` draws one page.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.metrics import ideal_hit_rate_blocks
from bench.plan import load_model_shape
from bench.trace import TRACE_BLOCK_TOKENS
from protocol.sizes import PlanError, format_bytes, parse_bytes
from sizing.memory import dtype_bytes, kv_bytes_per_token, plan_memory

PEAK_OVER_MEDIAN = 1.5  # a bucket is a peak when its rate is at least this x the median bucket's ...
PEAK_SIGMAS = 1.5  # ... and at least this many standard deviations above the mean
TARGET_BUCKETS = 30
SAMPLES_PER_BUCKET = 20


class InspectError(ValueError):
    """A file pdserve inspect cannot read; printed as one line, exit 2."""


@dataclass(frozen=True)
class Seen:
    """One request as the file describes it; times in seconds from the file's first arrival."""

    arrival_s: float
    input_len: int
    output_len: int
    block_ids: tuple[int, ...]
    end_s: float | None = None  # measured (a log or a bench run); None for a trace
    queue_s: float | None = None  # measured time in the router's queue
    cached_tokens: int | None = None  # measured prefix-cache hits


def read_requests(path: Path, arrangement: str | None = None) -> tuple[str, int, list[Seen]]:
    """(the file's kind, its block size, its requests sorted by arrival)."""
    try:
        lines = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise InspectError(f"{path}: cannot read it as JSON lines ({err})") from err
    if not lines or not all(isinstance(obj, dict) for obj in lines):
        raise InspectError(f"{path}: expected one JSON object per line")
    if "send_s" in lines[0]:
        kind, block_size, seen = _bench_run(lines, arrangement)
    elif "timestamp" in lines[0] and "input_length" in lines[0]:
        kind = "request log" if "e2e_ms" in lines[0] else "Mooncake trace"
        block_size, seen = TRACE_BLOCK_TOKENS, [_trace_line(obj) for obj in lines]
    else:
        raise InspectError(f"{path}: neither a Mooncake trace, a request log nor a bench requests.jsonl")
    if not seen:
        raise InspectError(f"{path}: no requests")
    seen.sort(key=lambda s: s.arrival_s)
    t0 = seen[0].arrival_s
    return kind, block_size, [_shifted(s, t0) for s in seen]


def _trace_line(obj: dict[str, Any]) -> Seen:
    try:
        arrival = float(obj["timestamp"]) / 1e3
        end = arrival + float(obj["e2e_ms"]) / 1e3 if "e2e_ms" in obj else None
        queue = float(obj["queue_ms"]) / 1e3 if "queue_ms" in obj else None
        return Seen(arrival, int(obj["input_length"]), int(obj["output_length"]), tuple(obj.get("hash_ids", ())),
                    end, queue, obj.get("cached_tokens"))
    except (KeyError, TypeError, ValueError) as err:
        raise InspectError(f"a trace line lacks or garbles {err}: {obj}") from err


def _bench_run(lines: list[dict[str, Any]], arrangement: str | None) -> tuple[str, int, list[Seen]]:
    runs = list(dict.fromkeys(obj.get("arrangement") for obj in lines))
    chosen = arrangement or runs[0]
    if chosen not in runs:
        raise InspectError(f"--arrangement {chosen!r}: the file has {', '.join(map(str, runs))}")
    seen = []
    for obj in (o for o in lines if o.get("arrangement") == chosen):
        usage = obj.get("usage") or {}
        end = obj["send_s"] + obj["e2e_ms"] / 1e3 if obj.get("e2e_ms") is not None else None
        seen.append(Seen(obj["send_s"], obj["prompt_tokens"], obj["output_tokens"] or obj["max_tokens"],
                         tuple(obj.get("hash_ids", ())), end,
                         usage["queue_ms"] / 1e3 if "queue_ms" in usage else None, usage.get("cached_tokens")))
    return f"bench run {chosen!r}", int(lines[0].get("block_size") or 16), seen


def _shifted(s: Seen, t0: float) -> Seen:
    return Seen(s.arrival_s - t0, s.input_len, s.output_len, s.block_ids,
                None if s.end_s is None else s.end_s - t0, s.queue_s, s.cached_tokens)


def _percentiles(values: np.ndarray) -> dict[str, float]:
    return {"p50": float(np.percentile(values, 50)), "p95": float(np.percentile(values, 95)),
            "p99": float(np.percentile(values, 99)), "mean": float(values.mean()), "max": float(values.max())}


def _bucket_s(duration_s: float) -> float:
    """A round bucket width giving about TARGET_BUCKETS buckets."""
    raw = max(duration_s / TARGET_BUCKETS, 1e-3)
    return next(w for w in (0.1, 0.25, 0.5, 1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, raw) if w >= raw)


def ends(seen: list[Seen], prefill_tok_s: float, tpot_s: float) -> tuple[np.ndarray, bool]:
    """When each request ends: measured where the file says, else estimated; (ends, any estimated)."""
    estimated = [s.end_s is None for s in seen]
    return np.array([s.end_s if s.end_s is not None else s.arrival_s + s.input_len / prefill_tok_s
                     + s.output_len * tpot_s for s in seen]), any(estimated)


def timeline(seen: list[Seen], end_s: np.ndarray, bucket_s: float, kv_bytes: int) -> list[dict[str, Any]]:
    """Per bucket: arrivals/s, in flight (mean, max), waiting in the router queue (mean, when
    measured), KV tokens held (max: prompt + the outputs made so far, grown evenly)."""
    arrivals = np.array([s.arrival_s for s in seen])
    inputs = np.array([s.input_len for s in seen])
    outputs = np.array([s.output_len for s in seen])
    queued = np.array([s.arrival_s + (s.queue_s or 0.0) for s in seen])
    measured_queue = any(s.queue_s is not None for s in seen)
    rows = []
    for start in np.arange(0.0, max(end_s.max(), arrivals.max() + 1e-9), bucket_s):
        t = start + (np.arange(SAMPLES_PER_BUCKET) + 0.5) * bucket_s / SAMPLES_PER_BUCKET
        live = (arrivals[None, :] <= t[:, None]) & (end_s[None, :] > t[:, None])  # [samples, requests]
        done = np.clip((t[:, None] - arrivals) / np.maximum(end_s - arrivals, 1e-9), 0, 1)
        kv = ((inputs + outputs * done) * live).sum(axis=1)
        waiting = ((arrivals[None, :] <= t[:, None]) & (queued[None, :] > t[:, None])).sum(axis=1)
        count = int(((arrivals >= start) & (arrivals < start + bucket_s)).sum())
        rows.append({"start_s": float(start), "arrivals": count, "rate": count / bucket_s,
                     "in_flight_mean": float(live.sum(axis=1).mean()), "in_flight_max": int(live.sum(axis=1).max()),
                     "waiting_mean": float(waiting.mean()) if measured_queue else None,
                     "kv_tokens_max": int(kv.max()), "kv_bytes_max": int(kv.max()) * kv_bytes})
    rates = np.array([r["rate"] for r in rows])
    floor = max(PEAK_OVER_MEDIAN * np.median(rates), rates.mean() + PEAK_SIGMAS * rates.std())
    for r in rows:
        r["peak"] = bool(r["rate"] > 0 and r["rate"] >= floor)
    return rows


def kv_model(args: argparse.Namespace) -> dict[str, Any]:
    """KV bytes per token of --model and the capacity: --kv-capacity, else what `pdserve plan`
    leaves for KV on --device-memory after weights and --overhead, times --workers."""
    shape, checkpoint_dtype = load_model_shape(args.model)
    dtype = args.dtype or checkpoint_dtype or "bfloat16"
    per_token = kv_bytes_per_token(shape, dtype_bytes(dtype))
    if args.kv_capacity:
        capacity, source = parse_bytes(args.kv_capacity), "--kv-capacity"
    else:
        plan = plan_memory(shape, dtype, parse_bytes(args.device_memory), parse_bytes(args.overhead), 1)
        capacity = plan.kv_budget_bytes * args.workers
        source = (f"pdserve plan: {args.device_memory} - {format_bytes(plan.weights_bytes)} weights - "
                  f"{args.overhead} overhead, x {args.workers} worker(s)")
    return {"model": shape.name, "dtype": dtype, "kv_bytes_per_token": per_token, "capacity_bytes": capacity,
            "capacity_tokens": capacity // per_token, "capacity_source": source}


def analyze(seen: list[Seen], kind: str, block_size: int, args: argparse.Namespace) -> dict[str, Any]:
    """Everything `pdserve inspect` reports, as one JSON-able dict."""
    kv = kv_model(args)
    end_s, estimated = ends(seen, args.prefill_tok_s, args.tpot_ms / 1e3)
    duration = max(s.arrival_s for s in seen)
    bucket = args.bucket or _bucket_s(max(duration, float(end_s.max())))
    rows = timeline(seen, end_s, bucket, kv["kv_bytes_per_token"])
    prompt_tokens = sum(s.input_len for s in seen)
    cached = [s.cached_tokens for s in seen if s.cached_tokens is not None]
    peak = max(rows, key=lambda r: r["kv_bytes_max"])
    return {
        "kind": kind, "num_requests": len(seen), "duration_s": duration,
        "mean_rate": len(seen) / duration if duration > 0 else None,
        "input_length": _percentiles(np.array([s.input_len for s in seen])),
        "output_length": _percentiles(np.array([s.output_len for s in seen])),
        "block_size": block_size,
        "ideal_hit_rate": ideal_hit_rate_blocks(((s.block_ids, s.input_len) for s in seen), block_size)
        if any(s.block_ids for s in seen) else None,
        "measured_hit_rate": sum(cached) / prompt_tokens if cached and prompt_tokens else None,
        "durations": "estimated" if estimated else "measured",
        "estimate": {"prefill_tok_s": args.prefill_tok_s, "tpot_ms": args.tpot_ms} if estimated else None,
        "kv": kv | {"peak_bytes": peak["kv_bytes_max"], "peak_at_s": peak["start_s"],
                    "peak_share": peak["kv_bytes_max"] / kv["capacity_bytes"],
                    "buckets_above_capacity": float(np.mean([r["kv_bytes_max"] > kv["capacity_bytes"] for r in rows]))},
        "bucket_s": bucket, "timeline": rows,
        "peaks": [r["start_s"] for r in rows if r["peak"]],
    }


def format_report(path: Path, result: dict[str, Any]) -> str:
    """The summary lines, then one row per time bucket (peaks marked *)."""
    r, kv = result, result["kv"]
    rate = f" ({r['mean_rate']:.2f} req/s)" if r["mean_rate"] else ""
    lines = [f"{path}: {r['kind']}, {r['num_requests']:,} requests over {r['duration_s']:,.1f} s{rate}",
             f"{'tokens':<8}{'p50':>9}{'p95':>9}{'p99':>9}{'mean':>9}{'max':>9}"]
    for label, key in (("input", "input_length"), ("output", "output_length")):
        lines.append(f"{label:<8}" + "".join(f"{r[key][s]:9,.0f}" for s in ("p50", "p95", "p99", "mean", "max")))
    if r["ideal_hit_rate"] is not None:
        measured = f", measured {r['measured_hit_rate']:.1%}" if r["measured_hit_rate"] is not None else ""
        lines.append(f"prefix reuse: ideal hit rate {r['ideal_hit_rate']:.1%} ({r['block_size']}-token blocks, one "
                     f"unbounded cache shared by all workers){measured}")
    lines.append(f"KV: {kv['model']} {kv['dtype']}, {format_bytes(kv['kv_bytes_per_token'])} per token; capacity "
                 f"{format_bytes(kv['capacity_bytes'])} = {kv['capacity_tokens']:,} tokens ({kv['capacity_source']})")
    lines.append(f"peak KV demand {format_bytes(kv['peak_bytes'])} ({kv['peak_share']:.0%} of capacity) at "
                 f"{kv['peak_at_s']:,.0f} s; {kv['buckets_above_capacity']:.0%} of buckets above capacity")
    if r["estimate"]:
        lines.append(f"in flight and KV are estimated: the file has no end times, so each request lasts "
                     f"input / {r['estimate']['prefill_tok_s']:,.0f} tok/s + output x {r['estimate']['tpot_ms']:g} ms")
    unit, scale = ("GiB", 2**30) if kv["capacity_bytes"] >= 2**30 else ("MiB", 2**20)
    lines += ["", f"{'time (s)':>15}{'req/s':>9}{'in flight':>12}{'waiting':>9}{'KV ' + unit:>9}{'of cap':>8}"]
    top = max(row["rate"] for row in r["timeline"]) or 1.0
    digits = 0 if r["bucket_s"] >= 1 else 2
    for row in r["timeline"]:
        span = f"{row['start_s']:,.{digits}f}-{row['start_s'] + r['bucket_s']:,.{digits}f}"
        waiting = f"{row['waiting_mean']:9.1f}" if row["waiting_mean"] is not None else f"{'-':>9}"
        lines.append(f"{span:>15}{row['rate']:8.2f}{'*' if row['peak'] else ' '}"
                     f"{row['in_flight_mean']:6.1f} /{row['in_flight_max']:4d}{waiting}"
                     f"{row['kv_bytes_max'] / scale:9.2f}{row['kv_bytes_max'] / kv['capacity_bytes']:8.0%} "
                     + "#" * round(20 * row["rate"] / top))
    lines.append(f"* peak: arrivals at least {PEAK_OVER_MEDIAN:g}x the median bucket and {PEAK_SIGMAS:g} standard "
                 "deviations above the mean; in flight: mean / max")
    return "\n".join(lines)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Registers `inspect` on the `pdserve` subcommand parser."""
    parser = subparsers.add_parser(
        "inspect", help="lengths, arrival peaks, concurrency, prefix reuse and KV demand of a trace or log",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("file", metavar="FILE", help="a Mooncake trace, the router's request log, or a "
                                                     "requests.jsonl of pdserve bench")
    parser.add_argument("--arrangement", help="the run of a requests.jsonl to inspect (default: its first)")
    parser.add_argument("--model", default="llama-3.1-8b",
                        help="built-in shape or checkpoint dir, for KV bytes per token (default: %(default)s)")
    parser.add_argument("--dtype", help="KV dtype (default: the checkpoint's, else bfloat16)")
    parser.add_argument("--kv-capacity", metavar="SIZE", help="KV memory to compare with, e.g. 57GiB "
                        "(default: what pdserve plan leaves on --device-memory)")
    parser.add_argument("--device-memory", default="80GiB", help="per worker (default: %(default)s)")
    parser.add_argument("--overhead", default="8GiB", help="per worker (default: %(default)s)")
    parser.add_argument("--workers", type=int, default=1, help="workers holding KV (default: %(default)s)")
    parser.add_argument("--bucket", type=float, metavar="SECONDS", help="time bucket (default: about 30 buckets)")
    parser.add_argument("--prefill-tok-s", type=float, default=10_000.0,
                        help="for a trace without end times: prompt tokens per second (default: %(default)g)")
    parser.add_argument("--tpot-ms", type=float, default=20.0,
                        help="for a trace without end times: ms per output token (default: %(default)g)")
    parser.add_argument("--json", action="store_true", help="print the analysis as JSON")
    parser.add_argument("--plot", metavar="PNG", help="also draw it on one page")
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Prints the table (or JSON); 2 with one line on stderr for a bad file or flag."""
    path = Path(args.file)
    try:
        if args.workers < 1 or args.prefill_tok_s <= 0 or args.tpot_ms <= 0 or (args.bucket or 1) <= 0:
            raise InspectError("--workers, --prefill-tok-s, --tpot-ms and --bucket must be positive")
        kind, block_size, seen = read_requests(path, args.arrangement)
        result = analyze(seen, kind, block_size, args)
    except (InspectError, PlanError) as err:
        print(f"pdserve inspect: {err}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2) if args.json else format_report(path, result))
    if args.plot:
        from bench.plot import inspect_figure, png_bytes  # matplotlib is slow to import

        Path(args.plot).write_bytes(png_bytes(inspect_figure(result, [s.input_len for s in seen],
                                                             [s.output_len for s in seen], str(path))))
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0
