"""`pdserve simulate --autoscale`: the planner against every static arrangement, side by side.

The workload is replayed once on the config's cluster with `router.autoscale.enabled` (the
planner sizes the pools as it goes) and once on each static arrangement (a P:D split and size,
or colocated, each a fresh simulated cluster). Each run is scored by `bench.accounting.figures`:
SLO attainment and goodput, mean and peak workers, worker-hours, scaling actions, failed
requests and the cost per million good output tokens. The cheapest static arrangement meeting
the attainment target (fewest worker-hours) is the one the planner has to beat;
`worker_hours_ratio` = the planner's worker-hours / that arrangement's.
"""

from __future__ import annotations

from typing import Any

from bench.accounting import figures, timeline
from bench.autoscale_compare import AUTOSCALED, autoscaled_config, named_statics, verdict
from bench.metrics import Slo
from bench.workload import Workload
from router.config.schema import ClusterConfig
from simulate.parallel import run_jobs
from simulate.sweep import arrangements
from sizing.cost_model import Emulation

# the comparison's shared parts (bench/autoscale_compare.py) are also read from here (simulate/bench_planner.py)
__all__ = ["AUTOSCALED", "autoscaled_config", "compare", "static_configs", "verdict"]


def static_configs(base: ClusterConfig, names: str | None, sizes: list[int], splits: str) -> dict[str, ClusterConfig]:
    """The named arrangements (`colocated-N`, `PpDd` such as `10P6D`), or every arrangement of
    each size (simulate/sweep.py's: colocated and each P:D split, all or in eighths)."""
    if names is None:
        return {name: cfg for n in sizes for name, cfg in arrangements(base, n, splits).items()}
    return named_statics(base, names)


def _one(job: tuple) -> tuple[str, dict[str, Any], dict[str, Any]]:
    from simulate.run import simulate  # the router's code: loaded by a run, not by a usage error

    name, cfg, em, workload, slo, seed, usd_per_hour = job
    run = simulate(cfg, em, workload, name, seed, check=False)
    row = figures(run.records, slo, run.ledger, run.t0, run.end, run.decisions, usd_per_hour,
                  workload.describe().get("bursts"))
    return name, row, timeline(run.ledger, run.t0, run.end, run.decisions) | {"host_s": run.host_s}


def compare(autoscaled: ClusterConfig, statics: dict[str, ClusterConfig], em: Emulation, workload: Workload,
            slo: Slo, seed: int = 0, usd_per_hour: float | None = None, attainment: float = 0.9,
            processes: int | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the --json result, the planner's timeline for the plot: its decisions and each pool's
    workers over time, seconds from the first arrival)."""
    jobs = [(AUTOSCALED, autoscaled, em, workload, slo, seed, usd_per_hour)]
    jobs += [(name, cfg, em, workload, slo, seed, usd_per_hour) for name, cfg in statics.items()]
    results = list(run_jobs(_one, jobs, processes))
    rows = {name: row for name, row, _ in results}
    return verdict(rows.pop(AUTOSCALED), rows, attainment), results[0][2]
