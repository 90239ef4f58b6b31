"""The decision at the end of `pdserve bench`: rank the runs at equal worker count, recommend one.

Each run gets goodput and SLO attainment (what users accept), output tokens per worker-second
and, with `--cost-per-worker-hour`, the cost per million output tokens and per million tokens
of requests that met the SLO. Runs are ranked by SLO attainment (the share of users served
within the SLO at this load), then goodput, then p99 ITL and p99 TTFT (headroom), then tokens
per worker-second; two runs within `TIES` of each other on a figure are tied on it and the next
one decides. Goodput comes second because over an open-loop replay it also counts how long the
last requests took to drain. The recommendation is one sentence citing the figures behind it and
the limit the bottleneck report names for the winner and the runner-up.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from bench.bottleneck import LIMITS

# (figure, higher is better, relative tolerance within which two runs tie on it)
TIES = (("slo_attainment", True, 0.01), ("goodput_req_per_s", True, 0.02), ("itl_p99_ms", False, 0.05),
        ("ttft_p99_ms", False, 0.05), ("tok_per_worker_s", True, 0.0))
_WORDS = {"goodput_req_per_s": "goodput", "slo_attainment": "SLO attainment", "itl_p99_ms": "p99 ITL",
          "ttft_p99_ms": "p99 TTFT", "tok_per_worker_s": "output tokens per worker-second"}


def row(name: str, summary: Mapping[str, Any], workers: int | None,
        cost_per_worker_hour: float | None) -> dict[str, Any]:
    """One run's figures for the ranking."""
    tok_s, wall = summary["output_tok_per_s"], summary["wall_s"]
    good_tokens = summary.get("good_output_tokens")
    per_worker = tok_s / workers if workers else None
    cost_per_s = cost_per_worker_hour * workers / 3600 if workers and cost_per_worker_hour is not None else None
    return {
        "name": name, "workers": workers,
        "goodput_req_per_s": summary["goodput_req_per_s"], "slo_attainment": summary["slo_attainment"],
        "output_tok_per_s": tok_s, "tok_per_worker_s": per_worker,
        "usd_per_million_tokens": cost_per_s / tok_s * 1e6 if cost_per_s and tok_s else None,
        "usd_per_million_good_tokens": (cost_per_s * wall / good_tokens * 1e6
                                        if cost_per_s and good_tokens else None),
        "ttft_p99_ms": summary["ttft_ms"]["p99"], "itl_p99_ms": summary["itl_ms"]["p99"],
        "itl_limit": _limit(summary, "itl_p99"), "ttft_limit": _limit(summary, "ttft_p99"),
    }


def _limit(summary: Mapping[str, Any], key: str) -> str | None:
    found = (summary.get("bottleneck") or {}).get(key)
    return found["limit"] if found else None


def _better(a: Mapping[str, Any], b: Mapping[str, Any]) -> tuple[bool, str | None]:
    """Whether `a` ranks above `b`, and the figure that decided (None: tied on all)."""
    for key, higher, tolerance in TIES:
        x, y = a[key], b[key]
        if x is None or y is None or abs(x - y) <= tolerance * max(abs(x), abs(y)):
            continue
        return (x > y) == higher, key
    return False, None


def rank(summaries: Mapping[str, Mapping[str, Any]], workers: Mapping[str, int | None],
         cost_per_worker_hour: float | None = None, slo: Mapping[str, float] | None = None) -> dict[str, Any]:
    """summary.json's `decision`: {"ranking": [rows, best first], "decided_by", "recommendation"}."""
    rows = [row(name, s, workers.get(name), cost_per_worker_hour) for name, s in summaries.items()]
    ordered: list[dict[str, Any]] = []
    for r in rows:  # insertion sort: the comparison is a tie-aware chain, not a key
        at = next((i for i, o in enumerate(ordered) if _better(r, o)[0]), len(ordered))
        ordered.insert(at, r)
    for rank_no, r in enumerate(ordered, start=1):
        r["rank"] = rank_no
    decided_by = _better(ordered[0], ordered[1])[1] if len(ordered) > 1 else None
    return {"ranking": ordered, "decided_by": decided_by, "cost_per_worker_hour": cost_per_worker_hour,
            "recommendation": recommend(ordered, decided_by, slo or {})}


# figure -> (how the sentence says it, how the number is written)
_FORMATS = {"slo_attainment": ("{} of requests met the SLO", "{:.0%}"),
            "goodput_req_per_s": ("goodput {} req/s", "{:.2f}"),
            "itl_p99_ms": ("p99 ITL {} ms", "{:.0f}"), "ttft_p99_ms": ("p99 TTFT {} ms", "{:.0f}"),
            "tok_per_worker_s": ("{} output tokens per worker-second", "{:.1f}"),
            "usd_per_million_tokens": ("{} per million output tokens", "${:.2f}")}


def _say(key: str, r: Mapping[str, Any]) -> str:
    text, number = _FORMATS[key]
    return text.format(number.format(r[key]))


def _versus(key: str, a: Mapping[str, Any], b: Mapping[str, Any]) -> str | None:
    """'goodput 3.84 req/s against 2.59' (None when either run lacks the figure)."""
    if a.get(key) is None or b.get(key) is None:
        return None
    return f"{_say(key, a)} against {_FORMATS[key][1].format(b[key])}"


def recommend(ordered: list[Mapping[str, Any]], decided_by: str | None, slo: Mapping[str, float]) -> str:
    """One sentence: the winner, the figure that decided with the runner-up's, the other figures
    side by side, and what limits p99 ITL in each."""
    if not ordered:
        return "No run to recommend."
    best = ordered[0]
    workers = f" at {best['workers']} workers each" if best["workers"] else ""
    if len(ordered) == 1:
        figures = ", ".join(_say(k, best) for k in _FORMATS if best.get(k) is not None)
        return f"Measured {best['name']}{workers}: {figures}."
    second = ordered[1]
    why = (f"it leads {second['name']} on {_WORDS[decided_by]}" if decided_by
           else f"it ties {second['name']} on every figure")
    figures = [f for k in _FORMATS if (f := _versus(k, best, second)) is not None]
    slo_note = "" if slo else " (no --slo: every completed request counts as good)"
    limits = ""
    if best["itl_limit"] and second["itl_limit"]:
        limits = (f"; p99 ITL is limited by {LIMITS[best['itl_limit']][1]} in {best['name']}, "
                  f"by {LIMITS[second['itl_limit']][1]} in {second['name']}")
    return f"Recommend {best['name']}{workers}: {why}{slo_note} — {'; '.join(figures)}{limits}."


def worker_counts(cluster: Mapping[str, Any], runs: list[str], by_config: bool) -> dict[str, int | None]:
    """Workers behind each run: the clusters' size (--config), else as many as the router's
    status lists; unknown (None) for an OpenAI endpoint."""
    if by_config:
        size = cluster.get("workers") or cluster["prefill_workers"] + cluster["decode_workers"]
        return dict.fromkeys(runs, size)
    workers = (cluster.get("status") or {}).get("workers")
    return dict.fromkeys(runs, len(workers) if isinstance(workers, list) and workers else None)
