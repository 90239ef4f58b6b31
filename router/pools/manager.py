"""The two worker pools as Ray actors: start, replace the dead, scale, drain.

Each pool has a target size and a placement (`resources`, `label_selector` in cluster.yaml):
Ray starts its workers only on nodes that offer those custom resources and match those labels.
`heal()` (called every few hundred ms) starts a replacement for each missing worker, with a
backoff that doubles after each failed start (max 30 s). A scale that Ray cannot place is
refused up front, naming the missing resource or label. Scaling down drains:
the chosen workers take nothing new; once nothing the router placed there is in flight (or
`drain_timeout_s` passed and `on_drain_timeout` moved the rest away) their channels close on
every peer and they stop. Every call to a worker has a deadline.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass

from kv_transfer import KVTransferConfig
from protocol import clock
from protocol.deadline import within
from protocol.messages import WorkerStats
from router.config.emulate import emulation, link_pace
from router.config.schema import ClusterConfig, PoolSection
from router.lifecycle.outcomes import CannotChangeRole
from router.lifecycle.worker_calls import CALL_FAILURES, short
from router.pools.actors import Actors, RayActors
from router.pools.placement import Placer
from router.pools.worker_view import WorkerState, WorkerView
from worker_host.host import WorkerHost
from worker_runtime import malloc, threads
from worker_runtime.faults import FaultConfig

log = logging.getLogger(__name__)
POOLS = ("prefill", "decode")
MAX_BACKOFF_S = 30.0


@dataclass
class PoolHealth:
    pool: str
    target: int
    ready: int = 0
    starting: int = 0
    restarts: int = 0  # replacements started after a worker died
    failures_in_a_row: int = 0  # failed starts since the last good one (sets the backoff)
    next_start_at: float = 0.0
    last_failure: str = ""
    last_failure_at: float | None = None
    start_s: float | None = None  # how long the last worker start took (the autoscaler weighs a role change by it)

    @property
    def last_failure_age_s(self) -> float:
        return 0.0 if self.last_failure_at is None else clock.now() - self.last_failure_at


class PoolManager:
    def __init__(self, config: ClusterConfig, actors: Actors | None = None):
        self.config = config
        self.actors = actors or RayActors()  # how a worker is started and killed (simulate: in-process)
        kt = config.kv_transfer
        self.emulation = emulation(config.emulate)  # None: off
        self.transfer = KVTransferConfig(backend=kt.backend, timeout_s=kt.timeout_s, checksum=kt.checksum,
                                         interface=kt.interface, stream_chunks=kt.stream_chunks,
                                         pace=link_pace(self.emulation, config.kv_cache.block_size))
        self.faults = config.faults.with_env()
        self.workers: dict[str, list[WorkerView]] = {"prefill": [], "decode": []}
        prefill_n = config.prefill.replicas if config.mode == "disaggregated" else 0
        self.health = {"prefill": PoolHealth("prefill", prefill_n), "decode": PoolHealth("decode", config.decode.replicas)}
        self._ids = itertools.count()
        # one per pool: a pool's start (a weights load) never holds up the other pool's scale
        self._scale_locks = {pool: asyncio.Lock() for pool in POOLS}
        self._dead_pending: dict[str, int] = {"prefill": 0, "decode": 0}  # deaths not yet replaced
        self.placer = Placer({pool: config.router.policy_for(pool) for pool in ("prefill", "decode")})
        self.on_started = None  # callback(view): the router starts polling it
        self.on_drain_timeout = None  # callback(view): the router moves its requests away

    @property
    def targets(self) -> dict[str, int]:
        return {pool: h.target for pool, h in self.health.items()}

    def section(self, pool: str) -> PoolSection:
        return self.config.prefill if pool == "prefill" else self.config.decode

    def ready(self, pool: str) -> list[WorkerView]:
        return [w for w in self.workers[pool] if w.accepting]

    def live(self, pool: str) -> list[WorkerView]:
        return [w for w in self.workers[pool] if not w.stopped]

    def all(self) -> list[WorkerView]:
        return self.workers["prefill"] + self.workers["decode"]

    def status(self) -> list[PoolHealth]:
        for pool, h in self.health.items():
            h.ready = sum(w.state is WorkerState.READY for w in self.workers[pool])
        return [self.health[p] for p in POOLS if self.health[p].target or self.workers[p]]

    # ---- starting ---------------------------------------------------------------------
    async def start(self) -> None:
        await asyncio.gather(*(self._start_one(pool) for pool, h in self.health.items() for _ in range(h.target)))

    async def _start_one(self, pool: str) -> WorkerView:
        sec, health = self.section(pool), self.health[pool]
        name = f"{pool}-{next(self._ids)}"
        transfer = self.transfer if self.config.mode == "disaggregated" else None
        health.starting += 1
        began = clock.now()
        try:
            cpu = self._next_cpu(pool)
            engine = self.config.engine_config(sec, device=self.config.device_of(sec))
            env = malloc.worker_env(sec.malloc, on_gpu=sec.num_gpus > 0) | threads.wait_env(
                engine.torch_threads, sec.num_cpus, colocated=transfer is None, pinned=cpu is not None)
            actor = self.actors.start(WorkerHost, sec, env, (pool, name, engine, transfer, cpu, self.faults,
                                                             self.emulation))
            try:
                info = await within(actor.ready.remote(), self.config.router.worker_start_timeout_s)
            except BaseException:
                self.actors.kill(actor)
                raise
        finally:
            health.starting -= 1
        view = WorkerView(info, actor, free_blocks=info.num_blocks)
        self.workers[pool].append(view)
        health.failures_in_a_row, health.start_s = 0, clock.now() - began
        if self.on_started is not None:
            self.on_started(view)
        log.info("started %s on %s (%d KV blocks, CPU kernels: %s)", name, info.node_ip, info.num_blocks, info.kernels)
        if info.kernels == "torch":
            log.warning("%s runs without pdserve's CPU kernels, on torch's slower paths; its start-up line says why",
                        name)
        return view

    def _next_cpu(self, pool: str) -> int | None:
        cpus = self.section(pool).cpus
        if not cpus:
            return None
        taken = {w.info.cpu for w in self.workers[pool] if not w.stopped}
        free = [c for c in cpus if c not in taken]
        return (free or cpus)[0]

    async def set_faults(self, faults: FaultConfig) -> None:
        """Fault injection at run time, for tests: every ready or draining worker takes `faults`
        now, every worker started later at its start (one starting meanwhile keeps the old ones)."""
        self.faults = faults
        live = [w for pool in POOLS for w in self.live(pool)]
        await asyncio.gather(*(within(w.actor.set_faults.remote(faults), self.config.router.call_timeout_s)
                               for w in live))

    # ---- failures and healing ---------------------------------------------------------------
    def worker_failed(self, w: WorkerView, reason: str) -> bool:
        """Take a dead or hung worker out (its process is killed); False if it already was."""
        if not w.stop():
            return False
        log.error("%s failed: %s", w.name, reason)
        self.placer.forget(w)
        if w in self.workers[w.info.pool]:
            self.workers[w.info.pool].remove(w)
        health = self.health[w.info.pool]
        health.last_failure, health.last_failure_at = f"{w.name}: {reason}", clock.now()
        self._dead_pending[w.info.pool] += 1
        self.actors.kill(w.actor)
        return True

    async def heal(self) -> None:
        """Start one replacement per missing worker whose backoff has passed (not in a pool a scale
        or role change is changing: it looks again next time)."""
        for pool, health in self.health.items():
            if self._scale_locks[pool].locked():
                continue
            missing = health.target - len(self.live(pool)) - health.starting
            if missing > 0 and clock.now() >= health.next_start_at:
                await asyncio.gather(*(self._replace(pool) for _ in range(missing)), return_exceptions=True)

    async def _replace(self, pool: str) -> None:
        health = self.health[pool]
        if self._dead_pending[pool] > 0:
            self._dead_pending[pool] -= 1
            health.restarts += 1
        try:
            await self._start_one(pool)
        except Exception as e:  # noqa: BLE001 - any start failure backs off, is shown in status, retried
            health.failures_in_a_row += 1
            delay = min(MAX_BACKOFF_S, self.config.router.restart_backoff_s * 2 ** (health.failures_in_a_row - 1))
            health.next_start_at = clock.now() + delay
            health.last_failure, health.last_failure_at = f"starting a {pool} worker: {short(e)}", clock.now()
            log.error("could not start a %s worker (retry in %.1f s): %s", pool, delay, short(e))

    # ---- scaling ----------------------------------------------------------------------
    async def scale(self, pool: str, replicas: int) -> tuple[list[str], list[str]]:
        """Grow or drain `pool` to `replicas`; returns (started, stopped) worker names. Under the
        pool's own lock: the other pool scales meanwhile."""
        async with self._scale_locks[pool]:
            current = self.live(pool)
            if replicas > len(current):
                self._check_placeable(pool, replicas - len(current))
                self.health[pool].target = replicas
                views = await asyncio.gather(*(self._start_one(pool) for _ in range(replicas - len(current))))
                return [v.name for v in views], []
            self.health[pool].target = replicas
            victims = scale_down_victims(current, len(current) - replicas, clock.now(),
                                         self.config.router.autoscale.warmup_s)
            for w in victims:
                w.drain()
            await asyncio.gather(*(self._drain_and_stop(w) for w in victims))
            return [], [w.name for w in victims]

    def _check_placeable(self, pool: str, count: int) -> None:
        self.actors.check_placeable(pool, self.section(pool), count)

    async def _drain_and_stop(self, w: WorkerView) -> None:
        await self._drain(w)
        await self.stop_worker(w)

    async def _drain(self, w: WorkerView) -> None:
        """Until nothing the router placed on `w` (draining) is in flight there; after
        `drain_timeout_s` what is left is moved away, and after one more call deadline it gives up."""
        deadline = clock.now() + self.config.router.drain_timeout_s
        timed_out = False
        while not await self._drained(w):
            if clock.now() > deadline and not timed_out:
                timed_out = True
                log.warning("%s: drain timed out with %d requests in flight; moving them", w.name, len(w.inflight))
                if self.on_drain_timeout is not None:
                    self.on_drain_timeout(w)
                deadline = clock.now() + self.config.router.call_timeout_s
            elif clock.now() > deadline:
                break  # they could not all be moved in time: stopping fails them over anyway
            await asyncio.sleep(0.05)

    async def _drained(self, w: WorkerView) -> bool:
        if w.inflight or w.stopped:
            return w.stopped
        try:
            stats = await self.fetch_stats(w)
        except CALL_FAILURES:
            return True  # nothing of ours is in flight and it cannot answer: stop it
        return stats.running == 0 and stats.waiting == 0 and stats.blocks_used == 0

    async def fetch_stats(self, w: WorkerView) -> WorkerStats:
        """`w`'s stats, observed (its cache delta applied to the prefix index); raises what the call
        raised (CALL_FAILURES). One call per worker at a time, so deltas arrive in their order: a
        caller waits for the one before, which has its own deadline, then makes its own call."""
        async with w.stats_turn:
            stats = await within(w.actor.stats.remote(w.cache_resync), self.config.router.call_timeout_s)
            self.placer.observe(w, stats)
        return stats

    async def _close_peer_channels(self, w: WorkerView) -> None:
        """Every worker of the other pool closes its channel with `w` (failures: it holds none)."""
        timeout = self.config.router.call_timeout_s
        peers = self.workers["decode" if w.info.pool == "prefill" else "prefill"]
        await asyncio.gather(*(within(p.actor.close_channel.remote(w.name), timeout)
                               for p in peers if not p.stopped), return_exceptions=True)

    async def stop_worker(self, w: WorkerView) -> None:
        timeout = self.config.router.call_timeout_s
        await self._close_peer_channels(w)
        try:
            await within(w.actor.shutdown.remote(), timeout)
        except CALL_FAILURES as e:
            log.warning("%s did not shut down cleanly: %s", w.name, short(e))
        w.stop()  # before the kill, so its poll loop ends quietly
        self.placer.forget(w)
        self.actors.kill(w.actor)
        if w in self.workers[w.info.pool]:
            self.workers[w.info.pool].remove(w)
        log.info("stopped %s", w.name)

    async def stop_all(self) -> None:
        for h in self.health.values():
            h.target = 0
        for w in list(self.all()):
            w.drain()
        await asyncio.gather(*(self.stop_worker(w) for w in list(self.all())), return_exceptions=True)

    # ---- role change ----------------------------------------------------------------------
    async def change_role(self, w: WorkerView, to_pool: str) -> WorkerView:
        """`w`'s process serves `to_pool` from now on, its weights kept loaded (worker_host/host.py):
        drained first (nothing lost: what it holds finishes, or moves after drain_timeout_s), its
        peers' channels closed, then the actor resets its KV ledger and takes the new role under a
        new name. The pools' targets move with it. CannotChangeRole when it may not; a worker
        whose change fails is taken out as failed (its old pool starts a replacement). Under both
        pools' locks, taken in POOLS order (a scale takes one: no two wait for each other)."""
        async with self._scale_locks[POOLS[0]], self._scale_locks[POOLS[1]]:
            self._check_role_change(w, to_pool)
            began, old = clock.now(), w.info.pool
            w.drain()
            await self._drain(w)
            await self._close_peer_channels(w)
            name = f"{to_pool}-{next(self._ids)}"
            self._retire(w)  # out of its pool before the change: its poll and beat loops end
            try:
                info = await within(w.actor.change_role.remote(to_pool, name, self.faults),
                                    self.config.router.worker_start_timeout_s)
            except Exception as e:  # its state is unknown: killed, and its old pool heals
                self._role_change_failed(w, to_pool, e)
                raise
            self.health[old].target -= 1
            self.health[to_pool].target += 1
            view = WorkerView(info, w.actor, free_blocks=info.num_blocks)
            self.workers[to_pool].append(view)
            if self.on_started is not None:
                self.on_started(view)
            log.info("%s is now %s (role change in %.2f s, weights kept)", w.name, name, clock.now() - began)
            return view

    def _check_role_change(self, w: WorkerView, to_pool: str) -> None:
        old = w.info.pool
        problem = (
            "colocated mode has one pool" if self.config.mode != "disaggregated" else
            f"unknown pool {to_pool!r}" if to_pool not in POOLS else
            f"{w.name} is a {to_pool} worker already" if old == to_pool else
            f"{w.name} is not a ready worker of the {old} pool" if w not in self.ready(old) else
            f"{w.name} is the last ready {old} worker" if len(self.ready(old)) < 2 else
            self._unlike_pools())
        if problem:
            raise CannotChangeRole(f"cannot change the role of {w.name}: {problem}")

    def _unlike_pools(self) -> str:
        """Why a worker of one pool cannot be one of the other (its process keeps its Ray
        resources, cores and KV pool), or ''."""
        p, d = self.config.prefill, self.config.decode
        for key in ("num_cpus", "num_gpus", "resources", "label_selector", "num_blocks"):
            if getattr(p, key) != getattr(d, key):
                return f"the pools differ in {key} (prefill {getattr(p, key)!r}, decode {getattr(d, key)!r})"
        return "the pools pin workers to cores (cpus)" if p.cpus or d.cpus else ""

    def _role_change_failed(self, w: WorkerView, to_pool: str, error: Exception) -> None:
        health = self.health[w.info.pool]
        health.last_failure, health.last_failure_at = f"{w.name}: role change to {to_pool}: {short(error)}", clock.now()
        self._dead_pending[w.info.pool] += 1
        log.error("%s failed to change its role to %s: %s", w.name, to_pool, short(error))
        self.actors.kill(w.actor)

    def _retire(self, w: WorkerView) -> None:
        """`w`'s view leaves its pool (its process lives on under another view)."""
        w.stop()
        self.placer.forget(w)
        if w in self.workers[w.info.pool]:
            self.workers[w.info.pool].remove(w)


def scale_down_victims(workers: list[WorkerView], count: int, now: float, warmup_s: float) -> list[WorkerView]:
    """The `count` workers a scale-down drains: those still warming up first (ready less than
    `warmup_s` ago: not yet capacity to the planner, router/autoscale/sizing.py `warm`; draining
    the warm ones while others warm left a pool the planner saw as empty, and it grew again), then
    the fewest requests in flight (the quickest to drain), then the newest."""
    def order(w: WorkerView) -> tuple[bool, int, int]:
        return now - w.ready_at >= warmup_s, len(w.inflight), -int(w.name.split("-")[1])
    return sorted(workers, key=order)[:count]
