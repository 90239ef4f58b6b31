"""The autoscaling comparison's shared parts: the planner's config, the static arrangements by
name, the verdict and the table, for `pdserve simulate --autoscale` (simulate/autoscale.py) and
`pdserve bench --autoscale` (bench/autoscale_live.py) alike.

Each run is one row `S` (bench/accounting.py `figures`); the result is the issue's schema,
`{"autoscaled": S, "static": {NAME: S}, "cheapest_static_meeting_attainment": NAME,
"worker_hours_ratio": R}`: the cheapest static arrangement (fewest worker-hours) whose attainment
meets the target is the one the planner has to beat, R = the planner's worker-hours / its.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from bench.arrangements import arrangement_config
from bench.errors import BenchError
from router.config.schema import ClusterConfig

AUTOSCALED = "autoscaled"
COLUMNS = (("slo_attainment", "attain", "{:.1%}"), ("goodput_req_per_s", "goodput/s", "{:.2f}"),
           ("mean_workers", "mean wk", "{:.1f}"), ("peak_workers", "peak", "{:d}"),
           ("worker_hours", "worker-h", "{:.3f}"), ("scaling_actions", "actions", "{:d}"), ("failed", "failed", "{:d}"),
           ("usd_per_million_good_tokens", "$/M good tok", "{:.2f}"))


def autoscaled_config(base: ClusterConfig, **changes: Any) -> ClusterConfig:
    """`base` with its planner on (router.autoscale.enabled), `changes` applied to that section."""
    section = getattr(base.router, "autoscale", None)
    if section is None:
        raise BenchError("--autoscale: this build's config has no router.autoscale section (no planner)")
    section = dataclasses.replace(section, enabled=True, **changes)
    return dataclasses.replace(base, router=dataclasses.replace(base.router, autoscale=section))


def static_shapes(names: str) -> dict[str, tuple[int, int]]:
    """`colocated-N` (chunked prefill) and `PpDd` splits such as `10P6D`, comma-separated: each
    name's (prefill workers, all workers); 0 prefill workers is colocated."""
    out = {}
    for name in (n.strip() for n in names.split(",") if n.strip()):
        if m := re.fullmatch(r"colocated-(\d+)", name):
            if int(m[1]) < 1:
                raise BenchError(f"--statics {name}: a colocated arrangement needs at least 1 worker")
            out[name] = (0, int(m[1]))
        elif m := re.fullmatch(r"(\d+)P(\d+)D", name):
            p, d = int(m[1]), int(m[2])
            if p < 1 or d < 1:
                raise BenchError(f"--statics {name}: a split needs at least 1 prefill and 1 decode worker")
            out[name] = (p, p + d)
        else:
            raise BenchError(f"--statics {name!r}: expected colocated-N or a split such as 10P6D")
    if not out:
        raise BenchError("--statics: no arrangement named; e.g. 1P1D,2P1D,colocated-2")
    return out


def named_statics(base: ClusterConfig, names: str) -> dict[str, ClusterConfig]:
    """The arrangements `static_shapes` names, on `base`, without a planner."""
    out = {}
    for name, (prefill, n) in static_shapes(names).items():
        cfg = (arrangement_config(base, "colocated-chunked", n) if prefill == 0 else
               arrangement_config(base, "disaggregated", n, prefill_workers=prefill))
        auto = dataclasses.replace(cfg.router.autoscale, enabled=False)
        out[name] = dataclasses.replace(cfg, router=dataclasses.replace(cfg.router, autoscale=auto))
    return out


def verdict(planner: dict[str, Any], static: dict[str, dict[str, Any]], attainment: float) -> dict[str, Any]:
    """The issue's schema: the cheapest static arrangement (fewest worker-hours) whose attainment
    meets the target, and the planner's worker-hours over its (None when no static meets it)."""
    meeting = [name for name, s in static.items() if s["slo_attainment"] >= attainment]
    cheapest = min(meeting, key=lambda name: (static[name]["worker_hours"], name), default=None)
    ratio = planner["worker_hours"] / static[cheapest]["worker_hours"] if cheapest else None
    return {"autoscaled": planner, "static": static, "cheapest_static_meeting_attainment": cheapest,
            "worker_hours_ratio": ratio}


def format_comparison(result: dict[str, Any], attainment: float) -> str:
    header = f"{'run':<16}" + "".join(f"{label:>14}" for _, label, _ in COLUMNS)
    lines = [header]
    rows = {AUTOSCALED: result["autoscaled"]} | result["static"]
    for name, s in rows.items():
        cells = [fmt.format(s[key]) if s[key] is not None else "-" for key, _, fmt in COLUMNS]
        lines.append(f"{name:<16}" + "".join(f"{c:>14}" for c in cells))
    cheapest, ratio = result["cheapest_static_meeting_attainment"], result["worker_hours_ratio"]
    lines.append(f"\nno static arrangement met {attainment:.0%} attainment" if cheapest is None else
                 f"\ncheapest static meeting {attainment:.0%} attainment: {cheapest}; the planner used "
                 f"{ratio:.2f}x its worker-hours at {result['autoscaled']['slo_attainment']:.1%} attainment")
    return "\n".join(lines)
