"""Workers started in-process behind handles that answer like Ray actor handles.

`SimActors` is the pool manager's `Actors` (router/pools/actors.py) for a simulation:
`handle.method.remote(*args)` starts the call at once as a task on the event loop (a Ray call
runs whether or not anybody awaits it) after `rpc_s` of modelled call latency, and its reply
comes `rpc_s` later; an exception the worker's code raises reaches the caller as the
`RayTaskError` Ray would raise, so the router sorts it by its own table
(router/lifecycle/worker_calls.py). A killed worker's calls raise `ActorDiedError`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import ray.exceptions

from router.config.schema import PoolSection
from simulate.engine import SimRunner
from simulate.workers import SimLink, SimWorkerHost
from sizing.cost_model import Emulation
from sizing.memory import ModelShape

RPC_S = 0.0002  # one way, router <-> worker: a Ray actor call's latency on one node


class SimHandle:
    def __init__(self, worker: Any, rpc_s: float):
        self.worker = worker
        self.rpc_s = rpc_s
        self.dead = False

    def __getattr__(self, method: str) -> _Method:
        return _Method(self, method)


class _Method:
    def __init__(self, handle: SimHandle, name: str):
        self._handle, self._name = handle, name

    def remote(self, *args: Any) -> asyncio.Task:
        return asyncio.get_running_loop().create_task(self._call(args))

    async def _call(self, args: tuple) -> Any:
        h = self._handle
        if h.rpc_s:
            await asyncio.sleep(h.rpc_s)
        if h.dead:
            raise ray.exceptions.ActorDiedError()
        try:
            result = await getattr(h.worker, self._name)(*args)
        except Exception as e:  # Ray hands the caller the worker's error wrapped, an instance of both
            raise ray.exceptions.RayTaskError(self._name, "", e).as_instanceof_cause() from None
        if h.rpc_s:
            await asyncio.sleep(h.rpc_s)
        return result


class SimActors:
    """Starts simulated workers for the pool manager; `workers`: every one started, by name (each
    one's life on the virtual clock: bench/accounting.py's `RecordingActors` around this)."""

    def __init__(self, emulation: Emulation, shape: ModelShape, block_size: int, rpc_s: float = RPC_S,
                 spread: Callable[[str, int, bool], float] | None = None,
                 handoff: Callable[[str], float] | None = None):
        self.emulation = emulation
        self.spread = spread  # a real host's step spread (simulate/serving.py), given to every engine loop
        self.shape = shape
        self.block_size = block_size
        self.rpc_s = rpc_s
        self.link = SimLink(emulation, block_size, handoff)
        self.workers: dict[str, Any] = {}

    def start(self, cls: type, sec: PoolSection, env: dict[str, str], args: tuple) -> SimHandle:
        """`cls`: the pool manager's `WorkerHost`, whose simulated twin (`SimWorkerHost`) starts."""
        pool, name, engine, transfer, _cpu, _faults, _emulation = args
        runner = SimRunner(engine, self.shape.vocab_size or 32_000, self.shape.max_positions or 131_072,
                           self.block_size * self.emulation.cost.kv_bytes_per_token)
        worker = SimWorkerHost(pool, name, engine, self.emulation, runner, self.link, transfer)
        worker.core.loop.spread = self.spread
        self.workers[name] = worker
        return SimHandle(worker, self.rpc_s)

    def kill(self, actor: SimHandle) -> None:
        if not actor.dead:
            actor.dead = True
            actor.worker.core.stop()
            self.link.workers.pop(actor.worker.core.name, None)

    def check_placeable(self, pool: str, sec: PoolSection, count: int) -> None:
        """A simulated cluster has room for any number of workers."""
