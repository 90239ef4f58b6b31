"""The engine against transformers' generate: greedy float32 tokens must be identical."""

from __future__ import annotations

import random

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from tests.reference import hf_greedy


def _prompts(n: int, seed: int, lo: int = 3, hi: int = 60, vocab: int = 2000) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _engine(path: str, **kw) -> LLMEngine:
    kw.setdefault("num_blocks", 256)
    return LLMEngine(EngineConfig(model_path=path, **kw))


def _run_to_end(engine: LLMEngine) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.token_ids)
    engine.check()
    assert engine.allocator.num_used == 0, "blocks leaked after every request finished"
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_single_request_matches_generate(model_dirs, arch):
    path = model_dirs[arch]
    prompt = _prompts(1, seed=1)[0]
    got = _engine(path).generate([prompt], SamplingParams(max_tokens=24))[0]
    assert got == hf_greedy(path, prompt, 24)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_eight_batched_requests_match_generate(model_dirs, arch):
    path = model_dirs[arch]
    prompts = _prompts(8, seed=2, lo=1, hi=90)
    engine = _engine(path, max_num_batched_tokens=1024)
    got = engine.generate(prompts, SamplingParams(max_tokens=20, ignore_eos=True))
    assert got == [hf_greedy(path, p, 20, ignore_eos=True) for p in prompts]


def test_requests_arriving_while_others_decode(llama_dir):
    prompts = _prompts(6, seed=3)
    engine = _engine(llama_dir)
    sampling = SamplingParams(max_tokens=16, ignore_eos=True)
    out: dict[str, list[int]] = {}
    pending = list(enumerate(prompts))
    while pending or engine.has_unfinished():
        if pending:  # one new arrival every step, joining the running batch
            i, p = pending.pop(0)
            engine.add_request(f"r{i}", prompt_token_ids=p, sampling=sampling)
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.token_ids)
    assert [out[f"r{i}"] for i in range(6)] == [hf_greedy(llama_dir, p, 16, ignore_eos=True) for p in prompts]
    engine.check()


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_prefill_matches_generate(llama_dir, chunk):
    prompts = _prompts(4, seed=4, lo=40, hi=150)
    engine = _engine(llama_dir, chunk_size=chunk, max_num_batched_tokens=max(chunk, 16))
    for i, p in enumerate(prompts):
        engine.add_request(f"c{i}", prompt_token_ids=p, sampling=SamplingParams(max_tokens=12, ignore_eos=True))
    out = _run_to_end(engine)
    assert [out[f"c{i}"] for i in range(4)] == [hf_greedy(llama_dir, p, 12, ignore_eos=True) for p in prompts]


def test_tiny_pool_waits_and_preempts(llama_dir):
    prompts = _prompts(6, seed=5, lo=20, hi=40)
    # 12 blocks of 8 tokens: each request needs up to 7 blocks, so at most one or two run at once
    engine = _engine(llama_dir, num_blocks=12, block_size=8, max_num_batched_tokens=256)
    for i, p in enumerate(prompts):
        engine.add_request(f"p{i}", prompt_token_ids=p, sampling=SamplingParams(max_tokens=16, ignore_eos=True))
    out = _run_to_end(engine)
    assert [out[f"p{i}"] for i in range(6)] == [hf_greedy(llama_dir, p, 16, ignore_eos=True) for p in prompts]


def test_preemption_recomputes_exactly(llama_dir):
    # two requests whose decodes outgrow a 6-block pool together: one must be preempted
    prompts = _prompts(2, seed=6, lo=14, hi=16)
    engine = _engine(llama_dir, num_blocks=6, block_size=8)
    reqs = [engine.add_request(f"q{i}", prompt_token_ids=p, sampling=SamplingParams(max_tokens=30, ignore_eos=True))
            for i, p in enumerate(prompts)]
    out = _run_to_end(engine)
    assert sum(r.num_preemptions for r in reqs) >= 1
    assert [out["q0"], out["q1"]] == [hf_greedy(llama_dir, p, 30, ignore_eos=True) for p in prompts]
