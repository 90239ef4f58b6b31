"""What a prefill and a decode worker share: an engine on its loop thread, asyncio bridging, stats.

Worker actors are Ray async actors; their methods run on the actor's event loop and reach
the engine only through `run(fn)`, which executes `fn(engine)` on the loop thread. No Ray in
here: the actor passes its node's address in.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from typing import Any

import torch

from engine.config import EngineConfig
from engine.faults import Faults
from engine.llm_engine import LLMEngine
from engine.loop import EngineLoop
from engine.messages import WorkerInfo, WorkerStats
from engine.request import RequestOutput


class WorkerCore:
    def __init__(self, name: str, pool: str, config: EngineConfig,
                 on_outputs: Callable[[list[RequestOutput]], None], cpu: int | None = None,
                 faults: Faults | None = None, node_ip: str = "127.0.0.1"):
        if cpu is not None:
            os.sched_setaffinity(0, {cpu})  # before torch starts its thread pool
        torch.set_num_threads(config.torch_threads or 1)
        self.name = name
        self.cpu = cpu
        self.pool = pool
        self.node_ip = node_ip  # where peers reach this worker's channels
        self.engine = LLMEngine(config)
        slow = faults.slow_step if faults is not None and faults.config.step_delay_s > 0 else None
        self.loop = EngineLoop(self.engine, on_outputs, name=name, before_step=slow)
        self.served = 0
        self.aio: asyncio.AbstractEventLoop | None = None

    def bind(self) -> None:
        """Remember the actor's event loop (call from any async method before threads use it)."""
        if self.aio is None:
            self.aio = asyncio.get_running_loop()

    async def run(self, fn: Callable[[LLMEngine], Any]) -> Any:
        return await asyncio.wrap_future(self.loop.call(fn))

    def info(self) -> WorkerInfo:
        e = self.engine
        return WorkerInfo(self.name, self.pool, self.node_ip, e.allocator.num_blocks, e.config.block_size, self.cpu)

    async def stats(self, channels: int) -> WorkerStats:
        def read(e: LLMEngine) -> WorkerStats:
            a = e.allocator
            return WorkerStats(self.name, e.num_running, e.num_waiting, a.num_used, a.num_free, a.num_blocks,
                               channels, self.served)
        return await self.run(read)

    async def check(self) -> dict:
        """Integrity of the KV pool; returns the block counts for the caller to compare."""
        def read(e: LLMEngine) -> dict:
            e.check()
            return {"used": e.allocator.num_used, "free": e.allocator.num_free, "total": e.allocator.num_blocks,
                    "requests": len(e.requests), "reserved": len(e.reserved)}
        return await self.run(read)

    def stop(self) -> None:
        self.loop.stop()
