"""The router's one table of Ray failures (router/lifecycle/worker_calls.py): each row with the
real exception Ray raises, the rows' order, what a request's call raises for each outcome, and
what the monitor does when a poll or stats call fails (router/pools/monitor.py). No Ray runs:
the exceptions are built as Ray builds them and raised by stand-in actor methods."""

from __future__ import annotations

import asyncio
import itertools

import pytest
import ray.exceptions as rex

from prefill_worker.errors import PrefillFailed
from protocol.messages import CacheDelta, EngineBeat, WorkerInfo, WorkerStats
from protocol.sampling import SamplingParams
from router.config.loader import parse_config
from router.lifecycle.life import RequestLife
from router.lifecycle.outcomes import InternalError, Retry
from router.lifecycle.worker_calls import CALL_FAILURES, RAY_FAILURES, Outcome, call, outcome
from router.observability.metrics import RouterMetrics
from router.pools.manager import PoolManager
from router.pools.monitor import Monitor
from router.pools.worker_view import WorkerView

OBJECT = "ab" * 14  # an object id's hex


def _task_error(cause: Exception) -> rex.RayTaskError:
    """What awaiting a call whose actor method raised `cause` raises: RayTaskError(cause's class)."""
    error = rex.RayTaskError("method", f"Traceback (most recent call last):\n{cause!r}", cause, proctitle="worker",
                             pid=1, ip="127.0.0.1")
    return error.as_instanceof_cause()


ROWS = [
    (_task_error(PrefillFailed("prefill failed on prefill-0: sampling")), Outcome.INTERNAL),
    (_task_error(KeyError("prefill-0 has no handle of decode-3")), Outcome.MIGRATE),
    (_task_error(rex.ActorDiedError()), Outcome.MIGRATE),  # a peer died, seen from inside the worker
    (rex.ActorUnavailableError("the connection to the actor was lost", None), Outcome.RETRY),
    (rex.ActorDiedError(), Outcome.REPLACE),
    (rex.RayActorError(), Outcome.REPLACE),
    (rex.NodeDiedError("node 10.0.0.7 is dead"), Outcome.REPLACE),
    (rex.WorkerCrashedError(), Outcome.REPLACE),
    (rex.OutOfMemoryError("the memory monitor killed the task"), Outcome.REPLACE),
    (TimeoutError(), Outcome.RETRY),
    (rex.GetTimeoutError(), Outcome.RETRY),
    (rex.TaskCancelledError(), Outcome.MIGRATE),
    (rex.ObjectLostError(OBJECT, None, ""), Outcome.MIGRATE),
    (rex.OwnerDiedError(OBJECT, None, ""), Outcome.MIGRATE),
    (rex.ObjectFetchTimedOutError(OBJECT, None, ""), Outcome.MIGRATE),
    (rex.LocalRayletDiedError(), Outcome.MIGRATE),
    (rex.RaySystemError("the raylet is gone"), Outcome.MIGRATE),
]


@pytest.mark.parametrize("error, expected", ROWS, ids=[type(e).__name__ for e, _ in ROWS])
def test_each_ray_failure_has_its_outcome(error, expected):
    assert isinstance(error, CALL_FAILURES)
    assert outcome(error) is expected


def test_no_row_is_hidden_behind_an_earlier_base():
    for (first, _), (later, _) in itertools.combinations(RAY_FAILURES, 2):
        assert not issubclass(later, first), f"{later.__name__} comes after its base {first.__name__}"


# ---- a request's call ------------------------------------------------------------------------
class _Method:
    """A stand-in actor method: each `.remote()` answers with the next of `replies` (an exception is
    raised, a callable is called)."""

    def __init__(self, *replies):
        self.replies = list(replies)
        self.calls = 0

    def remote(self, *args):
        self.calls += 1
        reply = self.replies.pop(0) if len(self.replies) > 1 else self.replies[0]

        async def answer():
            if isinstance(reply, BaseException):
                raise reply
            return reply() if callable(reply) else reply
        return answer()


def _view(**methods) -> WorkerView:
    actor = type("Actor", (), {name: method for name, method in methods.items()})()
    return WorkerView(WorkerInfo("decode-0", "decode", "127.0.0.1", 100, 16), actor=actor, free_blocks=40)


def _call(w: WorkerView, error: BaseException, timeout_s: float = 5.0) -> BaseException:
    with pytest.raises((Retry, InternalError)) as raised:
        asyncio.run(call(w, _Method(error).remote(), timeout_s, "reserve"))
    return raised.value


def test_an_engine_failure_is_internal():
    w = _view()
    err = _call(w, ROWS[0][0])
    assert type(err) is InternalError and str(err) == "prefill failed on prefill-0: sampling"
    assert w.accepting


def test_a_dead_actor_replaces_the_worker():
    w = _view()
    err = _call(w, rex.ActorDiedError())
    assert type(err) is Retry and err.worker is w
    assert str(err) == "decode-0 died during its reserve() call: The actor died unexpectedly before finishing this task."


@pytest.mark.parametrize("error", [rex.NodeDiedError("node 10.0.0.7 is dead"), rex.WorkerCrashedError()])
def test_a_lost_node_or_process_replaces_the_worker(error):
    w = _view()
    assert _call(w, error).worker is w


def test_an_unavailable_actor_moves_the_request_and_keeps_the_worker():
    w = _view()
    err = _call(w, rex.ActorUnavailableError("the connection to the actor was lost", None))
    assert type(err) is Retry and err.worker is None
    assert str(err).startswith("reserve on decode-0 failed: The actor None is unavailable: the connection")
    assert not w.stopped and not w.accepting  # suspected: no new request for a while


def test_a_deadline_moves_the_request_and_suspects_the_worker():
    w = _view()
    with pytest.raises(Retry) as raised:
        asyncio.run(call(w, asyncio.sleep(1), 0.01, "start"))
    assert str(raised.value) == "start on decode-0 timed out after 0.01 s" and raised.value.worker is None
    assert not w.accepting


@pytest.mark.parametrize("error", [rex.TaskCancelledError(), rex.ObjectLostError(OBJECT, None, ""),
                                   _task_error(rex.ActorDiedError())])
def test_a_failed_call_moves_the_request_only(error):
    w = _view()
    err = _call(w, error)
    assert type(err) is Retry and err.worker is None and str(err).startswith("reserve on decode-0 failed: ")
    assert w.accepting


# ---- the monitor's calls -----------------------------------------------------------------------
class _Monitor(Monitor):
    """The router's monitor over one worker held by one request; `failed` records what `lost` was told."""

    def __init__(self, w: WorkerView, life: RequestLife):
        pools = PoolManager(parse_config({}))
        pools.workers["decode"].append(w)
        super().__init__(pools, RouterMetrics(), call_timeout_s=1.0, unresponsive_s=30.0, deliver=lambda *a: None,
                         holders_of=lambda worker: [life] if worker is w else [], on_change=lambda: None)
        self.failed: list[str] = []

    def lost(self, w: WorkerView, reason: str) -> None:  # the real one kills the actor through Ray
        self.failed.append(reason)
        w.stop()


def _life(w: WorkerView) -> RequestLife:
    life = RequestLife("client-1", 7, [1, 2, 3], SamplingParams(), 0.0)
    life.decode = w
    return life


def _drain(life: RequestLife) -> list[str]:
    """The failures delivered to `life`, as text."""
    out = []
    while not life.events.empty():
        out.append(str(life.events.get_nowait()[1]))
    return out


def test_an_unavailable_actor_on_poll_moves_its_requests_and_polls_again():
    w = _view()

    def stop_with_no_events() -> list:  # the second poll ends the loop
        w.stop()
        return []
    w.actor.poll = _Method(rex.ActorUnavailableError("the connection to the actor was lost", None),
                           stop_with_no_events)
    life = _life(w)
    monitor = _Monitor(w, life)
    asyncio.run(monitor._poll_loop(w))
    assert monitor.failed == [] and w.actor.poll.calls == 2
    [moved] = _drain(life)
    assert moved.startswith("polling decode-0 failed: The actor None is unavailable")


def test_a_dead_actor_on_poll_fails_the_worker():
    w = _view(poll=_Method(rex.ActorDiedError()))
    monitor = _Monitor(w, _life(w))
    asyncio.run(monitor._poll_loop(w))
    assert monitor.failed == ["The actor died unexpectedly before finishing this task."]


@pytest.mark.parametrize("error, failed", [
    (rex.ActorUnavailableError("the connection to the actor was lost", None), False),
    (rex.GetTimeoutError(), False),
    (rex.NodeDiedError("node 10.0.0.7 is dead"), True),
    (rex.ActorDiedError(), True),
])
def test_a_failed_stats_call_fails_only_a_dead_worker(error, failed):
    w = _view(stats=_Method(error))
    monitor = _Monitor(w, _life(w))
    asyncio.run(monitor.refresh())
    assert bool(monitor.failed) is failed and w.stopped is failed


@pytest.mark.parametrize("beat, failed", [
    (EngineBeat("decode-0", 31.0, 50, 0), "its engine made no progress for 31 s"),
    (EngineBeat("decode-0", 0.1, 50, 3), "3 engine steps failed in a row"),
])
def test_an_engine_silent_past_unresponsive_s_or_failing_its_steps_fails_the_worker(beat, failed):
    """The actor answers (its beat call does not need the engine thread), yet the worker is failed:
    its engine has not come round its loop for unresponsive_s (30 s here), or keeps failing steps."""
    w = _view(beat=_Method(beat))
    life = _life(w)
    monitor = _Monitor(w, life)
    asyncio.run(monitor._beat_loop(w))
    assert monitor.failed == [failed] and w.stopped


def test_a_quiet_engine_takes_no_new_request_until_it_beats_again():
    """Silent for half the call deadline (1 s here): a reserve would wait behind it, so placement
    skips it; it takes requests again at its next beat, and is never failed for it."""
    beats = [EngineBeat("decode-0", 0.6, 9, 0), EngineBeat("decode-0", 0.0, 10, 0)]
    w = _view()
    monitor = _Monitor(w, _life(w))
    w.heard(beats[0], monitor.quiet_s)
    assert not w.accepting and w.engine_steps == 9
    w.heard(beats[1], monitor.quiet_s)
    assert w.accepting and w.engine_steps == 10 and monitor.failed == []


def test_a_beat_call_that_fails_takes_the_worker_off_placement_but_fails_it_only_after_unresponsive_s():
    w = _view()
    accepting_after_failure: list[bool] = []

    def note_and_stop() -> EngineBeat:  # the second beat: record what the failed one left, end the loop
        accepting_after_failure.append(w.accepting)
        w.stop()
        return EngineBeat("decode-0", 0.0, 1, 0)
    w.actor.beat = _Method(rex.GetTimeoutError(), note_and_stop)
    monitor = _Monitor(w, _life(w))
    asyncio.run(monitor._beat_loop(w))
    assert accepting_after_failure == [False] and monitor.failed == []


class _NumberedStats:
    """A worker's `stats` the way WorkerCore answers it: each call takes the next cache-delta number
    when it runs (a snapshot when asked to resync), and a later call may answer first (here each
    answers faster than the one before, as Ray does not keep an actor's calls in order)."""

    def __init__(self, name: str):
        self.name = name
        self.calls = 0
        self.resyncs = 0

    def remote(self, resync: bool = False):
        self.calls += 1
        self.resyncs += resync
        delta = CacheDelta(self.calls, (bytes([self.calls]),), (), snapshot=resync)

        async def answer() -> WorkerStats:
            await asyncio.sleep(0.05 / self.calls)
            return WorkerStats(self.name, 0, 0, 0, 100, 100, 0, 0, cache=delta)
        return answer()


def test_concurrent_status_refreshes_share_one_stats_round_and_keep_deltas_in_order():
    workers = [_view(stats=_NumberedStats("decode-0")), _view(stats=_NumberedStats("decode-1"))]
    workers[1].info = WorkerInfo("decode-1", "decode", "127.0.0.1", 100, 16)
    monitor = _Monitor(workers[0], _life(workers[0]))
    monitor.pools.workers["decode"].append(workers[1])

    async def status_calls() -> None:
        await asyncio.gather(*(monitor.refresh() for _ in range(8)))  # Admin/Status x 8 at once
        for w in workers:
            w.cache_resync = False  # the first round's snapshot is in: deltas from now on
        lonely = asyncio.get_running_loop().create_task(monitor.refresh())
        await asyncio.sleep(0)
        lonely.cancel()  # a Status client that left: the round goes on for the others
        await asyncio.gather(monitor.refresh(), monitor.refresh())
        await asyncio.gather(monitor.refresh(), monitor.pools.fetch_stats(workers[0]))  # a drain's check too
    asyncio.run(status_calls())
    assert [w.actor.stats.calls for w in workers] == [4, 3]  # rounds 1, 2 (shared by three), 3; + the drain's
    assert [w.actor.stats.resyncs for w in workers] == [1, 1]  # only the first call: no gap was ever seen
    assert not any(w.cache_resync for w in workers)
    index = monitor.pools.placer.index["decode"]
    assert index.match([bytes([1])], ["decode-0", "decode-1"]) == {"decode-0": 1, "decode-1": 1}
    assert index.blocks_of("decode-0") == 4 and index.blocks_of("decode-1") == 3
