"""What a prefill and a decode worker share: an engine on its loop thread, asyncio bridging, stats.

Worker actors are Ray async actors; their methods run on the actor's event loop and reach
the engine only through `run(fn)`, which executes `fn(engine)` on the loop thread. No Ray in
here: the actor passes its node's address in. `WorkerCalls` is the part of each actor's Ray
interface both answer alike (ready, poll, stats, telemetry, emulation, check), written once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from protocol.messages import CacheDelta, EngineBeat, WorkerInfo, WorkerStats
from protocol.outputs import RequestOutput
from protocol.telemetry import EmulationStats, StepRecord
from sizing.cost_model import Emulation
from worker_runtime import malloc
from worker_runtime.engine_loop import EngineLoop
from worker_runtime.faults import Faults
from worker_runtime.outbox import Outbox
from worker_runtime.pacing import Pacer
from worker_runtime.threads import auto_threads, waits_described

log = logging.getLogger(__name__)


class WorkerCore:
    def __init__(self, name: str, pool: str, config: EngineConfig,
                 on_outputs: Callable[[list[RequestOutput]], None], cpu: int | None = None,
                 faults: Faults | None = None, node_ip: str = "127.0.0.1",
                 after_step: Callable[[LLMEngine], None] | None = None, emulation: Emulation | None = None,
                 cpu_share: float = 1.0, colocated: bool = False):
        began = time.perf_counter()
        if cpu is not None:
            os.sched_setaffinity(0, {cpu})  # before torch starts its thread pool
        # None = `torch_threads: auto` (worker_runtime/threads.py), resolved here; LLMEngine sets it
        threads = config.torch_threads or auto_threads(cpu_share, pinned=cpu is not None, colocated=colocated)
        config = dataclasses.replace(config, torch_threads=threads)
        self.name = name
        self.cpu = cpu
        self.pool = pool
        self.node_ip = node_ip  # where peers reach this worker's channels
        self.pacer = Pacer(emulation) if emulation is not None else None  # worker_runtime/pacing.py
        hook = (lambda: faults.before_step(self.engine)) if faults is not None else None  # a no-op with faults off

        def make_engine() -> LLMEngine:  # on the loop's thread, which runs every torch op of the engine
            engine = LLMEngine(config)
            if faults is not None:
                engine.before_forward = faults.before_forward
            log.info("%s: %s, malloc %s, %d torch threads (OpenMP waits: %s)", name, engine.runner.describe(),
                     malloc.in_use(), torch.get_num_threads(), waits_described())
            return engine
        self.loop = EngineLoop(make_engine, on_outputs, name=name, before_step=hook, after_step=after_step,
                               pace=self.pacer.pace if self.pacer is not None else None)
        self.engine = self.loop.engine
        if self.pacer is not None:
            self.pacer.wait_startup(began)
        self.served = 0
        self.cache_seq = 0  # of the last CacheDelta sent
        self.aio: asyncio.AbstractEventLoop | None = None

    def take_role(self, name: str, pool: str, on_outputs: Callable[[list[RequestOutput]], None],
                  faults: Faults | None = None, after_step: Callable[[LLMEngine], None] | None = None) -> None:
        """This process's engine, idle and reset (`LLMEngine.reset_cache`), serves another role's
        actor as `name` in `pool` (worker_host/): its callbacks replace the last role's."""
        self.name, self.pool, self.served, self.cache_seq = name, pool, 0, 0
        hook = (lambda: faults.before_step(self.engine)) if faults is not None else None
        self.loop.set_hooks(name, on_outputs, hook, after_step)

    def bind(self) -> None:
        """Remember the actor's event loop (call from any async method before threads use it)."""
        if self.aio is None:
            self.aio = asyncio.get_running_loop()

    async def run(self, fn: Callable[[LLMEngine], Any]) -> Any:
        return await asyncio.wrap_future(self.loop.call(fn))

    def info(self) -> WorkerInfo:
        e = self.engine
        return WorkerInfo(self.name, self.pool, self.node_ip, e.allocator.num_blocks, e.config.block_size, self.cpu,
                          prefix_caching=e.allocator.enable_caching, block_bytes=e.runner.block_bytes,
                          kernels=e.runner.kernel_isa)

    async def stats(self, channels: int, resync: bool = False) -> WorkerStats:
        """Counts, and the prefix cache events since the previous call: one consumer should call
        this, as each call drains them; `resync` sends a snapshot of every cached hash instead."""
        def read(e: LLMEngine) -> WorkerStats:
            a, p = e.allocator, e.prefix_stats
            return WorkerStats(self.name, e.num_running, e.num_waiting, a.num_used, a.num_free, a.num_blocks,
                               channels, self.served, a.num_cached, p.query_tokens, p.hit_tokens, self._delta(e, resync),
                               blocks_owed=e.scheduler.blocks_owed())
        return await self.run(read)

    def _delta(self, e: LLMEngine, resync: bool) -> CacheDelta | None:
        if not e.allocator.enable_caching:
            return None
        stored, removed = e.allocator.drain_events()
        self.cache_seq += 1
        if resync:
            return CacheDelta(self.cache_seq, tuple(e.allocator.cached_hashes()), (), snapshot=True)
        return CacheDelta(self.cache_seq, tuple(stored), tuple(removed))

    async def telemetry(self, since: int = 0) -> list[StepRecord]:
        """The engine's step records numbered after `since` (engine/telemetry.py)."""
        return await self.run(lambda e: e.telemetry.since(since))

    async def emulation(self) -> EmulationStats | None:
        """The pacing counters of an emulated device; None when emulation is off."""
        if self.pacer is None:
            return None
        return await self.run(lambda e: self.pacer.stats())

    async def check(self) -> dict:
        """Integrity of the KV pool; returns the block counts for the caller to compare."""
        def read(e: LLMEngine) -> dict:
            e.check()
            return {"used": e.allocator.num_used, "free": e.allocator.num_free, "total": e.allocator.num_blocks,
                    "requests": len(e.requests), "reserved": len(e.reserved)}
        return await self.run(read)

    def stop(self) -> None:
        self.loop.stop()


class WorkerCalls:
    """The actor calls both workers answer alike. An actor sets `core` and `outbox` (what its
    router poll returns: a decode worker's outputs, a prefill worker's failed sends) and says
    how many KV channels it holds."""

    core: WorkerCore
    outbox: Outbox

    def _num_channels(self) -> int:
        raise NotImplementedError

    async def ready(self) -> WorkerInfo:
        self.core.bind()
        self.outbox.bind()
        return self.core.info()

    async def poll(self, timeout_s: float = 1.0) -> list:
        """Everything the outbox got since the last poll; waits up to `timeout_s` for at least one."""
        return await self.outbox.poll(timeout_s)

    async def stats(self, resync: bool = False) -> WorkerStats:
        """Load, block counts and the prefix-cache changes since the last call (all of it if `resync`)."""
        return await self.core.stats(self._num_channels(), resync)

    async def telemetry(self, since: int = 0) -> list[StepRecord]:
        """Per-step records after `since`, for `pdserve bench`'s bottleneck report."""
        return await self.core.telemetry(since)

    async def emulation(self) -> EmulationStats | None:
        """How faithfully this worker kept its emulated device's timings (None: not emulating)."""
        return await self.core.emulation()

    async def check(self) -> dict:
        return await self.core.check()

    async def beat(self) -> EngineBeat:
        """The engine thread's last sign of life, answered without waiting for it."""
        return self.core.loop.beat()
