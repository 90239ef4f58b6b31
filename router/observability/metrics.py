"""Prometheus metrics of the router, on a private registry (no global state between routers).

The router calls the `observe_*` methods as a request moves (queue -> prefill -> KV transfer
-> first token -> tokens -> finish), `set_worker_gauges` from each status poll and
`set_router_queue` whenever its admission queue changes; `render` returns the exposition text
(tests, Admin). The `/metrics` port is router/observability/metrics_server.py.
"""

from __future__ import annotations

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from router.observability.recent import RecentLoad

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
                    20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5,
                1.0, 2.5, 5.0)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0,
                640.0)
_TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                     2.5, 5.0, 10.0)
_BYTES_BUCKETS = tuple(float(4**power * 1024) for power in range(13))  # 1 KiB .. 16 GiB


class RouterMetrics:
    """Every metric the router exports; one instance per router process."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._build_histograms()
        self._build_gauges_and_counters()
        self._build_autoscale()
        self.recent: RecentLoad | None = None  # the autoscaler's window, while one reads it

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
        return Histogram(name, doc, buckets=buckets, registry=self.registry)

    def _build_histograms(self) -> None:
        self.ttft = self._histogram("pdserve_ttft_seconds",
                                    "Request accepted to first token ready.", _LATENCY_BUCKETS)
        self.itl = self._histogram("pdserve_itl_seconds",
                                   "Gap between consecutive tokens of one request.", _ITL_BUCKETS)
        self.e2e = self._histogram("pdserve_e2e_seconds",
                                   "Request accepted to last token.", _E2E_BUCKETS)
        self.queue = self._histogram("pdserve_queue_seconds",
                                     "Time spent waiting in the router queue.", _LATENCY_BUCKETS)
        self.prefill = self._histogram("pdserve_prefill_seconds",
                                       "Prefill time on a prefill worker.", _LATENCY_BUCKETS)
        self.kv_transfer = self._histogram("pdserve_kv_transfer_seconds",
                                           "KV cache transfer time, prefill to decode.",
                                           _TRANSFER_BUCKETS)
        self.kv_transfer_bytes = self._histogram("pdserve_kv_transfer_bytes",
                                                 "KV cache bytes moved per request.",
                                                 _BYTES_BUCKETS)

    def _build_gauges_and_counters(self) -> None:
        reg = self.registry
        self.running = Gauge("pdserve_requests_running", "Requests running on a worker.",
                             ["worker"], registry=reg)
        self.waiting = Gauge("pdserve_requests_waiting",
                             "Requests waiting on a worker (worker='router': router queue).",
                             ["worker"], registry=reg)
        self.kv_blocks_used = Gauge("pdserve_kv_blocks_used", "KV blocks in use.", ["worker"],
                                    registry=reg)
        self.kv_blocks_free = Gauge("pdserve_kv_blocks_free", "KV blocks free.", ["worker"],
                                    registry=reg)
        self.requests = Counter("pdserve_requests", "Finished requests by finish reason.",
                                ["finish_reason"], registry=reg)
        self.errors = Counter("pdserve_request_errors", "Failed requests by gRPC status.",
                              ["status"], registry=reg)
        self.migrations = Counter("pdserve_request_migrations",
                                  "Attempts that failed and moved their request to another worker.",
                                  registry=reg)
        self.early_prefills = Counter("pdserve_early_prefills",
                                      "Prefills started while their decode reservation was in flight, by "
                                      "outcome: aimed (the reservation held) or dropped (it found no room).",
                                      ["outcome"], registry=reg)
        self.local_prefills = Counter("pdserve_local_prefills",
                                      "Disaggregated requests prefilled on their decode worker (router.local_prefill), "
                                      "by reason: short (few uncached tokens) or prefill_wait (the prefill pool "
                                      "was backed up).", ["reason"], registry=reg)
        self.worker_failures = Counter("pdserve_worker_failures", "Workers that died or hung, by pool.",
                                       ["pool"], registry=reg)
        self.prefix_query_tokens = Counter("pdserve_prefix_cache_query_tokens",
                                           "Context tokens looked up in a worker's prefix cache, by pool.",
                                           ["pool"], registry=reg)
        self.prefix_hit_tokens = Counter("pdserve_prefix_cache_hit_tokens",
                                         "Context tokens found in a worker's prefix cache (KV reused), by pool.",
                                         ["pool"], registry=reg)
        self.prefix_hit_rate = Gauge("pdserve_prefix_cache_hit_rate",
                                     "Hit tokens / query tokens since the router started, by pool.",
                                     ["pool"], registry=reg)
        self.kv_transfer_saved = Counter("pdserve_kv_transfer_saved_bytes",
                                         "KV bytes not sent because the decode worker already held the blocks.",
                                         registry=reg)
        self.kv_blocks_cached = Gauge("pdserve_kv_blocks_cached",
                                      "KV blocks holding a reusable prefix (in use or evictable).", ["worker"],
                                      registry=reg)
        self._prefix_totals: dict[str, list[int]] = {}  # pool -> [query, hit]

    def _build_autoscale(self) -> None:
        reg = self.registry
        self.autoscale_desired = Gauge("pdserve_autoscale_desired_workers",
                                       "Workers the autoscaler's last decision asked of the pool.", ["pool"],
                                       registry=reg)
        self.autoscale_actual = Gauge("pdserve_autoscale_actual_workers",
                                      "Ready, warmed-up workers the autoscaler counted as the pool's capacity.",
                                      ["pool"], registry=reg)
        self.autoscale_actions = Counter("pdserve_autoscale_actions",
                                         "Autoscaler decisions that changed a pool's size, by direction.",
                                         ["pool", "direction"], registry=reg)
        self.autoscale_reason = Gauge("pdserve_autoscale_reason",
                                      "1 for the cause of the pool's last autoscaler decision (docs/autoscale.md).",
                                      ["pool", "cause"], registry=reg)
        self._autoscale_causes: dict[str, str] = {}

    def observe_autoscale(self, pool: str, desired: int, actual: int, target: int, cause: str) -> None:
        """One autoscaler decision for `pool` (`target`: its size before the decision)."""
        self.autoscale_desired.labels(pool=pool).set(desired)
        self.autoscale_actual.labels(pool=pool).set(actual)
        if desired != target:
            self.autoscale_actions.labels(pool=pool, direction="up" if desired > target else "down").inc()
        old = self._autoscale_causes.get(pool)
        if old is not None and old != cause:
            self.autoscale_reason.remove(pool, old)
        self._autoscale_causes[pool] = cause
        self.autoscale_reason.labels(pool=pool, cause=cause).set(1)

    def observe_first_token(self, ttft_s: float) -> None:
        self.ttft.observe(ttft_s)
        if self.recent is not None:
            self.recent.first_token(ttft_s)

    def observe_token(self, gap_s: float) -> None:
        """One inter-token gap; a message carrying k tokens contributes k gaps (k-1 of 0 s)."""
        self.itl.observe(gap_s)
        if self.recent is not None:
            self.recent.token_gap(gap_s)

    def observe_queue(self, seconds: float) -> None:
        self.queue.observe(seconds)

    def observe_prefill(self, seconds: float) -> None:
        self.prefill.observe(seconds)

    def observe_kv_transfer(self, seconds: float, num_bytes: int) -> None:
        self.kv_transfer.observe(seconds)
        self.kv_transfer_bytes.observe(num_bytes)

    def observe_finish(self, finish_reason: str, e2e_s: float) -> None:
        self.requests.labels(finish_reason=finish_reason or "unknown").inc()
        self.e2e.observe(e2e_s)

    def observe_error(self, status: str) -> None:
        """`status` is the gRPC status name, e.g. "RESOURCE_EXHAUSTED"."""
        self.errors.labels(status=status).inc()

    def observe_migration(self) -> None:
        self.migrations.inc()

    def observe_early_prefill(self, outcome: str) -> None:
        self.early_prefills.labels(outcome=outcome).inc()

    def observe_local_prefill(self, reason: str) -> None:
        self.local_prefills.labels(reason=reason).inc()

    def observe_prefix(self, pool: str, query_tokens: int, hit_tokens: int) -> None:
        """One lookup of `query_tokens` context tokens in a `pool` worker's prefix cache."""
        self.prefix_query_tokens.labels(pool=pool).inc(query_tokens)
        self.prefix_hit_tokens.labels(pool=pool).inc(hit_tokens)
        totals = self._prefix_totals.setdefault(pool, [0, 0])
        totals[0] += query_tokens
        totals[1] += hit_tokens
        if totals[0]:
            self.prefix_hit_rate.labels(pool=pool).set(totals[1] / totals[0])

    def prefix_totals(self, pool: str) -> tuple[int, int]:
        """(tokens looked up, tokens hit) in `pool`'s prefix caches since the router started."""
        query, hit = self._prefix_totals.get(pool, (0, 0))
        return query, hit

    def observe_kv_saved(self, num_bytes: int) -> None:
        self.kv_transfer_saved.inc(num_bytes)

    def observe_worker_failure(self, pool: str) -> None:
        self.worker_failures.labels(pool=pool).inc()

    def set_worker_gauges(self, worker: str, running: int, waiting: int,
                          kv_blocks_used: int, kv_blocks_free: int, kv_blocks_cached: int = 0) -> None:
        self.kv_blocks_cached.labels(worker=worker).set(kv_blocks_cached)
        self.running.labels(worker=worker).set(running)
        self.waiting.labels(worker=worker).set(waiting)
        self.kv_blocks_used.labels(worker=worker).set(kv_blocks_used)
        self.kv_blocks_free.labels(worker=worker).set(kv_blocks_free)

    def set_router_queue(self, waiting: int) -> None:
        self.waiting.labels(worker="router").set(waiting)

    def remove_worker(self, name: str) -> None:
        """Drops a stopped worker's series so dashboards don't show it frozen."""
        for gauge in (self.running, self.waiting, self.kv_blocks_used, self.kv_blocks_free, self.kv_blocks_cached):
            try:
                gauge.remove(name)
            except KeyError:
                continue  # the worker never reported this gauge

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return prometheus_client.generate_latest(self.registry)
