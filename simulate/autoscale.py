"""`pdserve simulate --autoscale`: the planner against every static arrangement, side by side.

The workload is replayed once on the config's cluster with `router.autoscale.enabled` (the
planner sizes the pools as it goes) and once on each static arrangement (a P:D split and size,
or colocated, each a fresh simulated cluster). Each run is scored by `simulate.accounting.figures`:
SLO attainment and goodput, mean and peak workers, worker-hours, scaling actions, failed
requests and the cost per million good output tokens. The cheapest static arrangement meeting
the attainment target (fewest worker-hours) is the one the planner has to beat;
`worker_hours_ratio` = the planner's worker-hours / that arrangement's.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import re
from typing import Any

from bench.arrangements import arrangement_config
from bench.errors import BenchError
from bench.metrics import Slo
from bench.workload import Workload
from router.config.schema import ClusterConfig
from simulate.accounting import figures
from simulate.run import simulate
from simulate.sweep import arrangements
from sizing.cost_model import Emulation

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


def static_configs(base: ClusterConfig, names: str | None, sizes: list[int], splits: str) -> dict[str, ClusterConfig]:
    """The named arrangements (`colocated-N`, `PpDd` such as `10P6D`), or every arrangement of
    each size (simulate/sweep.py's: colocated and each P:D split, all or in eighths)."""
    if names is None:
        return {name: cfg for n in sizes for name, cfg in arrangements(base, n, splits).items()}
    out = {}
    for name in (n.strip() for n in names.split(",") if n.strip()):
        if m := re.fullmatch(r"colocated-(\d+)", name):
            out[name] = arrangement_config(base, "colocated-chunked", int(m[1]))
        elif m := re.fullmatch(r"(\d+)P(\d+)D", name):
            p, d = int(m[1]), int(m[2])
            if p < 1 or d < 1:
                raise BenchError(f"--statics {name}: a split needs at least 1 prefill and 1 decode worker")
            out[name] = arrangement_config(base, "disaggregated", p + d, prefill_workers=p)
        else:
            raise BenchError(f"--statics {name!r}: expected colocated-N or a split such as 10P6D")
    return out


def _one(job: tuple) -> tuple[str, dict[str, Any], dict[str, Any]]:
    name, cfg, em, workload, slo, seed, usd_per_hour = job
    run = simulate(cfg, em, workload, name, seed, check=False)
    row = figures(run.records, slo, run.ledger, run.t0, run.end, run.decisions, usd_per_hour,
                  workload.describe().get("bursts"))
    timeline = {"actual": {pool: [(t - run.t0, n) for t, n in run.ledger.changes(run.t0, run.end, pool)]
                           for pool in run.ledger.pools()},
                "decisions": [d | {"at": d["at"] - run.t0} for d in run.decisions or []],
                "host_s": run.host_s}
    return name, row, timeline


def compare(autoscaled: ClusterConfig, statics: dict[str, ClusterConfig], em: Emulation, workload: Workload,
            slo: Slo, seed: int = 0, usd_per_hour: float | None = None, attainment: float = 0.9,
            processes: int | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the --json result, the planner's timeline for the plot: its decisions and each pool's
    workers over time, seconds from the first arrival)."""
    jobs = [(AUTOSCALED, autoscaled, em, workload, slo, seed, usd_per_hour)]
    jobs += [(name, cfg, em, workload, slo, seed, usd_per_hour) for name, cfg in statics.items()]
    procs = processes or min(len(jobs), os.cpu_count() or 1)
    if procs > 1:
        with multiprocessing.get_context("spawn").Pool(procs) as pool:
            results = pool.map(_one, jobs, chunksize=1)
    else:
        results = [_one(job) for job in jobs]
    rows = {name: row for name, row, _ in results}
    timeline = results[0][2]
    return verdict(rows.pop(AUTOSCALED), rows, attainment), timeline


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
