"""`pdserve simulate --autoscale`'s command line: options in, the comparison and its plot out.

Prints the side-by-side table (or, with `--json`, exactly `{"autoscaled": S, "static": {NAME: S},
"cheapest_static_meeting_attainment": NAME, "worker_hours_ratio": R}`) and writes
`autoscale.json` (the same, with the planner's timeline, the workload and the price used) and
`autoscale.png` (desired vs alive workers per pool against the arrival rate) under `--out`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from bench.accounting import USD_PER_HOUR
from bench.autoscale_compare import autoscaled_config, format_comparison
from bench.errors import BenchError
from bench.workload import Workload
from router.config.schema import ClusterConfig
from simulate.autoscale import compare, static_configs
from sizing.cost_model import Emulation


def _setup(args: argparse.Namespace, base: ClusterConfig, slo: Any) -> tuple[ClusterConfig, dict, float | None]:
    if not slo.ttft_s and not slo.tpot_s and not slo.e2e_s:
        raise BenchError("--autoscale scores every run by its SLO: give --slo, e.g. ttft=2,tpot=50ms")
    try:
        sizes = [int(v) for v in args.sizes.split(",")]
    except ValueError:
        raise BenchError(f"--sizes {args.sizes!r}: expected device counts, e.g. 16,32") from None
    if any(n < 2 for n in sizes):
        raise BenchError("--sizes need at least 2 devices each")
    price = args.cost_per_worker_hour or USD_PER_HOUR.get(base.emulate.device or "")
    return autoscaled_config(base), static_configs(base, args.statics, sizes, args.splits), price


def run_autoscale(args: argparse.Namespace, base: ClusterConfig, em: Emulation, workload: Workload, slo: Any) -> int:
    try:
        planner, statics, price = _setup(args, base, slo)
    except BenchError as err:
        print(f"pdserve simulate: {err}", file=sys.stderr)
        return 2
    result, timeline = compare(planner, statics, em, workload, slo, args.seed, price, args.attainment, args.processes)
    print(json.dumps(result, indent=2) if args.json else format_comparison(result, args.attainment))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = result | {"timeline": timeline, "workload": workload.describe(), "usd_per_worker_hour": price,
                       "attainment_target": args.attainment, "assumptions": em.assumptions()}
    (out / "autoscale.json").write_text(json.dumps(record, indent=2))
    print(f"wrote {out / 'autoscale.json'}", file=sys.stderr)
    try:
        from simulate.autoscale_plot import plot_timeline

        arrivals = [r.arrival_s for r in workload.requests]
        print(f"wrote {plot_timeline(timeline, arrivals, str(out / 'autoscale.png'))}", file=sys.stderr)
    except ImportError:
        print("pdserve simulate: no plot (matplotlib is not installed: pip install pdserve[plot])", file=sys.stderr)
    return 0
