"""Bring a cluster up and down: Ray (start a local head or join), the pools, the gRPC server,
the OpenAI-compatible HTTP server (`router.http_port`) on the same loop.

`serve_forever(cfg)` is `pdserve serve` (foreground, stops on SIGINT/SIGTERM). `LocalCluster`
runs the same thing on a background thread for tests and `pdserve bench`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import threading
from concurrent.futures import Future
from pathlib import Path

import ray

from engine.forward.features import UnsupportedModel
from engine.model_runner import probe_checkpoint
from protocol.sizes import parse_bytes
from router import leftovers
from router.config.schema import ClusterConfig
from router.config.typed_yaml import ConfigError
from router.frontdoor.grpc_server import RouterServer
from router.frontdoor.guards import Refusals
from router.frontdoor.openai_server import OpenAIServer
from router.frontdoor.tls import open_gate, server_ssl_context
from router.lifecycle.service import Router
from router.observability.metrics import RouterMetrics
from router.observability.metrics_server import start_metrics_server
from router.pools.actors import Actors

log = logging.getLogger(__name__)
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def ensure_model(cfg: ClusterConfig) -> None:
    if cfg.model.create_tiny != "off" and not (Path(cfg.model.path) / "config.json").exists():
        from checkpoints.tiny import ensure_model as make

        log.info("creating the embedded tiny %s model at %s", cfg.model.create_tiny, cfg.model.path)
        make(cfg.model.path, arch=cfg.model.create_tiny, size="tiny")
    if not (Path(cfg.model.path) / "config.json").exists():
        raise FileNotFoundError(f"model.path {cfg.model.path} has no config.json")
    try:  # from config.json on the meta device: refused here, before any worker loads weights
        probe_checkpoint(cfg.model.path)
    except UnsupportedModel as e:
        raise ConfigError(f"model.path: {cfg.model.path}: {e}") from None


def init_ray(cfg: ClusterConfig) -> bool:
    """Connect to Ray as the config says; True if this process started a local head."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if ray.is_initialized():
        return False
    if cfg.ray.address:
        _check_answers(cfg.ray.address)
        try:
            ray.init(address=cfg.ray.address, log_to_driver=True)
        except (ConnectionError, RuntimeError) as e:  # Ray retries for a while before this
            reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            raise ConfigError(f"ray.address: cannot join the Ray cluster at {cfg.ray.address}: {reason} (is "
                              "`ray start` running on this machine? a cluster with token authentication also "
                              "needs RAY_AUTH_MODE=token and its token here; see docs/deploy.md)") from None
        for node in ray.nodes():  # which node can take which pool: the operator's first question
            if node["Alive"]:
                log.info("Ray node %s: %s, labels %s", node["NodeManagerAddress"], node["Resources"],
                         node.get("Labels") or {})
        return False
    needed = cfg.prefill.replicas * cfg.prefill.num_cpus + cfg.decode.replicas * cfg.decode.num_cpus
    num_cpus = cfg.ray.num_cpus or max(os.cpu_count() or 1, int(needed) + 4)
    start_head(dict(num_cpus=num_cpus, include_dashboard=False,
                    object_store_memory=parse_bytes(cfg.ray.object_store_memory), log_to_driver=True))
    return True


def start_head(options: dict, init=ray.init, shutdown=ray.shutdown) -> None:
    """`init(**options)`, once more if Ray's raylet missed its fixed 30 s to register (a loaded
    host), after ending what the failed start left; any other failure is raised as it was."""
    before = leftovers.below(os.getpid())
    try:
        init(**options)
    except Exception as e:  # Ray raises a bare Exception for this one
        if "timed out during startup" not in str(e):
            raise
        log.warning("the local Ray head did not start in time (%s); ending what it started and starting "
                    "it once more", e)
        shutdown()
        leftovers.end(leftovers.below(os.getpid()) - before)
        init(**options)


def _check_answers(address: str) -> None:
    """A head address nothing answers at fails here in seconds, not after Ray's minutes of retries."""
    host, _, port = address.rpartition(":")
    if not host or "://" in host or not port.isdigit():
        return  # "auto", ray://...: Ray resolves those itself
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=5).close()
    except OSError as e:
        raise ConfigError(f"ray.address: nothing answers at {address} ({e.strerror or e}); is the Ray head "
                          "running there (`ray start --head`, see docs/deploy.md)?") from None


class RunningCluster:
    """A router, its servers and its pools inside one asyncio loop."""

    def __init__(self, cfg: ClusterConfig, insecure: bool = False, actors: Actors | None = None):
        self.cfg = cfg
        self.gate, self.refusals = open_gate(cfg, insecure), Refusals()  # refuses an open listener first
        self.metrics = RouterMetrics()
        self.router = Router(cfg, self.metrics, actors)
        r = cfg.router
        self.server = RouterServer(self.router, r.host, r.port, self.gate, r.tls, self.refusals)
        self.metrics_server = None
        self.metrics_port: int | None = None
        self.http = None if r.http_port is None else OpenAIServer(self.router, r.host, r.http_port, self.gate,
                                                                   r.tls, self.refusals)
        self.http_port: int | None = None if self.http is None else self.http.port
        self._health: asyncio.Task | None = None

    async def start(self) -> None:
        await self.server.start()
        await self.server.set_serving(False)
        if self.http is not None:  # up while the pools start: /health says 503, requests get 503
            await self.http.start()
        await self.router.start()
        r = self.cfg.router
        if r.metrics_port is not None:  # the same TLS and gate as the other ports
            self.metrics_server = start_metrics_server(self.metrics.registry, r.host, r.metrics_port, self.gate,
                                                       self.refusals, server_ssl_context(r.tls) if r.tls.enabled else None)
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

    def reload_tokens(self) -> bool:
        """Re-read router.auth's token files (SIGHUP); False when they were kept as they were."""
        return self.gate.reload()


async def _serve(cfg: ClusterConfig, on_ready, stop: asyncio.Event, insecure: bool = False,
                 actors: Actors | None = None) -> None:
    """Start, serve until `stop`, stop. A stop while the pools still start ends the start: each
    worker not ready yet is killed (router/pools/manager.py), the ready ones stop as at any stop."""
    cluster = RunningCluster(cfg, insecure, actors)
    try:
        if await _until_stopped(cluster.start(), stop):
            log.info("stopped while starting")
            return
        on_ready(cluster)
        await stop.wait()
    finally:
        await cluster.stop()


async def _until_stopped(start, stop: asyncio.Event) -> bool:
    """Run `start` unless `stop` comes first (then cancel it); True if stopped first."""
    starting = asyncio.ensure_future(start)
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if starting.done():
        stopping.cancel()
        starting.result()  # its error, if it failed
        return False
    starting.cancel()
    await asyncio.gather(starting, return_exceptions=True)  # the workers it started are killed by then
    return True


class Interrupted(KeyboardInterrupt):
    """SIGTERM or SIGINT before the router's loop runs."""


def _interrupt(signum: int, frame) -> None:
    raise Interrupted(f"stopped by {signal.Signals(signum).name} while starting")


def serve_forever(cfg: ClusterConfig, on_ready, insecure: bool = False) -> None:
    """Run until SIGINT/SIGTERM; then drain within the grace period and stop what we started.
    SIGHUP re-reads the token files. `insecure`: serve beyond loopback without authentication.
    A signal during start-up stops it too: while Ray starts it is honoured once Ray is up
    (`_RayOwner`), on the loop it cancels the pools' start (workers not ready yet are killed)."""
    local_head = not ray.is_initialized() and not cfg.ray.address
    previous = {sig: signal.signal(sig, _interrupt) for sig in STOP_SIGNALS}
    owner: _RayOwner | None = None
    try:
        ensure_model(cfg)
        owner = _RayOwner(cfg)
        if owner.started():
            asyncio.run(_main(cfg, on_ready, insecure))
    except Interrupted as e:
        log.info("%s", e)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if local_head:  # every process of the head: Ray's shutdown ends most, `leftovers` the rest
            leftovers.adopt_orphans()
            ray.shutdown(wait_for_processes=True)
            if (left := leftovers.end(leftovers.below(os.getpid()))):
                log.info("ended %d processes Ray's shutdown left running (its agents)", left)
        if owner is not None:
            owner.close()


class _RayOwner:
    """`init_ray` on a thread of its own, which lives until `close()`. On the main thread ray.init
    sets a SIGTERM handler of its own (sys.exit), and a head interrupted half started leaves
    Ray's agents running; so a signal is only noted while Ray starts, and honoured once it is up.
    The thread must outlive Ray: the head's processes die with the thread that started them."""

    def __init__(self, cfg: ClusterConfig):
        self._up: Future = Future()
        self._release = threading.Event()
        threading.Thread(target=self._run, args=(cfg,), name="ray-owner", daemon=True).start()

    def _run(self, cfg: ClusterConfig) -> None:
        quiet = _Without("SIGTERM handler is not set")  # that one is ours, set on the main thread
        logging.getLogger("ray._private.worker").addFilter(quiet)
        try:
            init_ray(cfg)
        except BaseException as e:  # handed to the main thread (`started`)
            self._up.set_exception(e)
            return
        finally:
            logging.getLogger("ray._private.worker").removeFilter(quiet)
        self._up.set_result(None)
        self._release.wait()

    def started(self) -> bool:
        """Wait until Ray is up (raises its start's error); False if a signal came meanwhile."""
        stopped: list[str] = []
        for sig in STOP_SIGNALS:
            signal.signal(sig, lambda signum, frame: stopped.append(signal.Signals(signum).name))
        try:
            self._up.result()
        finally:
            for sig in STOP_SIGNALS:
                signal.signal(sig, _interrupt)
        if stopped:
            log.info("stopped by %s while starting", stopped[0])
        return not stopped

    def close(self) -> None:
        self._release.set()


class _Without(logging.Filter):
    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


async def _main(cfg: ClusterConfig, on_ready, insecure: bool) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    def ready(cluster: RunningCluster) -> None:
        loop.add_signal_handler(signal.SIGHUP, cluster.reload_tokens)
        on_ready(cluster)

    await _serve(cfg, ready, stop, insecure)


class LocalCluster:
    """`with LocalCluster(cfg) as c: c.address` — a whole cluster on a background thread.
    `actors`: how the pool manager starts and kills workers (default Ray's; `pdserve bench
    --autoscale` records each worker's life through it)."""

    def __init__(self, cfg: ClusterConfig, start_timeout_s: float = 120.0, insecure: bool = False,
                 actors: Actors | None = None):
        self.cfg = cfg
        self.insecure = insecure
        self.actors = actors
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
        port, scheme = self.cluster.http_port, "https" if self.cfg.router.tls.enabled else "http"
        return None if port is None else f"{scheme}://{self.cfg.router.host}:{port}/v1"

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

    def reload_tokens(self) -> bool:
        """What SIGHUP does to `pdserve serve`: re-read the token files."""
        return self.cluster.reload_tokens()

    def call(self, coro, timeout: float = 60.0):
        """Run a coroutine on the cluster's loop (for tests: router internals, status)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def _run(self) -> None:
        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            await _serve(self.cfg, self._on_ready, self._stop, self.insecure, self.actors)

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


