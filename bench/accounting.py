"""What a cluster cost: every worker's life on the router's clock, and the figures of it.

Shared by `pdserve simulate --autoscale` (virtual clock) and `pdserve bench --autoscale` (a live
cluster). `RecordingActors` wraps the pool manager's `Actors` (Ray's, or simulate/actors.py's) and
fills a `WorkerLedger`: a worker's life begins at the pool manager's start call (its weights load
counts: a starting GPU is paid for) and ends at its kill (stopped after a drain, failed, or a start
that failed); a role change keeps the life (the process lives on, in the pool it started in). `usage` integrates the lives over a window [t0, end]
(the first arrival's origin to the last request's end): mean and peak workers, worker-hours, per
pool and in total. `scaling_actions` counts the planner's decisions that changed a pool, or,
for a cluster without a planner, the batches of workers started after t0 (replacements of the
dead included: a static cluster should read 0).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from bench.metrics import Slo, meets_slo, summarize_run
from protocol import clock
from router.config.schema import PoolSection

if TYPE_CHECKING:  # Ray's own Actors import ray: not for `pdserve --help`
    from router.pools.actors import Actors

# The price of one H100 SXM for an hour, on demand (late-2025 public cloud list prices run
# $2-4; we state $2.99, the figure every comparison here uses unless --cost-per-worker-hour says otherwise).
USD_PER_HOUR = {"h100": 2.99, "h200": 3.79, "a100": 1.79, "l40s": 1.29}


@dataclass
class Life:
    name: str
    pool: str
    start: float
    stop: float | None = None

    def within(self, t0: float, end: float) -> float:
        """Seconds of this life inside [t0, end]."""
        return max(0.0, min(end, self.stop if self.stop is not None else end) - max(t0, self.start))


@dataclass
class WorkerLedger:
    """Every worker's life on the virtual clock, in the order they were started."""

    lives: list[Life] = field(default_factory=list)
    _open: dict[str, Life] = field(default_factory=dict)

    def started(self, name: str, pool: str, at: float) -> None:
        assert name not in self._open, f"{name} started twice"
        life = Life(name, pool, at)
        self.lives.append(life)
        self._open[name] = life

    def stopped(self, name: str, at: float) -> None:
        life = self._open.pop(name, None)
        if life is not None:  # a second kill of the same worker changes nothing
            life.stop = at

    def pools(self) -> list[str]:
        return sorted({life.pool for life in self.lives})

    def count_at(self, t: float, pool: str | None = None) -> int:
        """Workers alive (starting, serving or draining) at `t`."""
        return sum(1 for life in self.lives if (pool is None or life.pool == pool) and life.start <= t
                   and (life.stop is None or life.stop > t))

    def changes(self, t0: float, end: float, pool: str | None = None) -> list[tuple[float, int]]:
        """(time, workers alive from then on) at t0 and at every start or stop inside the window."""
        times = sorted({t0} | {t for life in self.lives if pool is None or life.pool == pool
                               for t in (life.start, life.stop) if t is not None and t0 < t <= end})
        return [(t, self.count_at(t, pool)) for t in times]

    def batches_after(self, t0: float) -> int:
        """Distinct (time, pool) at which workers were started after t0."""
        return len({(life.start, life.pool) for life in self.lives if life.start > t0})

    def contracted(self, t0: float, k: float) -> WorkerLedger:
        """The lives with every time's distance from `t0` divided by `k` (an emulated run at
        time_scale k: back to emulated seconds)."""
        def back(t: float | None) -> float | None:
            return None if t is None else t0 + (t - t0) / k
        return WorkerLedger([replace(life, start=back(life.start), stop=back(life.stop)) for life in self.lives])


class RecordingActors:
    """The pool manager's `Actors` (router/pools/actors.py) with each worker's life written into
    `ledger` on the router's clock: from the start call to the kill. Everything else is `inner`'s."""

    def __init__(self, inner: Actors):
        self.inner = inner
        self.ledger = WorkerLedger()
        self._names: dict[int, tuple[Any, str]] = {}  # id(handle) -> (handle, the name it started as)

    def start(self, cls: type, sec: PoolSection, env: dict[str, str], args: tuple) -> Any:
        pool, name = args[0], args[1]  # PoolManager._start_one's (pool, name, engine, ...)
        at = clock.now()
        handle = self.inner.start(cls, sec, env, args)
        self.ledger.started(name, pool, at)
        self._names[id(handle)] = (handle, name)
        return handle

    def kill(self, actor: Any) -> None:
        self.inner.kill(actor)
        entry = self._names.pop(id(actor), None)
        if entry is not None:
            self.ledger.stopped(entry[1], clock.now())

    def check_placeable(self, pool: str, sec: PoolSection, count: int) -> None:
        self.inner.check_placeable(pool, sec, count)


def _pool_usage(ledger: WorkerLedger, t0: float, end: float, pool: str | None) -> dict[str, float]:
    span = max(end - t0, 1e-9)
    seconds = sum(life.within(t0, end) for life in ledger.lives if pool is None or life.pool == pool)
    peak = max((n for _, n in ledger.changes(t0, end, pool)), default=0)
    return {"mean_workers": seconds / span, "peak_workers": peak, "worker_hours": seconds / 3600}


def usage(ledger: WorkerLedger, t0: float, end: float) -> dict[str, Any]:
    """Mean and peak workers and worker-hours over [t0, end], in total and per pool."""
    total = _pool_usage(ledger, t0, end, None)
    return total | {"pools": {pool: _pool_usage(ledger, t0, end, pool) for pool in ledger.pools()}}


def scaling_actions(decisions: list[Any] | None, ledger: WorkerLedger, t0: float) -> int:
    """The planner's decisions that changed a pool; without a planner, start batches after t0."""
    if decisions is not None:
        return sum(1 for d in decisions if _changed(d))
    return ledger.batches_after(t0)


def _changed(decision: Any) -> bool:
    return bool(decision["changed"] if isinstance(decision, dict) else decision.changed)


def figures(records: list, slo: Slo, ledger: WorkerLedger, t0: float, end: float, decisions: list[Any] | None,
            usd_per_hour: float | None, windows: list[dict[str, float]] | None = None) -> dict[str, Any]:
    """One run's row of the autoscaling comparison (`S` of `pdserve simulate --autoscale --json`);
    with `windows` (the workload's bursts), also the attainment of the requests sent in each."""
    run = summarize_run(records, slo)
    used = usage(ledger, t0, end)
    good = run["good_output_tokens"]
    cost = used["worker_hours"] * usd_per_hour if usd_per_hour is not None else None
    return {
        "slo_attainment": run["slo_attainment"], "goodput_req_per_s": run["goodput_req_per_s"],
        "mean_workers": used["mean_workers"], "peak_workers": used["peak_workers"],
        "worker_hours": used["worker_hours"], "scaling_actions": scaling_actions(decisions, ledger, t0),
        "failed": run["num_errors"], "requests": run["num_requests"], "good_output_tokens": good,
        "usd": cost, "usd_per_million_good_tokens": cost / good * 1e6 if cost is not None and good else None,
        "simulated_s": end - t0, "pools": used["pools"],
    } | ({"attainment_by_window": [_attainment(records, slo, w["start_s"], w["end_s"]) for w in windows]}
         if windows else {})


def _attainment(records: list, slo: Slo, start: float, end: float) -> float | None:
    sent = [r for r in records if start <= r.send_s < end]
    return sum(meets_slo(r, slo) for r in sent) / len(sent) if sent else None


def timeline(ledger: WorkerLedger, t0: float, end: float, decisions: list[dict] | None) -> dict[str, Any]:
    """For the plot (simulate/autoscale_plot.py): each pool's workers alive and the planner's
    decisions, in seconds from `t0`."""
    return {"actual": {pool: [(t - t0, n) for t, n in ledger.changes(t0, end, pool)] for pool in ledger.pools()},
            "decisions": [d | {"at": d["at"] - t0} for d in decisions or []]}
