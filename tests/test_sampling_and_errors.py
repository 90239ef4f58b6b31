"""Sampling (seeded reproducibility, top-k/top-p support sets), stop handling, bad requests."""

from __future__ import annotations

import time

import pytest
import torch

from engine import EngineConfig, InvalidRequest, LLMEngine, SamplingParams
from engine.request import Request
from engine.sampler import sample


@pytest.fixture(scope="module")
def engine(llama_dir) -> LLMEngine:
    return LLMEngine(EngineConfig(model_path=llama_dir, num_blocks=128))


def test_same_seed_same_tokens(engine):
    sp = SamplingParams(max_tokens=20, temperature=1.0, seed=1234, ignore_eos=True)
    prompt = [[5, 6, 7, 8, 9]]
    first, second = engine.generate(prompt, sp)[0], engine.generate(prompt, sp)[0]
    other = engine.generate(prompt, SamplingParams(max_tokens=20, temperature=1.0, seed=99, ignore_eos=True))[0]
    assert first == second
    assert first != other


def _req(sp: SamplingParams, seed: int) -> Request:
    return Request("x", [1], sp, detokenizer=None, generator=torch.Generator().manual_seed(seed))


def test_top_k_never_leaves_the_k_best():
    logits = torch.randn(1, 500, generator=torch.Generator().manual_seed(0))
    allowed = set(torch.topk(logits[0], 5).indices.tolist())
    sp = SamplingParams(temperature=2.0, top_k=5)
    seen = {sample(logits, [_req(sp, s)], torch.Generator())[0] for s in range(300)}
    assert seen <= allowed and len(seen) > 1


def test_top_p_never_leaves_the_nucleus():
    probs = torch.tensor([0.5, 0.3, 0.1, 0.05, 0.05])
    logits = probs.log()[None]
    sp = SamplingParams(temperature=1.0, top_p=0.75)  # nucleus = {0, 1}: 0.5 + 0.3 reaches 0.75
    seen = {sample(logits, [_req(sp, s)], torch.Generator())[0] for s in range(300)}
    assert seen == {0, 1}


def test_stop_token_and_max_tokens(engine):
    greedy = engine.generate([[11, 12, 13]], SamplingParams(max_tokens=10, ignore_eos=True))[0]
    stop_at = greedy[3]
    cut = engine.generate([[11, 12, 13]], SamplingParams(max_tokens=10, stop_token_ids=(stop_at,), ignore_eos=True))[0]
    assert cut == greedy[:greedy.index(stop_at) + 1]


def test_stop_string_cuts_text_and_never_leaks(engine):
    req = engine.add_request("s0", prompt_token_ids=[21, 22, 23], sampling=SamplingParams(max_tokens=30, ignore_eos=True))
    texts, full = [], ""
    while engine.has_unfinished():
        for o in engine.step():
            full += o.text
    assert req.finish_reason == "length"
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
    assert reasons[-1] == "stop"
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
])
def test_bad_requests_are_refused_without_disturbing_others(engine, kwargs, message):
    good = engine.add_request("good", prompt_token_ids=[3, 4, 5], sampling=SamplingParams(max_tokens=4))
    engine.step()
    with pytest.raises(InvalidRequest, match=message):
        engine.add_request("bad", **kwargs)
    while engine.has_unfinished():
        engine.step()
    assert good.finish_reason in ("length", "stop") and len(good.output_token_ids) >= 1
    engine.check()
    assert engine.allocator.num_used == 0


def test_abort_frees_blocks(engine):
    engine.add_request("a", prompt_token_ids=list(range(10, 60)), sampling=SamplingParams(max_tokens=50))
    engine.step()
    assert engine.allocator.num_used > 0
    out = engine.abort("a")
    assert out.finish_reason == "abort"
    assert not engine.has_unfinished() and engine.allocator.num_used == 0
    engine.check()


def test_reserve_release_and_prefill_only_accounting(engine):
    blocks = engine.reserve("res", num_tokens=40)  # 40 tokens of 16 -> 3 blocks
    assert len(blocks) == 3 and engine.allocator.num_used == 3
    engine.check()
    engine.release("res")
    assert engine.allocator.num_used == 0
    req = engine.add_request("pre", prompt_token_ids=list(range(5, 40)), prefill_only=True,
                             sampling=SamplingParams(max_tokens=8, ignore_eos=True))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert [o.finish_reason for o in outs] == ["prefilled"] and len(outs[0].token_ids) == 1
    assert engine.allocator.num_used == len(req.block_ids) == 3  # kept for the KV push
    engine.check()
    engine.release("pre")
    assert engine.allocator.num_used == 0
    engine.check()


def test_a_failing_step_fails_its_requests_and_the_loop_lives_on(engine, monkeypatch):
    from engine.loop import EngineLoop

    outputs = []
    loop = EngineLoop(engine, outputs.extend, name="test")
    real_execute = engine.runner.execute

    def broken(items):
        raise RuntimeError("boom")

    monkeypatch.setattr(engine.runner, "execute", broken)
    loop.call(lambda e: e.add_request("f", prompt_token_ids=[4, 5, 6], sampling=SamplingParams(max_tokens=3))).result(10)
    deadline = time.monotonic() + 10
    while not outputs and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("f", "error")] and "boom" in outputs[0].text
    monkeypatch.setattr(engine.runner, "execute", real_execute)
    assert loop.call(lambda e: e.allocator.num_used).result(10) == 0  # its blocks came back
    loop.call(lambda e: e.check()).result(10)
    loop.stop()
