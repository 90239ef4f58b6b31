"""The two worker pools as Ray actors: start, stop, and scale with draining.

Scaling down drains: the chosen workers are marked `draining` (placement skips them), the
pool waits until nothing the router placed there is in flight and the worker reports no
running or waiting request, then closes its KV channels on every peer and stops it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging

import ray

from decode_worker.worker import DecodeWorker
from kv_transfer import KVTransferConfig
from prefill_worker.worker import PrefillWorker
from router.config import ClusterConfig, PoolSection
from router.placement import WorkerView

log = logging.getLogger(__name__)
POOLS = ("prefill", "decode")


class PoolManager:
    def __init__(self, config: ClusterConfig):
        self.config = config
        kt = config.kv_transfer
        self.transfer = KVTransferConfig(backend=kt.backend, timeout_s=kt.timeout_s, checksum=kt.checksum)
        self.workers: dict[str, list[WorkerView]] = {"prefill": [], "decode": []}
        self._ids = itertools.count()
        self._scale_lock = asyncio.Lock()
        self.on_started = None  # callback(view) the router sets to start polling a decode worker

    def section(self, pool: str) -> PoolSection:
        return self.config.prefill if pool == "prefill" else self.config.decode

    def ready(self, pool: str) -> list[WorkerView]:
        return [w for w in self.workers[pool] if w.accepting]

    def all(self) -> list[WorkerView]:
        return self.workers["prefill"] + self.workers["decode"]

    async def start(self) -> None:
        wanted = {"decode": self.config.decode.replicas}
        if self.config.mode == "disaggregated":
            wanted["prefill"] = self.config.prefill.replicas
        await asyncio.gather(*(self._start_one(pool) for pool, n in wanted.items() for _ in range(n)))

    async def _start_one(self, pool: str) -> WorkerView:
        sec = self.section(pool)
        name = f"{pool}-{next(self._ids)}"
        cls = PrefillWorker if pool == "prefill" else DecodeWorker
        transfer = self.transfer if self.config.mode == "disaggregated" else None
        actor = ray.remote(cls).options(
            name=None, num_cpus=sec.num_cpus, num_gpus=sec.num_gpus, resources=dict(sec.resources) or None,
            max_concurrency=1000,
        ).remote(name, self.config.engine_config(sec, device="cuda" if sec.num_gpus else "cpu"), transfer,
                 self._next_cpu(pool))
        info = await actor.ready.remote()
        view = WorkerView(info, actor, free_blocks=info.num_blocks)
        self.workers[pool].append(view)
        if self.on_started is not None:
            self.on_started(view)
        log.info("started %s on %s (%d KV blocks)", name, info.node_ip, info.num_blocks)
        return view

    def _next_cpu(self, pool: str) -> int | None:
        cpus = self.section(pool).cpus
        if not cpus:
            return None
        taken = {w.info.cpu for w in self.workers[pool] if w.state != "stopped"}
        free = [c for c in cpus if c not in taken]
        return (free or cpus)[0]

    async def scale(self, pool: str, replicas: int) -> tuple[list[str], list[str]]:
        """Grow or drain `pool` to `replicas`; returns (started, stopped) worker names."""
        async with self._scale_lock:
            current = [w for w in self.workers[pool] if w.state != "stopped"]
            if replicas > len(current):
                views = await asyncio.gather(*(self._start_one(pool) for _ in range(replicas - len(current))))
                return [v.name for v in views], []
            victims = sorted(current, key=lambda w: (len(w.inflight), -int(w.name.split("-")[1])))
            victims = victims[:len(current) - replicas]
            for w in victims:
                w.state = "draining"
            await asyncio.gather(*(self._drain_and_stop(w) for w in victims))
            return [], [w.name for w in victims]

    async def _drain_and_stop(self, w: WorkerView) -> None:
        while True:
            stats = await w.actor.stats.remote()
            w.observe(stats)
            if not w.inflight and stats.running == 0 and stats.waiting == 0 and stats.blocks_used == 0:
                break
            await asyncio.sleep(0.05)
        await self.stop_worker(w)

    async def stop_worker(self, w: WorkerView) -> None:
        peers = self.workers["decode" if w.info.pool == "prefill" else "prefill"]
        await asyncio.gather(*(p.actor.close_channel.remote(w.name) for p in peers if p.state != "stopped"),
                             return_exceptions=True)
        try:
            await asyncio.wait_for(w.actor.shutdown.remote(), timeout=10)
        except (TimeoutError, ray.exceptions.RayError) as e:
            log.warning("%s did not shut down cleanly: %s", w.name, e)
        w.state = "stopped"  # before the kill, so its poll loop ends quietly
        ray.kill(w.actor)
        if w in self.workers[w.info.pool]:
            self.workers[w.info.pool].remove(w)
        log.info("stopped %s", w.name)

    async def stop_all(self) -> None:
        for w in list(self.all()):
            w.state = "draining"
        await asyncio.gather(*(self.stop_worker(w) for w in list(self.all())), return_exceptions=True)
