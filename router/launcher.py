"""Bring a cluster up and down: Ray (start a local head or join), the pools, the gRPC server,
the OpenAI-compatible HTTP server (`router.http_port`) on the same loop.

`serve_forever(cfg)` is `pdserve serve` (foreground, stops on SIGINT/SIGTERM). `LocalCluster`
runs the same thing on a background thread for tests and `pdserve bench`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import threading
from pathlib import Path

import ray

from engine.memory import parse_bytes
from router.config import ClusterConfig
from router.metrics import RouterMetrics
from router.openai_api import OpenAIServer
from router.server import RouterServer
from router.service import Router

log = logging.getLogger(__name__)
ARRANGEMENTS = ("colocated", "colocated-chunked", "disaggregated", "disaggregated-chunked")


def ensure_model(cfg: ClusterConfig) -> None:
    if cfg.model.create_tiny != "off" and not (Path(cfg.model.path) / "config.json").exists():
        from engine.tiny_model import ensure_model as make

        log.info("creating the embedded tiny %s model at %s", cfg.model.create_tiny, cfg.model.path)
        make(cfg.model.path, arch=cfg.model.create_tiny, size="tiny")
    if not (Path(cfg.model.path) / "config.json").exists():
        raise FileNotFoundError(f"model.path {cfg.model.path} has no config.json")


def init_ray(cfg: ClusterConfig) -> bool:
    """Connect to Ray as the config says; True if this process started a local head."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if ray.is_initialized():
        return False
    if cfg.ray.address:
        ray.init(address=cfg.ray.address, log_to_driver=True)
        return False
    needed = cfg.prefill.replicas * cfg.prefill.num_cpus + cfg.decode.replicas * cfg.decode.num_cpus
    num_cpus = cfg.ray.num_cpus or max(os.cpu_count() or 1, int(needed) + 4)
    ray.init(num_cpus=num_cpus, include_dashboard=False,
             object_store_memory=parse_bytes(cfg.ray.object_store_memory), log_to_driver=True)
    return True


class RunningCluster:
    """A router, its servers and its pools inside one asyncio loop."""

    def __init__(self, cfg: ClusterConfig):
        self.cfg = cfg
        self.metrics = RouterMetrics()
        self.router = Router(cfg, self.metrics)
        self.server = RouterServer(self.router, cfg.router.host, cfg.router.port)
        self.metrics_server = None
        self.metrics_port: int | None = None
        self.http = None if cfg.router.http_port is None else OpenAIServer(self.router, cfg.router.host,
                                                                             cfg.router.http_port)
        self.http_port: int | None = None if self.http is None else self.http.port
        self._health: asyncio.Task | None = None

    async def start(self) -> None:
        await self.server.start()
        await self.server.set_serving(False)
        if self.http is not None:  # up while the pools start: /health says 503, requests get 503
            await self.http.start()
        await self.router.start()
        if self.cfg.router.metrics_port is not None:
            self.metrics_server = self.metrics.start_http_server(self.cfg.router.host, self.cfg.router.metrics_port)
            self.metrics_port = self.metrics_server.port
        await self.server.set_serving(self.router.serving)
        self._health = asyncio.get_running_loop().create_task(self.server.follow_health())

    async def stop(self) -> None:
        if self._health is not None:
            self._health.cancel()
        await self.server.set_serving(False)
        await self.router.stop(self.cfg.router.shutdown_grace_s)  # new HTTP requests get 503 meanwhile
        await self.server.stop(1.0)
        if self.http is not None:
            await self.http.stop()
        if self.metrics_server is not None:
            self.metrics_server.close()


async def _serve(cfg: ClusterConfig, on_ready, stop: asyncio.Event) -> None:
    cluster = RunningCluster(cfg)
    try:
        await cluster.start()
        on_ready(cluster)
        await stop.wait()
    finally:
        await cluster.stop()


def serve_forever(cfg: ClusterConfig, on_ready) -> None:
    """Run until SIGINT/SIGTERM; then drain within the grace period and stop what we started."""
    ensure_model(cfg)
    started_ray = init_ray(cfg)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await _serve(cfg, on_ready, stop)

    try:
        asyncio.run(main())
    finally:
        if started_ray:
            ray.shutdown()


class LocalCluster:
    """`with LocalCluster(cfg) as c: c.address` — a whole cluster on a background thread."""

    def __init__(self, cfg: ClusterConfig, start_timeout_s: float = 120.0):
        self.cfg = cfg
        self.timeout = start_timeout_s
        self.cluster: RunningCluster | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="pdserve-cluster", daemon=True)

    @property
    def address(self) -> str:
        return self.cluster.server.address

    @property
    def router(self) -> Router:
        return self.cluster.router

    @property
    def http_url(self) -> str | None:
        """The OpenAI-compatible API's base URL (`.../v1`), or None when router.http_port is off."""
        port = self.cluster.http_port
        return None if port is None else f"http://{self.cfg.router.host}:{port}/v1"

    def __enter__(self) -> LocalCluster:
        ensure_model(self.cfg)
        init_ray(self.cfg)
        self._thread.start()
        if not self._ready.wait(self.timeout):
            raise TimeoutError(f"the cluster did not start within {self.timeout} s")
        if self._error is not None:
            raise self._error
        return self

    def __exit__(self, *exc) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=60)

    def call(self, coro, timeout: float = 60.0):
        """Run a coroutine on the cluster's loop (for tests: router internals, status)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def _run(self) -> None:
        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            await _serve(self.cfg, self._on_ready, self._stop)

        try:
            asyncio.run(main())
        except BaseException as e:  # surfaced to __enter__ (start) or logged (stop)
            self._error = e
            log.exception("the cluster thread failed")
        finally:
            self._ready.set()

    def _on_ready(self, cluster: RunningCluster) -> None:
        self.cluster = cluster
        self._ready.set()


def arrangement_config(base: ClusterConfig, name: str, total_workers: int, pin_cpus: bool = False) -> ClusterConfig:
    """`base` rearranged as `name` with the same total worker count (equal cost); with
    `pin_cpus`, worker i of the arrangement gets core i to itself."""
    if name not in ARRANGEMENTS:
        raise ValueError(f"unknown arrangement {name!r}; choose from {', '.join(ARRANGEMENTS)}")
    disagg = name.startswith("disaggregated")
    if disagg and total_workers < 2:
        raise ValueError("a disaggregated arrangement needs at least 2 workers")
    chunk = (base.scheduler.chunk_size or 64) if name.endswith("chunked") else None
    prefill_n = max(1, total_workers // 2) if disagg else 0
    prefill_cpus = list(range(prefill_n)) if pin_cpus else base.prefill.cpus
    decode_cpus = list(range(prefill_n, total_workers)) if pin_cpus else base.decode.cpus
    return dataclasses.replace(
        base, mode="disaggregated" if disagg else "colocated",
        prefill=dataclasses.replace(base.prefill, replicas=prefill_n, cpus=prefill_cpus),
        decode=dataclasses.replace(base.decode, replicas=total_workers - prefill_n, cpus=decode_cpus),
        scheduler=dataclasses.replace(base.scheduler, chunk_size=chunk))
