"""The pool manager's scale lock is per pool (router/pools/manager.py): a decode start is not held
behind a slow prefill start (a weights load), and a role change takes both pools' locks.

Checked with the real PoolManager over stand-in actors whose `ready` waits for the test's say-so
(a worker's start-up), so the order of events decides, not the time: the decode pool scales up
and its worker is placed while a prefill start is still loading; a role change waits for a scale
of either pool.
"""

from __future__ import annotations

import asyncio

import pytest

from protocol.messages import WorkerInfo
from router.config.loader import parse_config
from router.lifecycle.outcomes import CannotChangeRole
from router.pools.manager import PoolManager, scale_down_victims
from router.pools.worker_view import WorkerView


class _Ready:
    def __init__(self, handle: _Handle):
        self.handle = handle

    async def _answer(self) -> WorkerInfo:
        h = self.handle
        h.actors.events.append(f"{h.name} loading")
        await h.actors.gates[h.pool].wait()
        h.actors.events.append(f"{h.name} ready")
        return WorkerInfo(h.name, h.pool, "127.0.0.1", num_blocks=64, block_size=16)

    def remote(self):
        return self._answer()


class _Handle:
    def __init__(self, actors: GatedActors, pool: str, name: str):
        self.actors, self.pool, self.name = actors, pool, name
        self.ready = _Ready(self)


class GatedActors:
    """Starts stand-in workers whose start-up ends when their pool's gate opens."""

    def __init__(self):
        self.gates = {"prefill": asyncio.Event(), "decode": asyncio.Event()}
        self.events: list[str] = []

    def start(self, cls, sec, env, args) -> _Handle:
        pool, name = args[0], args[1]
        return _Handle(self, pool, name)

    def kill(self, actor: _Handle) -> None:
        self.events.append(f"{actor.name} killed")

    def check_placeable(self, pool, sec, count) -> None:
        pass


async def _until(condition, what: str) -> None:
    """Lets the loop run until `condition()` (every step here is in-process: a few turns)."""
    for _ in range(1000):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError(f"never happened: {what}")


def _manager() -> tuple[PoolManager, GatedActors]:
    actors = GatedActors()
    cfg = parse_config({"model": {"path": "unused"}, "mode": "disaggregated",
                        "prefill": {"replicas": 1}, "decode": {"replicas": 1}})  # none started yet
    return PoolManager(cfg, actors=actors), actors


def test_a_decode_start_is_not_held_behind_a_slow_prefill_start():
    async def run():
        pools, actors = _manager()
        actors.gates["decode"].set()  # decode workers start at once; prefill ones load until told
        prefill = asyncio.create_task(pools.scale("prefill", 1))
        await _until(lambda: "prefill-0 loading" in actors.events, "the prefill start began")
        decode = asyncio.create_task(pools.scale("decode", 1))
        await _until(decode.done, "the decode pool scaled while the prefill worker loads")  # one lock: never
        assert decode.result() == (["decode-1"], [])
        assert [w.name for w in pools.ready("decode")] == ["decode-1"] and not prefill.done()
        actors.gates["prefill"].set()
        assert await prefill == (["prefill-0"], [])
        assert actors.events == ["prefill-0 loading", "decode-1 loading", "decode-1 ready", "prefill-0 ready"]
    asyncio.run(run())


def test_a_role_change_waits_for_a_scale_of_either_pool():
    async def run():
        pools, actors = _manager()
        actors.gates["prefill"].set()
        await pools.scale("prefill", 2)
        growing = asyncio.create_task(pools.scale("decode", 1))
        await _until(lambda: "decode-2 loading" in actors.events, "the decode start began")
        worker = pools.ready("prefill")[0]
        change = asyncio.create_task(pools.change_role(worker, "prefill"))  # refused, but only in the locks
        await _until(lambda: pools._scale_locks["prefill"].locked(), "the role change took the prefill lock")
        assert not change.done()  # it waits for the decode pool's lock
        actors.gates["decode"].set()
        await growing
        with pytest.raises(CannotChangeRole, match="is a prefill worker already"):
            await change
    asyncio.run(run())


def _view(name: str, ready_at: float, inflight: int) -> WorkerView:
    return WorkerView(WorkerInfo(name, name.split("-")[0], "127.0.0.1", num_blocks=64, block_size=16), None,
                      ready_at=ready_at, inflight={f"a{i}" for i in range(inflight)})


def test_a_scale_down_drains_warming_workers_before_warm_ones():
    """The bursty case's release: 2 warm workers and 9 warming, the warm ones idle, 4 to go. The
    warming go first (the planner counts only warm workers as capacity: draining the warm ones
    left it none and it grew again), the fewest in flight first among them, then the newest."""
    warm = [_view("prefill-0", 0.0, 0), _view("prefill-1", 0.0, 0)]
    warming = [_view(f"prefill-{i}", 60.0, i % 3) for i in range(2, 11)]
    victims = scale_down_victims(warm + warming, 4, now=70.0, warmup_s=30.0)
    assert [w.name for w in victims] == ["prefill-9", "prefill-6", "prefill-3", "prefill-10"]
    # all warm: the quickest to drain, then the newest (the order before)
    aged = scale_down_victims(warm + warming, 5, now=200.0, warmup_s=30.0)
    assert [w.name for w in aged] == ["prefill-9", "prefill-6", "prefill-3", "prefill-1", "prefill-0"]
