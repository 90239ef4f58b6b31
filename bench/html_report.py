"""`pdserve bench --report FILE.html`: the whole comparison on one self-contained page.

Written for the person who must choose an arrangement and the engineer who must defend the
choice: the recommendation first, then the ranking at equal worker count, what limits each
run (the bottleneck sentences), what users feel (latency tables and charts), inside the engines
(step records), the workload, and what each figure means. No scripts, no external files:
styles are inline and charts are PNGs embedded as data URIs (they need matplotlib; without
it the page says so and keeps its tables).
"""

from __future__ import annotations

import base64
import datetime
import html
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.metrics import RequestRecord

_STYLE = """
body{font-family:system-ui,-apple-system,"Segoe UI",sans-serif;margin:2rem auto;max-width:1100px;color:#1d2733;
line-height:1.45;padding:0 1rem}
h1{font-size:1.7rem;margin-bottom:.2rem}h2{margin-top:2.2rem;border-bottom:2px solid #d5dde8;padding-bottom:.2rem}
.lead{color:#4a5868}.recommendation{background:#e9f5ec;border-left:6px solid #2f8f46;padding:1rem 1.2rem;
font-size:1.1rem;margin:1.2rem 0}
table{border-collapse:collapse;margin:.8rem 0;font-size:.92rem}
th,td{border:1px solid #c4cfdc;padding:.35rem .6rem;text-align:right;vertical-align:top}
th{background:#dce6f3}td.text,th.text{text-align:left}tr.best td{background:#f2faf4;font-weight:600}
img{max-width:100%;border:1px solid #d5dde8;margin:.6rem 0}.note{color:#6b7785;font-size:.9rem}
dt{font-weight:600;margin-top:.5rem}
"""


def _e(value: Any) -> str:
    return html.escape(str(value))


def _num(value: float | None, fmt: str = "{:.1f}") -> str:
    return "–" if value is None else fmt.format(value)


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], text_columns: int = 1,
           best_first: bool = False) -> str:
    """An HTML table; the first `text_columns` columns are left-aligned text, cells are pre-escaped."""
    def cell(tag: str, i: int, value: str) -> str:
        return f'<{tag}{" class=text" if i < text_columns else ""}>{value}</{tag}>'
    head = "".join(cell("th", i, _e(h)) for i, h in enumerate(header))
    body = "".join(f'<tr{" class=best" if best_first and n == 0 else ""}>'
                   + "".join(cell("td", i, v) for i, v in enumerate(r)) + "</tr>" for n, r in enumerate(rows))
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _ranking(decision: Mapping[str, Any], label: str) -> str:
    rows = [[_e(r["rank"]), _e(r["name"]), _e(r["workers"] or "–"), _num(r["goodput_req_per_s"], "{:.2f}"),
             _num(r["slo_attainment"] * 100, "{:.1f}%"), _num(r["tok_per_worker_s"], "{:.2f}"),
             _num(r["usd_per_million_tokens"], "${:.2f}"), _num(r["usd_per_million_good_tokens"], "${:.2f}"),
             _num(r["ttft_p99_ms"], "{:.0f}"), _num(r["itl_p99_ms"], "{:.0f}")] for r in decision["ranking"]]
    header = ["#", label, "workers", "goodput (req/s)", "SLO met", "output tok/s per worker",
              "$ per M tokens", "$ per M tokens in SLO", "TTFT p99 (ms)", "ITL p99 (ms)"]
    return _table(header, rows, text_columns=2, best_first=True)


def _limits(summaries: Mapping[str, Mapping[str, Any]], label: str) -> str:
    keys = [("ttft_p99", "time to first token (p99)"), ("itl_p99", "output stalls (p99 ITL)")]
    if any((s.get("bottleneck") or {}).get("itl_during_burst") for s in summaries.values()):
        keys.append(("itl_during_burst", "while the burst lands"))
    rows = [[_e(name)] + [_sentence(s, k) for k, _ in keys] for name, s in summaries.items()]
    return _table([label] + [title for _, title in keys], rows, text_columns=len(keys) + 1)


def _sentence(summary: Mapping[str, Any], key: str) -> str:
    found = (summary.get("bottleneck") or {}).get(key)
    return _e(found["sentence"]) if found else "not reported by the server"


def _latency(summaries: Mapping[str, Mapping[str, Any]], label: str) -> str:
    rows = []
    for name, s in summaries.items():
        for title, key in (("TTFT", "ttft_ms"), ("ITL", "itl_ms"), ("TPOT", "tpot_ms"), ("E2E", "e2e_ms")):
            rows.append([_e(name), title] + [_num(s[key][stat]) for stat in ("mean", "p50", "p95", "p99")])
        burst = s.get("during_burst_itl_ms")
        if burst is not None:
            rows.append([_e(name), "ITL, others while the burst lands"]
                        + [_num(burst[stat]) for stat in ("mean", "p50", "p95", "p99")])
    return _table([label, "metric (ms)", "mean", "p50", "p95", "p99"], rows, text_columns=2)


def _engines(summaries: Mapping[str, Mapping[str, Any]], label: str) -> str:
    rows = []
    for name, s in summaries.items():
        for pool, p in ((s.get("bottleneck") or {}).get("steps") or {}).items():
            rows.append([_e(name), _e(pool), _e(p["workers"]), _e(p["steps"]),
                         _num(p["step_ms_decode_only"]["p50"]), _num(p["step_ms_with_prefill"]["p50"]),
                         _num(None if p["share_with_prefill"] is None else p["share_with_prefill"] * 100, "{:.0f}%"),
                         _num(p["mean_decode_rows"]), _e(p["preemptions"]),
                         f"{p['kv_blocks_used_peak']} / {p['kv_blocks_total']}",
                         _num(None if p["busy"] is None else p["busy"] * 100, "{:.0f}%")])
    if not rows:
        return '<p class="note">No step records: the bench reads them only from clusters it starts (--config).</p>'
    header = [label, "pool", "workers", "steps", "decode-only step p50 (ms)", "step with prefill p50 (ms)",
              "steps with prefill", "decode rows per step", "preemptions", "peak KV blocks used", "busy"]
    return _table(header, rows, text_columns=2)


def _value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.1f}" if value >= 10 else f"{value:g}"
    return f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else str(value)


def _workload(workload: Mapping[str, Any]) -> str:
    keys = ("preset", "description", "num_requests", "rate", "input_len", "output_len", "duration_s",
            "prompt_tokens_total", "output_tokens_total", "seed")
    rows = [[_e(k.replace("_", " ")), _e(_value(workload[k]))] for k in keys if workload.get(k) is not None]
    if workload.get("burst"):
        b = workload["burst"]
        rows.append(["burst", _e(f"{b['num_requests']} requests of ~{b['prompt_tokens']} prompt tokens "
                                 f"between {b['start_s']:.1f} s and {b['end_s']:.1f} s")])
    return _table(["workload", "value"], rows, text_columns=2)


_GLOSSARY = {
    "TTFT": "time to first token: from sending a request to receiving its first token.",
    "ITL": "inter-token latency: the gap between two tokens of one answer; p99 ITL is how long the "
           "output freezes for the worst 1% of gaps.",
    "goodput": "requests per second that met every SLO (all completed requests when no SLO is given).",
    "SLO met": "the share of requests that met every service-level objective given with --slo.",
    "tokens per worker-second": "output tokens per second divided by the workers used: equal cost means "
                                "equal workers, so this is throughput per unit of cost.",
    "limit": "what the slowest requests or gaps spent their time on (docs/metrics.md, \"Bottlenecks\").",
}


def _images(make: Sequence[tuple[str, Callable[[], Any]]]) -> str:
    try:
        from bench import plot
    except ImportError:
        return '<p class="note">Charts need matplotlib (pip install "pdserve[plot]").</p>'
    parts = []
    for alt, figure in make:
        data = base64.b64encode(plot.png_bytes(figure(plot))).decode()
        parts.append(f'<img alt="{_e(alt)}" src="data:image/png;base64,{data}">')
    return "".join(parts)


def render(summary: Mapping[str, Any], records: Mapping[str, Sequence[RequestRecord]],
           steps: Mapping[str, Mapping[str, Any]] | None = None, label: str = "arrangement") -> str:
    """The page as one string."""
    kind = "policies" if "policies" in summary else "arrangements"
    summaries, workload, decision = summary[kind], summary["workload"], summary["decision"]
    burst = workload.get("burst")
    slo = ", ".join(f"{k.removesuffix('_ms').upper()} ≤ {v:g} ms" for k, v in summary["slo"].items()) or "none"
    charts = [("bottleneck shares", lambda p: p.bottleneck_figure(summaries)),
              ("TTFT CDF", lambda p: p.cdf_figure("Time to first token (CDF)", p.latency_series(records)[0])),
              ("ITL CDF", lambda p: p.cdf_figure("Inter-token latency (CDF, pooled)", p.latency_series(records)[1])),
              ("ITL over time", lambda p: p.itl_over_time_figure(records, burst))]
    step_chart = [("engine step time over time", lambda p: p.steps_over_time_figure(steps, burst))] if steps else []
    created = datetime.datetime.fromtimestamp(summary.get("created_unix_s", 0)).strftime("%Y-%m-%d %H:%M")
    sections = [
        f"<h1>Which {label} should we run?</h1>",
        f'<p class="lead">{_e(workload.get("name", "workload"))}: {_e(workload.get("num_requests"))} requests '
        f'replayed against each {label} at equal worker count; SLO: {_e(slo)}. Measured {_e(created)}.</p>',
        f'<div class="recommendation">{_e(decision["recommendation"])}</div>',
        "<h2>Ranking at equal cost</h2>", _ranking(decision, label),
        f"<h2>What limits each {label}</h2>", _limits(summaries, label), _images(charts[:1]),
        "<h2>What users feel</h2>", _latency(summaries, label), _images(charts[1:]),
        "<h2>Inside the engines</h2>", _engines(summaries, label), _images(step_chart),
        "<h2>The workload</h2>", _workload(workload),
        "<h2>How to read this page</h2><dl>"
        + "".join(f"<dt>{_e(k)}</dt><dd>{_e(v)}</dd>" for k, v in _GLOSSARY.items()) + "</dl>",
    ]
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>pdserve bench: which {label}'
            f'</title><style>{_STYLE}</style></head><body>{"".join(sections)}</body></html>\n')


def write_html(path: Path, summary: Mapping[str, Any], records: Mapping[str, Sequence[RequestRecord]],
               steps: Mapping[str, Mapping[str, Any]] | None = None, label: str = "arrangement") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render(summary, records, steps, label), encoding="utf-8")
    return path
