"""The bench report: a table per run on stdout (or, with `--json`, summary.json), and files under `--out DIR`.

`summary.json`: {"workload": ..., "slo": ..., "cluster": ..., KIND: {name: summary}, "decision":
...} where KIND is "policies" (`--policies`) or "arrangements" (every other mode) and each summary
has ttft_ms/itl_ms/tpot_ms/e2e_ms (mean, p50, p95, p99), output_tok_per_s, goodput_req_per_s,
slo_attainment, the prefix-cache figures prompt_tokens, prefix_hit_rate, ideal_hit_rate,
prefill_tokens_computed, kv_transfer_bytes, and `bottleneck` (bench/bottleneck.py);
"decision" is the ranking and recommendation (bench/decision.py). `requests.jsonl`: one
line per request and run with its timestamps and its prompt's block ids; `steps.jsonl`: the
workers' step records (clusters of --config). `--plot` adds PNG charts (bench/plot.py),
`--report FILE` one self-contained HTML page (bench/html_report.py).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.bottleneck import analyze, step_summary
from bench.metrics import (
    RequestRecord,
    Slo,
    e2e,
    itls_between,
    latency_stats_ms,
    summarize_run,
    ttft,
)
from bench.workload import Workload

_LATENCY_ROWS = (("TTFT", "ttft_ms"), ("ITL", "itl_ms"), ("TPOT", "tpot_ms"), ("E2E", "e2e_ms"))
_STATS = ("mean", "p50", "p95", "p99")


BURST_TAIL_S = 3.0  # how long after the burst's last arrival (or first token) its work can still stall streams


def summarize_arrangements(records: Mapping[str, Sequence[RequestRecord]], slo: Slo,
                           burst: Mapping[str, Any] | None = None,
                           ideal_hit_rate: float | None = None,
                           steps: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, dict[str, Any]]:
    """One `summarize_run` per run (arrangement or policy), in the order they ran, with the
    workload's `ideal_hit_rate`; where the workload mixes request groups (the id's prefix:
    "stream", "burst"), each group is summarized too, and with a burst the other groups' ITL
    while it lands (`during_burst_itl_ms`). `bottleneck`: the limits of p99 TTFT and ITL, with
    the run's worker step records (`steps`: run -> worker -> {"pool", "blocks_total", "steps"})."""
    summaries = {}
    for name, runs in records.items():
        summary = summarize_run(runs, slo) | {"ideal_hit_rate": ideal_hit_rate}
        groups: dict[str, list[RequestRecord]] = {}
        for r in runs:
            groups.setdefault(r.request_id.split("-")[0], []).append(r)
        if len(groups) > 1:
            summary["groups"] = {g: summarize_run(rs, slo, wall_s=summary["wall_s"]) for g, rs in groups.items()}
        if burst is not None:
            # it lands until its last prefill is done: on a saturated cluster that is long after it arrived
            landed = max((r.message_times_s[0] for r in runs if r.request_id.startswith("burst") and r.ok),
                         default=burst["end_s"])
            window = (burst["start_s"], max(burst["end_s"], landed) + BURST_TAIL_S)
            gaps = [itls_between(r, *window) for r in runs if r.ok and not r.request_id.startswith("burst")]
            summary["during_burst_itl_ms"] = latency_stats_ms(np.concatenate(gaps) if gaps else [])
            summary["during_burst_window_s"] = list(window)
        workers = (steps or {}).get(name)
        summary["bottleneck"] = analyze(runs, step_summary(workers, summary["wall_s"]) if workers else None,
                                        tuple(summary["during_burst_window_s"]) if burst is not None else None)
        summaries[name] = summary
    return summaries


def build_summary(summaries: Mapping[str, Mapping[str, Any]], workload: Workload, slo: Slo,
                  cluster: Mapping[str, Any], kind: str = "arrangements") -> dict[str, Any]:
    """The whole summary.json document; `kind` ("arrangements" | "policies") keys the runs."""
    return {
        "created_unix_s": time.time(),
        "workload": workload.describe(),
        "slo": slo.as_dict(),
        "cluster": dict(cluster),
        kind: {name: dict(summary) for name, summary in summaries.items()},
    }


def _ms(value: float | None) -> str:
    return f"{value:9.1f}" if value is not None else f"{'-':>9}"


def _percent(value: float | None) -> str:
    return f"{value:9.1%}" if value is not None else f"{'-':>9}"


def _count(value: int | None, scale: int = 1, digits: int = 0) -> str:
    return f"{value / scale:12,.{digits}f}" if value is not None else f"{'-':>12}"


def format_arrangement(name: str, summary: Mapping[str, Any]) -> str:
    """A block: latency rows (ms), throughput, goodput and SLO attainment, then the prefix cache."""
    lines = [f"== {name}: {summary['num_requests']} requests, {summary['num_errors']} failed, "
             f"{summary['wall_s']:.1f} s ==",
             f"{'(ms)':<6}" + "".join(f"{stat:>9}" for stat in _STATS)]
    for label, key in _LATENCY_ROWS:
        lines.append(f"{label:<6}" + "".join(_ms(summary[key][stat]) for stat in _STATS))
    slo = ", ".join(f"{k.removesuffix('_ms')}<={v:g}ms" for k, v in summary["slo"].items())
    lines.append(f"output {summary['output_tok_per_s']:.1f} tok/s, "
                 f"{summary['request_per_s']:.2f} req/s, "
                 f"goodput {summary['goodput_req_per_s']:.2f} req/s "
                 f"({summary['slo_attainment']:.1%} met {slo or 'no SLO: success only'})")
    hit, ideal = summary.get("prefix_hit_rate"), summary.get("ideal_hit_rate")
    if hit is not None or ideal is not None:
        served = f"{hit:.1%}" if hit is not None else "an unreported share"
        lines.append(f"prefix cache served {served} of {summary['prompt_tokens']:,} prompt tokens"
                     + (f" (ideal {ideal:.1%})" if ideal is not None else "")
                     + (f", {summary['prefill_tokens_computed']:,} computed" if hit is not None else ""))
    return "\n".join(lines)


def format_comparison(summaries: Mapping[str, Mapping[str, Any]], label: str = "arrangement") -> str:
    """One row per run: the numbers that decide between them."""
    header = (f"{label:<24}{'TTFT p50':>9}{'TTFT p99':>9}{'ITL p50':>9}{'ITL p99':>9}"
              f"{'TPOT':>9}{'tok/s':>9}{'goodput':>9}")
    rows = [header]
    for name, s in summaries.items():
        latencies = (s["ttft_ms"]["p50"], s["ttft_ms"]["p99"], s["itl_ms"]["p50"],
                     s["itl_ms"]["p99"], s["tpot_ms"]["mean"])
        rows.append(f"{name:<24}" + "".join(_ms(v) for v in latencies)
                    + f"{s['output_tok_per_s']:9.1f}{s['goodput_req_per_s']:9.2f}")
    return "\n".join(rows)


def format_cache(summaries: Mapping[str, Mapping[str, Any]], label: str = "arrangement") -> str:
    """One row per run: prompt tokens, those prefill computed, the hit rate against the ideal, KV pushed."""
    rows = [f"{label:<24}{'prompt':>12}{'computed':>12}{'hit rate':>9}{'ideal':>9}{'KV MiB':>12}"]
    for name, s in summaries.items():
        rows.append(f"{name:<24}{_count(s['prompt_tokens'])}{_count(s['prefill_tokens_computed'])}"
                    f"{_percent(s['prefix_hit_rate'])}{_percent(s['ideal_hit_rate'])}"
                    f"{_count(s['kv_transfer_bytes'], 1 << 20, 1)}")
    return "\n".join(rows)


def format_groups(summaries: Mapping[str, Mapping[str, Any]], label: str = "arrangement") -> str:
    """Per request group (e.g. the streaming users apart from the burst): TTFT and ITL."""
    rows = [f"{label:<24}{'group':<10}{'n':>5}{'TTFT p50':>9}{'TTFT p99':>9}{'ITL p50':>9}"
            f"{'ITL p95':>9}{'ITL p99':>9}"]
    for name, s in summaries.items():
        for group, g in s.get("groups", {}).items():
            rows.append(f"{name:<24}{group:<10}{g['num_requests']:>5}" + "".join(
                _ms(v) for v in (g["ttft_ms"]["p50"], g["ttft_ms"]["p99"], g["itl_ms"]["p50"],
                                 g["itl_ms"]["p95"], g["itl_ms"]["p99"])))
    return "\n".join(rows)


def format_burst(summaries: Mapping[str, Mapping[str, Any]], label: str = "arrangement") -> str:
    """ITL of everyone but the burst while it lands: from its first arrival to BURST_TAIL_S after the
    later of its last arrival and its last first token (its prefills are done)."""
    rows = [f"ITL of the other requests while the burst lands (ms)\n{label:<24}"
            + "".join(f"{stat:>9}" for stat in _STATS)]
    for name, s in summaries.items():
        stats = s.get("during_burst_itl_ms")
        if stats is not None:
            rows.append(f"{name:<24}" + "".join(_ms(stats[stat]) for stat in _STATS))
    return "\n".join(rows)


def format_report(summaries: Mapping[str, Mapping[str, Any]], label: str = "arrangement",
                  workload: Mapping[str, Any] | None = None, decision: Mapping[str, Any] | None = None) -> str:
    """A block per run, then side-by-side comparisons (`label` names the column: arrangement or
    policy) when there are several; with a shared-prefix workload, the share of its prompts the
    prefixes make up (what a prefix cache can at best save)."""
    blocks = [format_arrangement(name, s) for name, s in summaries.items()]
    if len(summaries) > 1:
        blocks.append("latencies in ms, goodput in req/s\n" + format_comparison(summaries, label))
        if any(s["prefix_hit_rate"] is not None or s["ideal_hit_rate"] is not None
               for s in summaries.values()):
            blocks.append("prefix cache (tokens)\n" + format_cache(summaries, label))
    if any("groups" in s for s in summaries.values()):
        blocks.append("by request group (ms)\n" + format_groups(summaries, label))
    if any("during_burst_itl_ms" in s for s in summaries.values()):
        blocks.append(format_burst(summaries, label))
    if workload is not None and "shared_fraction" in workload:
        blocks.append(f"workload: a shared prefix makes up {workload['shared_fraction']:.1%} of the prompt tokens")
    if any((s.get("bottleneck") or {}).get("itl_p99") or (s.get("bottleneck") or {}).get("ttft_p99")
           for s in summaries.values()):
        blocks.append(format_bottlenecks(summaries))
    if decision is not None:
        blocks.append(format_decision(decision, label))
    return "\n\n".join(blocks)


def format_bottlenecks(summaries: Mapping[str, Mapping[str, Any]]) -> str:
    """Per run: the sentence naming the limit of p99 TTFT, of p99 ITL (and while a burst lands)."""
    lines = ["what limits each run (bench/bottleneck.py)"]
    for name, s in summaries.items():
        found = s.get("bottleneck") or {}
        sentences = [found[k]["sentence"] for k in ("ttft_p99", "itl_p99", "itl_during_burst") if found.get(k)]
        lines += [f"{name}:"] + [f"  {text}" for text in sentences or ["the server reported no timings"]]
    return "\n".join(lines)


def format_decision(decision: Mapping[str, Any], label: str = "arrangement") -> str:
    """The ranking at equal worker count, then the recommendation sentence."""
    rows = [f"ranking at equal worker count\n{'#':<3}{label:<24}{'workers':>8}{'goodput':>9}{'SLO met':>9}"
            f"{'tok/s/wkr':>10}{'$/M tok':>9}{'$/M good':>9}{'TTFT p99':>9}{'ITL p99':>9}"]
    for r in decision["ranking"]:
        money = "".join(f"{v:9.2f}" if v is not None else f"{'-':>9}"
                        for v in (r["usd_per_million_tokens"], r["usd_per_million_good_tokens"]))
        per_worker = f"{r['tok_per_worker_s']:10.2f}" if r["tok_per_worker_s"] is not None else f"{'-':>10}"
        rows.append(f"{r['rank']:<3}{r['name']:<24}{r['workers'] or '-':>8}{r['goodput_req_per_s']:9.2f}"
                    f"{r['slo_attainment']:9.1%}{per_worker}{money}{_ms(r['ttft_p99_ms'])}{_ms(r['itl_p99_ms'])}")
    return "\n".join(rows) + "\n" + decision["recommendation"]


def record_to_json(record: RequestRecord, hash_ids: Sequence[int] | None = None,
                   block_size: int | None = None) -> dict[str, Any]:
    """One requests.jsonl line (seconds since its run started; `arrangement`: the run's name;
    `hash_ids`: ids of the prompt's full blocks of `block_size` tokens, for `pdserve inspect`)."""
    first, last = ttft(record), e2e(record)
    return {
        "arrangement": record.arrangement,
        "request_id": record.request_id,
        "send_s": record.send_s,
        "message_times_s": list(record.message_times_s),
        "message_tokens": list(record.message_tokens),
        "prompt_tokens": record.prompt_tokens,
        "max_tokens": record.max_tokens,
        "output_tokens": record.output_tokens,
        "finish_reason": record.finish_reason,
        "error": record.error,
        "ttft_ms": first * 1000 if first is not None else None,
        "e2e_ms": last * 1000 if last is not None else None,
        "usage": dict(record.usage),
    } | ({"block_size": block_size, "hash_ids": list(hash_ids)} if hash_ids is not None else {})


def write_report(out_dir: Path, summary: Mapping[str, Any], records: Mapping[str, Sequence[RequestRecord]],
                 plot: bool, steps: Mapping[str, Mapping[str, Any]] | None = None,
                 prompt_blocks: tuple[int, Mapping[str, Sequence[int]]] | None = None) -> list[Path]:
    """Writes summary.json, requests.jsonl (each line with its prompt's block ids: `prompt_blocks`
    = (block size, request id -> ids)), steps.jsonl when there are step records (and PNGs with
    `plot`); returns the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    summary_path = out_dir / "summary.json"
    summary_path.write_text(json.dumps(summary, indent=2) + "\n")
    requests_path = out_dir / "requests.jsonl"
    with requests_path.open("w") as handle:
        for runs in records.values():
            for record in runs:
                block_size, ids = prompt_blocks or (None, {})
                handle.write(json.dumps(record_to_json(record, ids.get(record.request_id), block_size)) + "\n")
    written = [summary_path, requests_path]
    if steps:
        steps_path = out_dir / "steps.jsonl"
        with steps_path.open("w") as handle:
            for run, workers in steps.items():
                for worker, w in workers.items():
                    for step in w["steps"]:
                        handle.write(json.dumps({"arrangement": run, "worker": worker, "pool": w["pool"]} | step) + "\n")
        written.append(steps_path)
    if plot:
        from bench.plot import write_plots  # matplotlib is optional and slow to import

        written += write_plots(out_dir, records, summary["workload"].get("burst"), steps)
    return written
