"""`WorkerHost`: the Ray actor of every pool worker. It hosts one role object, a `PrefillWorker` or
a `DecodeWorker`, and answers each of their calls by passing it on; `change_role` gives the same
process the other role without a restart, its weights kept loaded.

Protocol of a role change (router/pools/manager.py `PoolManager.change_role` drives it): the
router drains the worker first (nothing new placed there; what it holds finishes or moves) and
closes the channels its peers hold to it; then `change_role(pool, name, faults)` closes the
channels the old role holds (`leave`), resets the engine's block ledger (`LLMEngine.reset_cache`:
every block free, nothing cached; the engine refuses if anything is still held), and builds the
new role over the same `WorkerCore` under a new name, so no peer or router state of the old name
can reach it. Its channels open on first use, as a fresh worker's do.
"""

from __future__ import annotations

import inspect
from typing import Any

from decode_worker.worker import DecodeWorker
from engine.config import EngineConfig
from kv_transfer import KVTransferConfig
from prefill_worker.worker import PrefillWorker
from protocol.messages import WorkerInfo
from sizing.cost_model import Emulation
from worker_runtime.core import WorkerCore
from worker_runtime.faults import FaultConfig

ROLES: dict[str, type] = {"prefill": PrefillWorker, "decode": DecodeWorker}


class WorkerHost:
    def __init__(self, pool: str, name: str, config: EngineConfig, transfer: KVTransferConfig | None,
                 cpu: int | None = None, faults: FaultConfig | None = None, emulation: Emulation | None = None):
        self._config, self._transfer, self._cpu, self._emulation = config, transfer, cpu, emulation
        self.role = self._make_role(pool, name, faults, None)

    def _make_role(self, pool: str, name: str, faults: FaultConfig | None, core: WorkerCore | None) -> Any:
        """The role object for `pool`: over `core` (idle and reset), or loading the engine (None)."""
        return ROLES[pool](name, self._config, self._transfer, self._cpu, faults, self._emulation, core=core)

    async def change_role(self, pool: str, name: str, faults: FaultConfig | None = None) -> WorkerInfo:
        """Become `name` in `pool` (the router has drained this worker); returns the new role's info."""
        old = self.role
        assert pool != old.core.pool, f"{old.core.name} is a {pool} worker already"
        await old.leave()
        await old.core.run(lambda e: e.reset_cache())  # raises if anything is still held: nothing is lost
        self.role = self._make_role(pool, name, faults, old.core)
        return await self.role.ready()

    def __getattr__(self, attr: str) -> Any:
        """The role's attributes (a test's `__ray_call__` probe reads `actor.core`, `actor.handoffs`)."""
        role = self.__dict__.get("role")
        if role is None:
            raise AttributeError(attr)
        return getattr(role, attr)


def _passes_on(method: str):
    async def call(self: WorkerHost, *args: Any, **kwargs: Any) -> Any:
        return await getattr(self.role, method)(*args, **kwargs)
    call.__name__ = call.__qualname__ = method
    return call


# Every actor call either role answers, as a method of the host's class (Ray lists a handle's
# methods from its class); a call the current role lacks fails like any failed call.
ROLE_CALLS = sorted({name for cls in ROLES.values() for name, _ in inspect.getmembers(cls, inspect.iscoroutinefunction)
                     if not name.startswith("_") and name != "leave"})
for _method in ROLE_CALLS:
    setattr(WorkerHost, _method, _passes_on(_method))
