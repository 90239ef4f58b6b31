"""Markdown tables of simulate/bench_autoscale.py's results (docs/autoscale_results.md, the closing note):
`python -m simulate.autoscale_tables RESULTS.json [...]`, one table per case, every run side by side.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

COLUMNS = (("slo_attainment", "attainment", "{:.1%}"), ("goodput_req_per_s", "goodput req/s", "{:.2f}"),
           ("mean_workers", "mean workers", "{:.2f}"), ("peak_workers", "peak", "{:d}"),
           ("worker_hours", "worker-hours", "{:.3f}"), ("scaling_actions", "actions", "{:d}"),
           ("failed", "failed", "{:d}"), ("usd_per_million_good_tokens", "$ / M good tokens", "{:.2f}"))


def _row(name: str, s: dict[str, Any]) -> str:
    cells = [fmt.format(s[key]) if s.get(key) is not None else "-" for key, _, fmt in COLUMNS]
    return f"| {name} | " + " | ".join(cells) + " |"


def table(case: str, result: dict[str, Any]) -> str:
    head = "| run | " + " | ".join(label for _, label, _ in COLUMNS) + " |"
    lines = [f"**{case}**", "", head, "|" + "---|" * (len(COLUMNS) + 1)]
    planners = result.get("planners", {})
    if "autoscaled" in result:
        mode = f" ({result['planner_mode']})" if planners and "planner_mode" in result else ""
        lines.append(_row(f"**planner{mode}**", result["autoscaled"]))
    for mode, run in planners.items():
        if mode != result.get("planner_mode"):
            lines.append(_row(f"planner ({mode})", run["autoscaled"]))
    if "blind_to_queue_wait" in result:
        lines.append(_row("planner blind to queue wait", result["blind_to_queue_wait"]))
    statics = result.get("static", {})
    for name in sorted(statics, key=lambda n: (statics[n]["worker_hours"], n)):
        lines.append(_row(name, statics[name]))
    lines.append("")
    cheapest, ratio = result.get("cheapest_static_meeting_attainment"), result.get("worker_hours_ratio")
    if "worker_hours_ratio" in result:
        lines.append(f"cheapest static meeting 90%: {cheapest}; planner / it worker-hours: "
                     + (f"{ratio:.2f}" if ratio is not None else "- (none met it)"))
        for mode, run in planners.items():
            r = run["worker_hours_ratio"]
            lines.append(f"planner ({mode}) / it worker-hours: " + (f"{r:.2f}" if r is not None else "-"))
    for key in ("actions_after_settling", "changes_at_s"):
        if key in result:
            lines.append(f"{key.replace('_', ' ')}: {result[key]}")
    if "static_recommendation" in result:
        r = result["static_recommendation"]
        ratio = r.get("ratio_to_best")
        lines.append(f"`pdserve plan --trace` recommends {r['recommended']}: attainment {r['attainment']:.1%}, "
                     f"{r['good_per_worker_hour']:.0f} good requests per worker-hour; best static meeting 90%: "
                     f"{r['best_static']} ({(r['best_good_per_worker_hour'] or 0):.0f}); ratio "
                     + (f"{ratio:.2f}" if ratio is not None else "- (the recommendation misses 90%)"))
    if "targets" in result:
        lines.append("targets: " + ", ".join(f"{k} **{'met' if v else 'NOT met'}**" for k, v in result["targets"].items()))
    return "\n".join(lines)


def main(paths: list[str]) -> int:
    for path in paths:
        results = json.loads(Path(path).read_text())
        for case, result in results.items():
            if isinstance(result, dict) and ("static" in result or "autoscaled" in result):
                print(table(case, result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
