"""Sampling through an engine (seeded reproducibility), stop handling, bad requests, and failures
that stay with the one request that caused them. The sampler alone: tests/test_sampler.py."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest

from engine import sampler as sampler_module
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.request import Request
from protocol.errors import InvalidRequest
from protocol.outputs import FinishReason, RequestOutput
from protocol.sampling import SamplingParams
from worker_runtime.engine_loop import EngineLoop


@pytest.fixture(scope="module")
def engine(llama_dir) -> LLMEngine:
    return LLMEngine(EngineConfig(model_path=llama_dir, num_blocks=128, dtype="float32"))


def test_same_seed_same_tokens(engine):
    sp = SamplingParams(max_tokens=20, temperature=1.0, seed=1234, ignore_eos=True)
    prompt = [[5, 6, 7, 8, 9]]
    first, second = engine.generate(prompt, sp)[0], engine.generate(prompt, sp)[0]
    other = engine.generate(prompt, SamplingParams(max_tokens=20, temperature=1.0, seed=99, ignore_eos=True))[0]
    assert first == second
    assert first != other


def test_stop_token_and_max_tokens(engine):
    greedy = engine.generate([[11, 12, 13]], SamplingParams(max_tokens=10, ignore_eos=True))[0]
    assert len(greedy) == 10
    assert engine.generate([[11, 12, 13]], SamplingParams(max_tokens=3, ignore_eos=True))[0] == greedy[:3]
    stop_at = greedy[3]
    cut = engine.generate([[11, 12, 13]], SamplingParams(max_tokens=10, stop_token_ids=(stop_at,), ignore_eos=True))[0]
    assert cut == greedy[:greedy.index(stop_at) + 1]


def test_stop_string_cuts_text_and_never_leaks(engine):
    req = engine.add_request("s0", prompt_token_ids=[21, 22, 23], sampling=SamplingParams(max_tokens=30, ignore_eos=True))
    texts, full = [], ""
    while engine.has_unfinished():
        for o in engine.step():
            full += o.text
    assert req.finish_reason is FinishReason.LENGTH
    stop = full[5:8]
    assert stop and stop not in full[:5]
    engine.add_request("s1", prompt_token_ids=[21, 22, 23],
                       sampling=SamplingParams(max_tokens=30, ignore_eos=True, stop=(stop,)))
    reasons = []
    while engine.has_unfinished():
        for o in engine.step():
            texts.append(o.text)
            reasons.append(o.finish_reason)
    assert "".join(texts) == full[:full.index(stop)]
    assert reasons[-1] is FinishReason.STOP
    engine.check()


@pytest.mark.parametrize("kwargs, message", [
    ({"prompt": ""}, "prompt is empty"),
    ({"prompt_token_ids": [1, 2], "sampling": SamplingParams(max_tokens=5000)}, "exceeds the model's context"),
    ({"prompt": "hi", "sampling": SamplingParams(max_tokens=0)}, "max_tokens must be at least 1"),
    ({"prompt": "hi", "sampling": SamplingParams(temperature=-0.5)}, "temperature must be >= 0"),
    ({"prompt": "hi", "sampling": SamplingParams(top_p=0.0)}, r"top_p must be in \(0, 1\]"),
    ({"prompt": "hi", "sampling": SamplingParams(top_p=1.5)}, r"top_p must be in \(0, 1\]"),
    ({"prompt": "hi", "sampling": SamplingParams(top_k=-1)}, "top_k must be >= 0"),
    ({"prompt_token_ids": [1, 999999]}, "outside the vocabulary"),
    ({"prompt": "hi", "prompt_token_ids": [1]}, "not both"),
    ({"prompt": "hi", "sampling": SamplingParams(temperature=float("nan"))}, "temperature must be a finite number"),
    ({"prompt": "hi", "sampling": SamplingParams(stop_token_ids=(5, 10**6))}, "stop_token_ids has ids outside"),
    ({"prompt": "hi", "request_id": "b a d"}, "request_id may contain only printable ASCII"),
    ({"prompt": "hi", "request_id": "good"}, "request id 'good' is already in use"),
    ({"prompt": "hi", "output_token_ids": [5, 6], "sampling": SamplingParams(max_tokens=2)}, "leaves none"),
    ({"prompt": "hi", "output_token_ids": [300], "emitted_chars": 500}, "emitted_chars is 500"),
])
def test_bad_requests_are_refused_without_disturbing_others(engine, kwargs, message):
    sampling = SamplingParams(max_tokens=6, ignore_eos=True)
    undisturbed = engine.generate([[3, 4, 5]], sampling)[0]
    good = engine.add_request("good", prompt_token_ids=[3, 4, 5], sampling=sampling)
    engine.step()
    with pytest.raises(InvalidRequest, match=message):
        engine.add_request(**{"request_id": "bad", **kwargs})
    assert set(engine.requests) == {"good"} and not engine.reserved
    while engine.has_unfinished():
        engine.step()
    assert good.finish_reason is FinishReason.LENGTH and good.output_token_ids == undisturbed
    engine.check()
    assert engine.allocator.num_used == 0


def test_abort_frees_blocks(engine):
    engine.add_request("a", prompt_token_ids=list(range(10, 60)), sampling=SamplingParams(max_tokens=50))
    engine.step()
    assert engine.allocator.num_used > 0
    out = engine.abort("a")
    assert out.finish_reason is FinishReason.ABORT
    assert not engine.has_unfinished() and engine.allocator.num_used == 0
    engine.check()


def test_reserve_release_and_prefill_only_accounting(engine):
    blocks, _ = engine.reserve("res", num_tokens=40)  # 40 tokens of 16 -> 3 blocks
    assert len(blocks) == 3 and engine.allocator.num_used == 3
    engine.check()
    engine.release("res")
    assert engine.allocator.num_used == 0
    req = engine.add_request("pre", prompt_token_ids=list(range(5, 40)), prefill_only=True,
                             sampling=SamplingParams(max_tokens=8, ignore_eos=True))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert [o.finish_reason for o in outs] == [FinishReason.PREFILLED] and len(outs[0].token_ids) == 1
    assert engine.allocator.num_used == len(req.block_ids) == 3  # kept for the KV push
    engine.check()
    engine.release("pre")
    assert engine.allocator.num_used == 0
    engine.check()


def test_reserve_refuses_an_id_in_use(engine):
    blocks, _ = engine.reserve("held", num_tokens=40)
    engine.add_request("live", prompt_token_ids=[3, 4, 5], sampling=SamplingParams(max_tokens=2))
    for request_id in ("held", "live"):
        with pytest.raises(InvalidRequest, match=f"request id '{request_id}' is already in use"):
            engine.reserve(request_id, num_tokens=16)
    with pytest.raises(InvalidRequest, match="request id 'held' is already in use"):
        engine.add_request("held", prompt_token_ids=[3])
    assert engine.reserved == {"held": blocks} and engine.allocator.num_used == 3  # "live" still waits
    engine.check()
    engine.abort("live")
    engine.release("held")
    assert engine.allocator.num_used == 0


# ---- failures that stay with one request -------------------------------------------------
_NEIGHBOURS = {
    "greedy": ([3, 4, 5, 6], SamplingParams(max_tokens=8, ignore_eos=True)),
    "seeded": ([7, 8, 9], SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True)),
    "victim": ([10, 11, 12], SamplingParams(max_tokens=8, temperature=1.0, seed=6, ignore_eos=True)),
    "long": (list(range(20, 60)), SamplingParams(max_tokens=8, ignore_eos=True)),
}


def _run_neighbours(engine: LLMEngine) -> tuple[dict[str, Request], dict[str, list[RequestOutput]]]:
    reqs = {rid: engine.add_request(rid, prompt_token_ids=p, sampling=sp) for rid, (p, sp) in _NEIGHBOURS.items()}
    outs: dict[str, list[RequestOutput]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    engine.check()
    assert engine.allocator.num_used == 0 and not engine.requests
    return reqs, outs


def _assert_only_the_victim_failed(undisturbed, outs, error: str) -> None:
    # what the client sees must be the same; the rerun finds the first run's blocks in the prefix
    # cache, and step kinds and timings depend on how the steps were batched
    def uncached(o: list[RequestOutput]) -> list[RequestOutput]:
        return [replace(x, num_cached_tokens=0, step_kind="", prefill_timing=None) for x in o]

    assert {rid: uncached(outs[rid]) for rid in outs if rid != "victim"} == {
        rid: uncached(o) for rid, o in undisturbed.items() if rid != "victim"}
    *before, last = outs["victim"]
    assert uncached(before) == uncached(undisturbed["victim"][:2])
    assert (last.token_ids, last.text, last.finish_reason) == ([], error, FinishReason.ERROR)


def test_a_request_whose_sampling_raises_fails_alone(engine, monkeypatch):
    _, undisturbed = _run_neighbours(engine)
    real = sampler_module._sample_row

    def flaky(row, req, gen):
        if req.request_id == "victim" and len(req.output_token_ids) == 2:
            raise RuntimeError("injected fault\nsecond line")
        return real(row, req, gen)

    monkeypatch.setattr(sampler_module, "_sample_row", flaky)
    _, outs = _run_neighbours(engine)
    _assert_only_the_victim_failed(undisturbed, outs, "sampling failed: RuntimeError: injected fault")


def test_a_request_whose_detokenizing_raises_fails_alone(engine):
    _, undisturbed = _run_neighbours(engine)
    reqs = {rid: engine.add_request(rid, prompt_token_ids=p, sampling=sp) for rid, (p, sp) in _NEIGHBOURS.items()}
    victim = reqs["victim"].detokenizer
    real = victim.add_token

    def flaky(token_id):
        if len(reqs["victim"].output_token_ids) == 3:  # the engine appends the token first
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
        return real(token_id)

    victim.add_token = flaky
    outs: dict[str, list[RequestOutput]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    engine.check()
    assert engine.allocator.num_used == 0 and not engine.requests
    _assert_only_the_victim_failed(
        undisturbed, outs,
        "detokenizing failed: UnicodeDecodeError: 'utf-8' codec can't decode byte 0xff in position 0: invalid start byte")


def test_the_loop_builds_its_engine_on_the_thread_that_steps_it(engine):
    """One thread runs every torch op of a worker's engine (one OpenMP team: engine_loop.py)."""
    built_on = []

    def make():
        built_on.append(threading.current_thread())
        return engine
    loop = EngineLoop(make, lambda outs: None, name="where")
    try:
        assert loop.engine is engine
        stepped_on = loop.call(lambda e: threading.current_thread()).result(10)
        assert built_on == [stepped_on] and stepped_on.name == "where-loop"
        assert stepped_on is not threading.current_thread()
    finally:
        loop.stop()


def test_an_engine_that_fails_to_build_fails_the_loops_start_and_leaves_no_thread():
    def broken():
        raise ValueError("config.json names no architecture pdserve knows")
    with pytest.raises(ValueError, match="names no architecture"):
        EngineLoop(broken, lambda outs: None, name="broken")
    deadline = time.monotonic() + 10
    while any(t.name == "broken-loop" for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the loop thread outlived its failed build"
        time.sleep(0.01)


def test_a_failing_step_fails_its_requests_and_the_loop_lives_on(engine, monkeypatch):
    outputs = []
    loop = EngineLoop(lambda: engine, outputs.extend, name="test")
    real_execute = engine.runner.execute

    def broken(items, greedy=False):
        raise RuntimeError("boom")

    monkeypatch.setattr(engine.runner, "execute", broken)
    loop.call(lambda e: e.add_request("f", prompt_token_ids=[4, 5, 6], sampling=SamplingParams(max_tokens=3))).result(10)
    deadline = time.monotonic() + 10
    while not outputs and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("f", FinishReason.ERROR)] and "boom" in outputs[0].text
    monkeypatch.setattr(engine.runner, "execute", real_execute)
    assert loop.call(lambda e: e.allocator.num_used).result(10) == 0  # its blocks came back
    loop.call(lambda e: e.check()).result(10)
    loop.stop()


def test_before_step_runs_before_every_step_and_its_failure_fails_the_step(engine, monkeypatch):
    events: list[str] = []
    real_step = engine.step

    def step():
        events.append("step")
        return real_step()

    def before_step():
        events.append("before")
        if len(events) > 6:
            raise RuntimeError("slow node")

    monkeypatch.setattr(engine, "step", step)
    outputs: list[RequestOutput] = []
    loop = EngineLoop(lambda: engine, outputs.extend, name="hook", before_step=before_step)
    loop.call(lambda e: e.add_request("h", prompt_token_ids=[4, 5, 6],
                                      sampling=SamplingParams(max_tokens=20, ignore_eos=True))).result(10)
    deadline = time.monotonic() + 10
    while not (outputs and outputs[-1].finished) and time.monotonic() < deadline:
        time.sleep(0.01)
    loop.stop()
    assert events == ["before", "step"] * 3 + ["before"]
    assert [o.finish_reason for o in outputs] == [None, None, None, FinishReason.ERROR]
    assert "slow node" in outputs[-1].text
    assert engine.allocator.num_used == 0
    engine.check()


def _run_until_finished(loop: EngineLoop, outputs: list[RequestOutput], ids: set[str]) -> None:
    deadline = time.monotonic() + 20
    while {o.request_id for o in outputs if o.finished} != ids and time.monotonic() < deadline:
        time.sleep(0.01)


def test_a_failed_step_fails_its_requests_retryably_and_the_named_culprit_alone_for_good(engine):
    """A step that fails (a transient CUDA OOM) must not fail its requests for good: they fail
    retryably (the router moves them), except a culprit the error names. The loop counts failed
    steps in a row for the router, and a good step sets the count back to 0."""
    from engine.llm_engine import RequestFault

    failures = iter([RuntimeError("CUDA out of memory"), RequestFault("long", "long: CUDA out of memory")])

    def before_step():
        failure = next(failures, None)
        if failure is not None:
            raise failure

    outputs: list[RequestOutput] = []
    loop = EngineLoop(lambda: engine, outputs.extend, name="isolate", before_step=before_step)
    sampling = SamplingParams(max_tokens=4, ignore_eos=True)
    loop.call(lambda e: (e.add_request("short", prompt_token_ids=[4, 5, 6], sampling=sampling),
                         e.add_request("other", prompt_token_ids=[7, 8, 9, 10], sampling=sampling))).result(10)
    _run_until_finished(loop, outputs, {"short", "other"})
    assert [(o.request_id, o.finish_reason, o.retryable) for o in outputs] == [
        ("short", FinishReason.ERROR, True), ("other", FinishReason.ERROR, True)]
    assert loop.beat().failed_steps_in_a_row == 1
    outputs.clear()
    loop.call(lambda e: (e.add_request("long", prompt_token_ids=list(range(4, 40)), sampling=sampling),
                         e.add_request("short2", prompt_token_ids=[4, 5, 6], sampling=sampling))).result(10)
    _run_until_finished(loop, outputs, {"long", "short2"})
    assert [(o.request_id, o.retryable) for o in outputs] == [("long", False), ("short2", True)]
    assert "long: CUDA out of memory" in outputs[0].text
    assert loop.beat().failed_steps_in_a_row == 2
    outputs.clear()
    loop.call(lambda e: e.add_request("fine", prompt_token_ids=[4, 5, 6], sampling=sampling)).result(10)
    _run_until_finished(loop, outputs, {"fine"})
    assert outputs[-1].finish_reason is FinishReason.LENGTH and len([t for o in outputs for t in o.token_ids]) == 4
    assert loop.beat().failed_steps_in_a_row == 0
    loop.stop()
    assert engine.allocator.num_used == 0
    engine.check()


def test_the_beat_comes_from_the_engine_thread_and_goes_silent_while_a_step_hangs(engine):
    """An idle loop beats every BEAT_S; a step that hangs (here a before_step that blocks, as a stuck
    CUDA call would) lets the silence grow though any other thread can still read the beat."""
    import threading

    from worker_runtime.engine_loop import BEAT_S

    release = threading.Event()
    loop = EngineLoop(lambda: engine, lambda outs: None, name="beat", before_step=lambda: release.wait(30))
    first = loop.beat_at
    deadline = time.monotonic() + 10  # bounds a hang only
    while loop.beat_at == first and time.monotonic() < deadline:  # an idle loop stamps again by itself
        time.sleep(BEAT_S / 5)
    idle = loop.beat()
    assert loop.beat_at > first and idle.steps == 0 and idle.name == "beat"
    loop.call(lambda e: e.add_request("hang", prompt_token_ids=[4, 5, 6], sampling=SamplingParams(max_tokens=2)))
    time.sleep(1.0)
    hung = loop.beat()
    assert hung.silent_s >= 0.9 and hung.steps == 0
    released = time.monotonic()
    release.set()
    deadline = time.monotonic() + 10
    while loop.beat().steps < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert loop.beat().steps == 2 and loop.beat_at >= released  # stamped again once the step ended
    loop.stop()
    assert engine.allocator.num_used == 0
