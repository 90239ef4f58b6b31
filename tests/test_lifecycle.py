"""The router's per-request state (router/lifecycle/life.py): allowed transitions, who holds state
in each phase, and that events of an earlier attempt never reach the client; and its per-worker
bookkeeping (router/pools/worker_view.py): state transitions, attempts held, free blocks."""

from __future__ import annotations

import pytest

from protocol.messages import WorkerInfo
from protocol.sampling import SamplingParams
from router.lifecycle.life import TRANSITIONS, Phase, RequestLife
from router.pools.worker_view import WorkerState, WorkerView


def _life() -> RequestLife:
    return RequestLife("client-1", 7, [1, 2, 3], SamplingParams(), 0.0)


def _walk(life: RequestLife, to: Phase, prefill="P", decode="D") -> RequestLife:
    """Drive a life along the disaggregated path up to `to`, holders set as the router sets them."""
    path = [Phase.RESERVING, Phase.PREFILLING, Phase.HANDOFF, Phase.DECODING]
    for phase in path[:path.index(to) + 1] if to in path else []:
        life.to(phase)
        if phase is Phase.RESERVING:
            life.decode = decode
        if phase is Phase.PREFILLING:
            life.prefill = prefill
        if phase is Phase.DECODING:
            life.prefill = None
    return life


HOLDERS = {Phase.QUEUED: [], Phase.RESERVING: ["D"], Phase.PREFILLING: ["P", "D"], Phase.HANDOFF: ["P", "D"],
           Phase.DECODING: ["D"]}


@pytest.mark.parametrize("phase", list(HOLDERS))
def test_cancel_in_each_phase_returns_every_holder(phase):
    life = _walk(_life(), phase)
    assert life.end(Phase.CANCELLED) == HOLDERS[phase]
    assert life.ended and life.holders == []


@pytest.mark.parametrize("phase", list(HOLDERS))
def test_peer_death_in_each_phase_moves_the_request(phase):
    life = _walk(_life(), phase)
    old = life.attempt_id
    life.record([42], "x")
    assert life.retry("decode-1 died") == HOLDERS[phase]
    assert life.phase is Phase.QUEUED and life.migrations == 1 and life.attempt_id != old
    assert life.output_token_ids == [42] and life.emitted_chars == 1  # kept for the next attempt
    assert life.num_context_tokens() == 4


def test_events_of_an_earlier_attempt_are_dropped():
    life = _walk(_life(), Phase.DECODING)
    old = life.attempt_id
    life.retry("moved")
    assert not life.deliver(old, "late token")
    assert life.deliver(life.attempt_id, "fresh")
    assert life.events.qsize() == 1


def test_no_event_reaches_an_ended_request():
    life = _life()
    life.end(Phase.FAILED)
    assert not life.deliver(life.attempt_id, "x")


Q, R, P, H, D = Phase.QUEUED, Phase.RESERVING, Phase.PREFILLING, Phase.HANDOFF, Phase.DECODING
# written out from the lifecycle (life.py's docstring, attempt.py), not from the table: the forward paths
# (disaggregated Q-R-P-H-D, after_prefill Q-P-R-H-D, colocated Q-D, finished at the first token from
# P or H), and from every live phase a failed attempt (back to Q), a failure or a cancel
ALLOWED = ({(Q, R), (R, P), (P, H), (H, D), (D, Phase.FINISHED), (Q, D), (P, Phase.FINISHED), (H, Phase.FINISHED),
            (Q, P), (P, R), (R, H)}
           | {(live, end) for live in (Q, R, P, H, D) for end in (Q, Phase.FAILED, Phase.CANCELLED)})


def test_the_transition_table_is_the_documented_lifecycle():
    assert {(src, dst) for src, dsts in TRANSITIONS.items() for dst in dsts} == ALLOWED
    assert set(TRANSITIONS) == set(Phase)


@pytest.mark.parametrize("src", list(Phase))
def test_only_listed_transitions_are_allowed(src):
    for dst in Phase:
        life = _life()
        life.phase = src
        if (src, dst) in ALLOWED:
            life.to(dst)
            assert life.phase is dst
        else:
            with pytest.raises(AssertionError):
                life.to(dst)


def test_ended_phases_are_final():
    for phase in (Phase.FINISHED, Phase.FAILED, Phase.CANCELLED):
        assert TRANSITIONS[phase] == frozenset()


def _view() -> WorkerView:
    return WorkerView(WorkerInfo("decode-0", "decode", "127.0.0.1", 100, 16), actor=None, free_blocks=40)


def test_a_worker_drains_then_stops_and_stopped_is_final():
    w = _view()
    assert (w.state, w.accepting, w.stopped) == (WorkerState.READY, True, False)
    w.drain()
    assert (w.state, w.accepting, w.stopped) == (WorkerState.DRAINING, False, False)
    assert w.stop() and not w.stop()  # the second caller learns someone else took it out
    w.drain()
    assert (w.state, w.accepting, w.stopped) == (WorkerState.STOPPED, False, True)


def test_a_worker_counts_the_attempts_it_holds_and_estimates_free_blocks():
    w = _view()
    w.hold("a.0", prefill_tokens=30)
    w.hold("b.0")
    assert (w.inflight, w.prefill_tokens, w.load) == ({"a.0", "b.0"}, {"a.0": 30}, 2)
    w.release("a.0")
    w.release("a.0")  # idempotent: a cancel and a finish may both release
    assert (w.inflight, w.prefill_tokens) == ({"b.0"}, {})
    w.took_blocks(12)
    assert w.free_blocks == 28
    w.had_no_room(20)  # refused 20 blocks: at most 19 are free
    assert w.free_blocks == 19
    w.had_no_room(30)  # a larger refusal says nothing new
    assert w.free_blocks == 19


def _attempts(prefill_timeout_s: float):
    from router.config.loader import parse_config
    from router.lifecycle.admission import Admission
    from router.lifecycle.attempt import Attempts
    from router.observability.metrics import RouterMetrics
    from router.pools.manager import PoolManager

    config = parse_config({"router": {"prefill_timeout_s": prefill_timeout_s}})
    return Attempts(config, PoolManager(config), Admission(8), RouterMetrics(), lambda: True)


def test_a_slow_request_on_a_worker_that_steps_waits_its_turn_and_is_not_moved():
    """Progress is the worker's: a request silent for three prefill_timeout_s on a worker whose
    engine kept stepping (saturated, not stalled) gets its token when it comes; one on a worker
    whose engine did not step for prefill_timeout_s moves."""
    import asyncio

    from router.lifecycle.outcomes import Retry

    attempts = _attempts(prefill_timeout_s=0.2)

    async def on_worker(stepping: bool) -> tuple:
        w, life = _view(), _walk(_life(), Phase.DECODING)

        async def steps_then_token():
            for _ in range(12):  # 0.6 s: three deadlines, with steps (none of them this request's) or without
                await asyncio.sleep(0.05)
                w.engine_steps += stepping
            life.deliver(life.attempt_id, "token")
        task = asyncio.get_running_loop().create_task(steps_then_token())
        try:
            return await attempts.tokens._next_event(life, w)
        finally:
            await task

    assert asyncio.run(on_worker(stepping=True))[1] == "token"
    with pytest.raises(Retry) as moved:
        asyncio.run(on_worker(stepping=False))
    assert str(moved.value) == "no progress from decode-0 for 0.2 s"
