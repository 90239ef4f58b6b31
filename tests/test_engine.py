"""The engine against transformers' generate: greedy float32 tokens must be identical, also
when a request is chunked, preempted, resumed from its outputs, or handed from a prefill-only
request to `add_prefilled`."""

from __future__ import annotations

import random

import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from protocol.outputs import FinishReason, RequestOutput
from protocol.sampling import SamplingParams
from router.config.loader import parse_config
from router.config.typed_yaml import ConfigError
from tests.reference import hf_greedy, record_prefill_chunks


def _prompts(n: int, seed: int, lo: int = 3, hi: int = 60, vocab: int = 2000) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _engine(path: str, **kw) -> LLMEngine:
    kw.setdefault("num_blocks", 256)
    kw.setdefault("dtype", "float32")  # the references' (`auto` is bfloat16 on a CPU with AVX512-BF16 or AMX)
    return LLMEngine(EngineConfig(model_path=path, **kw))


def _run_to_end(engine: LLMEngine) -> dict[str, list[int]]:
    return {rid: [t for o in outs for t in o.token_ids] for rid, outs in _outputs_to_end(engine).items()}


def _outputs_to_end(engine: LLMEngine) -> dict[str, list[RequestOutput]]:
    out: dict[str, list[RequestOutput]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.request_id, []).append(o)
    engine.check()
    assert engine.allocator.num_used == 0, "blocks leaked after every request finished"
    return out


def _tokens(outputs: list[RequestOutput]) -> list[int]:
    return [t for o in outputs for t in o.token_ids]


def _text(outputs: list[RequestOutput]) -> str:
    return "".join(o.text for o in outputs)


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
    # a budget that never binds, so every chunk but a prompt's last is exactly `chunk` tokens
    engine = _engine(llama_dir, chunk_size=chunk, max_num_batched_tokens=1024)
    chunks = record_prefill_chunks(engine)
    for i, p in enumerate(prompts):
        engine.add_request(f"c{i}", prompt_token_ids=p, sampling=SamplingParams(max_tokens=12, ignore_eos=True))
    out = _run_to_end(engine)
    assert [out[f"c{i}"] for i in range(4)] == [hf_greedy(llama_dir, p, 12, ignore_eos=True) for p in prompts]
    for i, p in enumerate(prompts):
        full, rest = divmod(len(p), chunk)
        assert chunks[f"c{i}"] == [chunk] * full + ([rest] if rest else []), f"prompt of {len(p)} tokens"


def _first_token_work(engine: LLMEngine, prompts: list[list[int]]) -> tuple[dict[str, int], int]:
    """Run `prompts` (all waiting at once) to their first token: the prompt tokens computed up to
    and including each one's first-token step (what its time to first token pays for), and the
    most prompts one step left part-way through their prefill."""
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", prompt_token_ids=p, sampling=SamplingParams(max_tokens=2, ignore_eos=True))
    schedule, steps = engine.scheduler.schedule, []

    def recording():
        items = schedule()
        steps.append(items)
        return items
    engine.scheduler.schedule = recording
    work, done, most_partial = {}, 0, 0
    while len(work) < len(prompts):
        outs = engine.step()
        done += sum(it.num_tokens for it in steps[-1] if not it.is_decode)
        most_partial = max(most_partial, sum(it.start + it.num_tokens < it.request.num_prompt_tokens
                                             for it in steps[-1]))
        for o in outs:
            work.setdefault(o.request_id, done)
    _run_to_end(engine)
    return work, most_partial


def test_one_partial_prefill_at_a_time_gives_first_tokens_in_arrival_order(llama_dir):
    """max_num_partial_prefills 1: prompts waiting together are prefilled one after
    another, so the first gets its first token after its own prompt and at most a chunk of the next
    (not after a chunk of every waiting prompt), in arrival order, each step leaving at most one
    prompt part-way; without a limit (the default) every prompt takes a chunk each step."""
    prompts = _prompts(4, seed=44, lo=30, hi=40)
    one = _engine(llama_dir, chunk_size=8, max_num_batched_tokens=64, enable_prefix_caching=False,
                  max_num_partial_prefills=1)
    work, most_partial = _first_token_work(one, prompts)
    assert work["r0"] <= len(prompts[0]) + 8 and most_partial == 1
    assert sorted(work, key=work.get) == ["r0", "r1", "r2", "r3"]
    unlimited = _engine(llama_dir, chunk_size=8, max_num_batched_tokens=64, enable_prefix_caching=False)
    work_all, most_partial_all = _first_token_work(unlimited, prompts)
    assert work_all["r0"] >= 3 * len(prompts[0]) and most_partial_all == 4
    assert sum(work.values()) < sum(work_all.values())


def test_one_partial_prefill_matches_generate(llama_dir):
    prompts = _prompts(4, seed=45, lo=20, hi=60)
    engine = _engine(llama_dir, chunk_size=8, max_num_batched_tokens=64, max_num_partial_prefills=1)
    for i, p in enumerate(prompts):
        engine.add_request(f"c{i}", prompt_token_ids=p, sampling=SamplingParams(max_tokens=8, ignore_eos=True))
    out = _run_to_end(engine)
    assert [out[f"c{i}"] for i in range(4)] == [hf_greedy(llama_dir, p, 8, ignore_eos=True) for p in prompts]
    engine.check()


def test_tiny_pool_waits_and_preempts(llama_dir):
    prompts = _prompts(6, seed=5, lo=20, hi=40)
    # 12 blocks of 8 tokens: each request needs up to 7 blocks, so at most one or two run at once
    engine = _engine(llama_dir, num_blocks=12, block_size=8, max_num_batched_tokens=256)
    reqs = [engine.add_request(f"p{i}", prompt_token_ids=p, sampling=SamplingParams(max_tokens=16, ignore_eos=True))
            for i, p in enumerate(prompts)]
    out: dict[str, list[int]] = {}
    waited_while_others_ran = False
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.token_ids)
        waited_while_others_ran |= engine.num_waiting > 0 and engine.num_running > 0
    engine.check()
    assert engine.allocator.num_used == 0
    assert waited_while_others_ran, "no request ever waited for blocks"
    assert sum(r.num_preemptions for r in reqs) >= 1, "no request was preempted"
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


# ---- resuming a request from outputs made elsewhere ----------------------------------------
@pytest.mark.parametrize("sampling", [
    SamplingParams(max_tokens=10, ignore_eos=True),
    SamplingParams(max_tokens=10, temperature=1.0, top_k=50, seed=3, ignore_eos=True),
], ids=["greedy", "seeded"])
def test_a_resumed_request_continues_as_if_uninterrupted(llama_dir, sampling):
    prompt = _prompts(1, seed=7)[0]
    engine = _engine(llama_dir)
    engine.add_request("whole", prompt_token_ids=prompt, sampling=sampling)
    whole = _outputs_to_end(engine)["whole"]
    tokens = _tokens(whole)
    assert len(tokens) == 10
    if sampling.greedy:
        assert tokens == hf_greedy(llama_dir, prompt, 10, ignore_eos=True)
    for k in (1, 4, 9):
        engine.generate([[9, 8, 7]], SamplingParams(max_tokens=3, temperature=1.0))  # moves the default generator
        sent = _text(whole[:k])
        engine.add_request(f"r{k}", prompt_token_ids=prompt, sampling=sampling, output_token_ids=tokens[:k],
                           emitted_chars=len(sent))
        rest = _outputs_to_end(engine)[f"r{k}"]
        assert _tokens(rest) == tokens[k:], f"resumed after {k} outputs"
        assert sent + _text(rest) == _text(whole)
        assert (rest[-1].finish_reason, rest[-1].num_output_tokens) == (FinishReason.LENGTH, 10)


def test_resumed_outputs_that_already_stop_finish_at_once(llama_dir):
    engine = _engine(llama_dir)
    sampling = SamplingParams(max_tokens=10, stop_token_ids=(500,))
    req = engine.add_request("done", prompt_token_ids=[5, 6, 7], sampling=sampling,
                             output_token_ids=[300, 500, 301], emitted_chars=0)
    assert req.finish_reason is FinishReason.STOP and req.output_token_ids == [300, 500]
    assert "done" not in engine.requests and engine.has_unfinished()
    out = engine.step()
    expected = engine.tokenizer.decode([300, 500], skip_special_tokens=True)
    assert [(o.request_id, o.token_ids, o.text, o.finish_reason) for o in out] == [("done", [], expected, FinishReason.STOP)]
    assert not engine.has_unfinished() and engine.allocator.num_used == 0


def _prompt_with_two_texty_tokens(engine: LLMEngine, sampling: SamplingParams) -> tuple[list[int], list[str]]:
    """A prompt whose first greedy output decodes to >= 2 characters and the second to >= 1, with
    no copy of the 2 characters around the token boundary in the first token's text."""
    for seed in range(100):
        prompt = _prompts(1, seed=100 + seed, lo=5, hi=30)[0]
        rid = engine.add_request(f"probe{seed}", prompt_token_ids=prompt, sampling=sampling).request_id
        deltas = [o.text for o in _outputs_to_end(engine)[rid]]
        if len(deltas[0]) >= 2 and deltas[1] and deltas[0][-1] + deltas[1][0] not in deltas[0]:
            return prompt, deltas
    raise AssertionError("no prompt gives two tokens with text")


def _hand_off(engine: LLMEngine, prompt: list[int], sampling: SamplingParams) -> tuple[RequestOutput, list[RequestOutput]]:
    """Prefill `prompt` as a prefill-only request, move its KV into another request's reserved
    blocks, admit that one with `add_prefilled`, and run it to the end."""
    engine.add_request("pre", prompt_token_ids=prompt, sampling=sampling, prefill_only=True)
    (prefilled,) = engine.step()
    assert prefilled.finish_reason is FinishReason.PREFILLED
    dst, _ = engine.reserve("dec", len(prompt) + sampling.max_tokens)
    src = engine.requests["pre"].block_ids
    n = engine.blocks_for(len(prompt))
    kv = engine.runner.kv  # [num_blocks, layers, 2, block_size, kv_heads, head_dim]
    kv[dst[:n]] = kv[src[:n]]
    engine.release("pre")
    engine.add_prefilled("dec", prompt, prefilled.token_ids, sampling, emitted_chars=len(prefilled.text))
    return prefilled, _outputs_to_end(engine)["dec"]


def test_prefill_only_prompts_go_whole_unless_a_request_is_decoding(llama_dir):
    """A disaggregated prefill worker's requests (prefill-only, nothing decoding) take their whole
    prompts in one step past chunk_size; next to a decoding request they are cut into chunks again,
    and the tokens are the same either way."""
    engine = _engine(llama_dir, chunk_size=8, enable_prefix_caching=False)  # pre2 computes all its prompt
    prompts = _prompts(2, seed=41, lo=20, hi=30)
    sampling = SamplingParams(max_tokens=4, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"pre{i}", prompt_token_ids=prompt, sampling=sampling, prefill_only=True)
    outs = engine.step()
    assert [o.finish_reason for o in outs] == [FinishReason.PREFILLED] * 2  # one step, both whole
    whole = [o.token_ids for o in outs]
    for i in range(2):
        engine.release(f"pre{i}")
    engine.add_request("dec", prompt_token_ids=prompts[0][:5], sampling=SamplingParams(max_tokens=8, ignore_eos=True))
    engine.step()  # "dec" is decoding from here on
    engine.add_request("pre2", prompt_token_ids=prompts[1], sampling=sampling, prefill_only=True)
    steps = 0
    while "pre2" not in {o.request_id for o in engine.step()}:
        steps += 1
    assert steps == -(-len(prompts[1]) // 8) - 1  # in chunks of 8
    assert engine.requests["pre2"].output_token_ids == whole[1]
    engine.release("pre2")
    _outputs_to_end(engine)


def test_chunk_prefill_workers_cuts_prefill_only_prompts_into_chunks(llama_dir):
    """`chunk_prefill_workers`: a prefill worker's prompts are cut into chunk_size chunks as a
    decoding worker's are (the simulated GPU's chunked arrangements ask for it), same tokens."""
    prompt = _prompts(1, seed=43, lo=20, hi=30)[0]
    sampling = SamplingParams(max_tokens=4, ignore_eos=True)
    ids = {}
    for chunked in (False, True):
        engine = _engine(llama_dir, chunk_size=8, enable_prefix_caching=False, chunk_prefill_workers=chunked)
        engine.add_request("pre", prompt_token_ids=prompt, sampling=sampling, prefill_only=True)
        steps = 1
        while not (outs := [o for o in engine.step() if o.request_id == "pre"]):
            steps += 1
        assert steps == (-(-len(prompt) // 8) if chunked else 1)
        assert outs[0].finish_reason == FinishReason.PREFILLED
        ids[chunked] = outs[0].token_ids
        engine.release("pre")
    assert ids[True] == ids[False]
    cfg = parse_config({"scheduler": {"chunk_prefill_workers": True}})
    assert cfg.engine_config(cfg.prefill).chunk_prefill_workers


def test_hand_off_streams_every_character_once(llama_dir):
    engine = _engine(llama_dir)
    sampling = SamplingParams(max_tokens=12, ignore_eos=True, stop=("\x00never",))  # holds back 5 characters
    prompt, _ = _prompt_with_two_texty_tokens(engine, sampling)
    engine.add_request("whole", prompt_token_ids=prompt, sampling=sampling)
    whole = _outputs_to_end(engine)["whole"]
    prefilled, decoded = _hand_off(engine, prompt, sampling)
    assert prefilled.text == whole[0].text  # what an unfinished request would send: the held back part stays
    assert prefilled.token_ids + _tokens(decoded) == _tokens(whole) == hf_greedy(llama_dir, prompt, 12, ignore_eos=True)
    assert prefilled.text + _text(decoded) == _text(whole)
    assert decoded[-1].finish_reason is FinishReason.LENGTH


def test_a_stop_string_across_the_hand_off_never_leaks(llama_dir):
    engine = _engine(llama_dir)
    prompt, deltas = _prompt_with_two_texty_tokens(engine, SamplingParams(max_tokens=2, ignore_eos=True))
    stop = deltas[0][-1] + deltas[1][0]  # starts in the prefill worker's token, ends in the decoder's
    sampling = SamplingParams(max_tokens=12, ignore_eos=True, stop=(stop,))
    prefilled, decoded = _hand_off(engine, prompt, sampling)
    assert prefilled.text == deltas[0][:-1]
    assert _text(decoded) == ""  # the text ends right before the stop string: nothing more to send
    assert len(_tokens(decoded)) == 1 and decoded[-1].finish_reason is FinishReason.STOP


def test_add_prefilled_of_a_finished_request_frees_its_blocks(llama_dir):
    engine = _engine(llama_dir)
    engine.reserve("full", 20)
    req = engine.add_prefilled("full", [5, 6, 7], [300, 301, 302], SamplingParams(max_tokens=3), emitted_chars=1)
    assert req.finish_reason is FinishReason.LENGTH and engine.allocator.num_used == 0 and not engine.reserved
    text = engine.tokenizer.decode([300, 301, 302], skip_special_tokens=True)
    assert [(o.token_ids, o.text, o.finish_reason, o.num_output_tokens) for o in engine.step()] == [
        ([], text[1:], FinishReason.LENGTH, 3)]
    assert not engine.has_unfinished()
    engine.check()


def test_add_prefilled_refusals_keep_the_reservation(llama_dir):
    engine = _engine(llama_dir, block_size=4)
    with pytest.raises(KeyError, match="no KV reservation"):
        engine.add_prefilled("none", [5, 6], [7], SamplingParams())
    blocks, _ = engine.reserve("r", 8)  # 2 blocks
    with pytest.raises(ValueError, match="reserved 2 blocks, too few for 9 tokens"):
        engine.add_prefilled("r", list(range(5, 13)), [20, 21], SamplingParams())
    with pytest.raises(ValueError, match="at least the first output token"):
        engine.add_prefilled("r", [5, 6], [], SamplingParams())
    assert engine.reserved == {"r": blocks}
    engine.check()


def test_blocks_owed_counts_what_admitted_requests_will_still_take(llama_dir):
    """A prompt allocates chunk by chunk, so `num_free` overstates the room for a new request until
    its prefill ends; `blocks_owed` (in the worker's stats, subtracted by the router's placement)
    is exactly the blocks the running prompts and the waiting requests still need. Exact counts:
    16-token blocks, 32-token chunks, a 100-token prompt (7 blocks) and a 40-token one waiting."""
    engine = _engine(llama_dir, block_size=16, chunk_size=32, max_num_batched_tokens=32, max_num_seqs=1)
    (a,), (b,) = _prompts(1, seed=9, lo=100, hi=100), _prompts(1, seed=10, lo=40, hi=40)
    engine.add_request("a", prompt_token_ids=a, sampling=SamplingParams(max_tokens=2, ignore_eos=True))
    engine.add_request("b", prompt_token_ids=b, sampling=SamplingParams(max_tokens=2, ignore_eos=True))
    assert (engine.allocator.num_used, engine.scheduler.blocks_owed()) == (0, 7 + 3)
    owed = []
    while engine.num_waiting:  # one sequence at a time: "b" waits until "a" ends
        engine.step()
        owed.append((engine.allocator.num_used, engine.scheduler.blocks_owed()))
    # a's chunks of 32, 32, 32, 4 tokens take 2, 2, 2, 1 blocks; the rest of its 7 and b's 3 are owed
    assert owed[:4] == [(2, 5 + 3), (4, 3 + 3), (6, 1 + 3), (7, 0 + 3)]
    _run_to_end(engine)


@pytest.mark.parametrize("value, message", [
    (0, "scheduler.max_num_partial_prefills: must be >= 1, or null"),
    ("one", "scheduler.max_num_partial_prefills: expected an integer"),
])
def test_a_bad_partial_prefill_limit_names_the_key(value, message):
    with pytest.raises(ConfigError, match=message):
        parse_config({"scheduler": {"max_num_partial_prefills": value}})


def test_the_partial_prefill_limit_reaches_the_engine():
    assert parse_config({}).engine_config(parse_config({}).decode).max_num_partial_prefills is None
    one = parse_config({"scheduler": {"max_num_partial_prefills": 1}})
    assert one.engine_config(one.decode).max_num_partial_prefills == 1


def test_the_step_budget_is_by_device_unless_set():
    """`scheduler.max_num_batched_tokens: auto` (the default): 512 tokens a step on a CPU worker,
    8,192 on a GPU worker or an emulated one; a number is taken as it is, everywhere."""
    cpu = parse_config({})
    assert cpu.scheduler.max_num_batched_tokens == "auto" and cpu.engine_config(cpu.decode).max_num_batched_tokens == 512
    gpu = parse_config({"decode": {"num_gpus": 1}})
    assert gpu.engine_config(gpu.decode).max_num_batched_tokens == 8192
    assert gpu.engine_config(gpu.prefill).max_num_batched_tokens == 512  # a CPU pool beside it
    emulated = parse_config({"emulate": {"device": "h100"}})
    assert emulated.step_tokens(emulated.prefill) == emulated.step_tokens(emulated.decode) == 8192
    for cfg in (parse_config({"scheduler": {"max_num_batched_tokens": 1024}}),
                parse_config({"scheduler": {"max_num_batched_tokens": 1024}, "emulate": {"device": "h100"}})):
        assert cfg.engine_config(cfg.decode).max_num_batched_tokens == cfg.step_tokens(cfg.prefill) == 1024


@pytest.mark.parametrize(("value", "message"), [
    (0, "scheduler.max_num_batched_tokens: must be auto or >= 1"),
    ("many", "scheduler.max_num_batched_tokens"),
])
def test_a_bad_step_budget_names_the_key(value, message):
    with pytest.raises(ConfigError, match=message):
        parse_config({"scheduler": {"max_num_batched_tokens": value}})
