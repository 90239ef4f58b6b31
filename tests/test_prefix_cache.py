"""Prefix caching: the allocator's refcounts, LRU eviction and cache events with exact block ids,
then the engine, whose greedy float32 tokens must not change when KV comes from the cache (vs
transformers' generate and vs the same engine with caching off), with `check()` after every step."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from engine.config import EngineConfig
from engine.kv_cache import BlockAllocator
from engine.llm_engine import LLMEngine
from protocol.block_hash import ROOT, block_hashes, extend_hashes
from protocol.messages import CacheDelta
from protocol.outputs import RequestOutput
from protocol.sampling import SamplingParams
from tests.reference import hf_greedy
from worker_runtime.core import WorkerCore

H = [bytes([i]) * 16 for i in range(8)]  # stand-in hashes for the allocator tests


# ---- block hashes --------------------------------------------------------------------------
def test_block_hashes_are_chained_per_full_block():
    tokens = list(range(100, 111))  # 2 full blocks of 4 and a partial one
    hashes = block_hashes(tokens, 4)
    assert len(hashes) == 2 and all(len(h) == 16 for h in hashes)
    assert block_hashes(tokens[4:8], 4, parent=hashes[0]) == hashes[1:]
    assert block_hashes([100, 101, 102, 103], 4, parent=ROOT) == hashes[:1]
    assert block_hashes([999] + tokens[1:], 4)[1] != hashes[1], "a block's hash must depend on its history"
    grown: list[bytes] = []
    for upto in (3, 5, 11, 11):
        extend_hashes(grown, tokens, 4, upto)
        assert grown == hashes[:upto // 4]


# ---- the allocator ---------------------------------------------------------------------------
def test_refcounts_and_lru_eviction_order():
    a = BlockAllocator(4)
    x = a.allocate(2, "x")
    assert x == [0, 1] and a.cache(0, H[0]) and a.cache(1, H[1])
    assert a.allocate(1, "y") == [2] and a.cache(2, H[2])
    hits = a.match([H[0], H[1], H[5], H[2]])
    assert hits == [0, 1]  # stops at the first miss
    a.acquire(hits)
    assert [a.refcount(b) for b in range(4)] == [2, 2, 1, 0]
    a.free(x[::-1])
    assert (a.num_used, a.num_evictable) == (3, 0)
    a.free([1, 0])  # tail first: block 1 becomes the oldest
    a.free([2])
    assert (a.num_free, a.num_used, a.num_cached, a.num_evictable) == (4, 0, 3, 3)
    assert a.allocate(2, "z") == [3, 1]  # the never-cached block first, then the least recently used
    assert a.match([H[0], H[1]]) == [0] and a.num_cached == 2
    a.acquire([0])  # leaves the evictable list
    assert a.num_free == 1 and a.allocate(2, "w") is None and a.num_free == 1  # nothing taken
    assert a.fits(1) and not a.fits(1, acquiring=[2]) and a.fits(1, acquiring=[0])
    a.check()


def test_cache_refuses_a_hash_cached_elsewhere_and_a_second_hash():
    a = BlockAllocator(3)
    ids = a.allocate(2, "x")
    assert a.cache(ids[0], H[0])
    assert not a.cache(ids[1], H[0]), "the same KV cached twice"
    assert not a.cache(ids[0], H[1]), "a block holds one hash"
    a.free(ids)
    assert (a.num_cached, a.num_evictable) == (1, 1)
    assert a.allocate(2, "y") == [2, 1]  # the uncached duplicate went back to the plain free list
    a.check()


def test_double_free_and_acquiring_a_free_block_are_caught():
    a = BlockAllocator(2)
    ids = a.allocate(1, "x")
    a.free(ids)
    with pytest.raises(AssertionError, match="freed twice"):
        a.free(ids)
    with pytest.raises(AssertionError, match="free and not cached"):
        a.acquire(ids)


def test_events_are_net_changes_since_the_last_drain():
    a = BlockAllocator(3)
    ids = a.allocate(3, "x")
    for b in ids:
        a.cache(b, H[b])
    assert a.drain_events() == ([H[0], H[1], H[2]], [])
    assert a.drain_events() == ([], [])
    a.free(ids)
    a.allocate(1, "y")  # evicts block 0
    assert a.drain_events() == ([], [H[0]])
    (b,) = a.allocate(1, "z")  # evicts block 1 ...
    a.cache(b, H[1])  # ... and the same KV is cached again in the same window: no net change
    (c,) = a.allocate(1, "w")  # evicts block 2
    a.cache(c, H[5])
    a.free([c])
    assert a.allocate(1, "v") == [c]  # evicts H[5], stored in this window: it never shows
    assert a.drain_events() == ([], [H[2]])
    assert sorted(a.cached_hashes()) == [H[1]]
    a.check()


def test_caching_off_behaves_like_a_plain_allocator():
    a = BlockAllocator(3, enable_caching=False)
    ids = a.allocate(2, "x")
    assert not a.cache(ids[0], H[0]) and a.match([H[0]]) == []
    a.free(ids[::-1])
    assert (a.num_free, a.num_cached, a.num_evictable) == (3, 0, 0)
    assert a.allocate(3, "y") == [2, 1, 0]
    assert a.drain_events() == ([], []) and a.cached_hashes() == []
    a.check()


def _corrupt(a: BlockAllocator, how: str) -> None:
    if how == "used block on the free list":
        a._free.append(0)
    elif how == "used block evictable":
        a._evictable[0] = None
    elif how == "free block twice":
        a._free.append(a._free[0])
    elif how == "maps disagree":
        a._block_of[H[7]] = 0
    elif how == "evictable without hash":
        a._refs[2] = 0
        a._evictable[2] = None
    elif how == "hashed block on the plain free list":
        a._hash_of[3], a._block_of[H[3]] = H[3], 3


@pytest.mark.parametrize("how", ["used block on the free list", "used block evictable", "free block twice",
                                 "maps disagree", "evictable without hash", "hashed block on the plain free list"])
def test_check_detects_corruption(how):
    a = BlockAllocator(5)
    ids = a.allocate(3, "x")
    a.cache(ids[0], H[0])
    a.check()
    _corrupt(a, how)
    with pytest.raises(AssertionError):
        a.check()


# ---- the engine ----------------------------------------------------------------------------
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 2000) for _ in range(n)]


def _engine(path: str, caching: bool = True, **kw) -> LLMEngine:
    kw.setdefault("num_blocks", 64)
    kw.setdefault("block_size", 4)
    return LLMEngine(EngineConfig(model_path=path, dtype="float32", enable_prefix_caching=caching, **kw))


Arrival = tuple[str, list[int], SamplingParams]


def _drive(engine: LLMEngine, arrivals: dict[int, list[Arrival]], on_step=None) -> dict[str, list[RequestOutput]]:
    """Add each arrival before step number k, run to the end, `check()` after every step."""
    out: dict[str, list[RequestOutput]] = {}
    pending, step = dict(arrivals), 0
    while pending or engine.has_unfinished():
        for rid, prompt, sampling in pending.pop(step, []):
            engine.add_request(rid, prompt_token_ids=prompt, sampling=sampling)
        for o in engine.step():
            out.setdefault(o.request_id, []).append(o)
        engine.check()
        if on_step is not None:
            on_step(step)
        step += 1
    assert engine.allocator.num_used == 0, "blocks leaked after every request finished"
    return out


def _tokens(outputs: list[RequestOutput]) -> list[int]:
    return [t for o in outputs for t in o.token_ids]


def _cached(outputs: list[RequestOutput]) -> int:
    counts = {o.num_cached_tokens for o in outputs}
    assert len(counts) == 1, f"outputs of one request disagree on its cached tokens: {counts}"
    return counts.pop()


@pytest.mark.parametrize("length, cached", [(22, 20), (24, 20)])  # the last token is always computed
def test_full_prefix_hit(llama_dir, length, cached):
    prompt = _prompt(1, length)
    engine = _engine(llama_dir)
    out = _drive(engine, {0: [("a", prompt, GREEDY)], 1: [("b", prompt, GREEDY)], 12: [("c", prompt, GREEDY)]})
    expected = hf_greedy(llama_dir, prompt, 8, ignore_eos=True)
    assert [_tokens(out[r]) for r in "abc"] == [expected] * 3
    assert [_cached(out[r]) for r in "abc"] == [0, cached, cached]
    assert (engine.prefix_stats.query_tokens, engine.prefix_stats.hit_tokens) == (3 * length, 2 * cached)


def test_partial_hit_counts_whole_blocks(llama_dir):
    shared = _prompt(2, 10)  # 2 full blocks of 4, the third differs
    a, b = shared + _prompt(3, 9), shared + _prompt(4, 13)
    engine = _engine(llama_dir)
    out = _drive(engine, {0: [("a", a, GREEDY)], 3: [("b", b, GREEDY)]})
    assert (_cached(out["a"]), _cached(out["b"])) == (0, 8)
    assert [_tokens(out["a"]), _tokens(out["b"])] == [hf_greedy(llama_dir, p, 8, ignore_eos=True) for p in (a, b)]


def test_the_next_turn_hits_the_previous_outputs(llama_dir):
    first = _prompt(5, 13)
    engine = _engine(llama_dir)
    reply = _tokens(_drive(engine, {0: [("t1", first, GREEDY)]})["t1"])
    # KV exists for the prompt and all outputs but the last: 13 + 7 = 20 tokens, 5 full blocks
    second = first + reply + _prompt(6, 5)
    out = _drive(engine, {0: [("t2", second, GREEDY)]})
    assert _cached(out["t2"]) == 20
    assert _tokens(out["t2"]) == hf_greedy(llama_dir, second, 8, ignore_eos=True)


def _record_schedule(engine: LLMEngine) -> dict[str, list[tuple[int, list[int]]]]:
    """Wrap the scheduler: (start, block table) of every prefill chunk it schedules, per request."""
    seen: dict[str, list[tuple[int, list[int]]]] = {}
    schedule = engine.scheduler.schedule

    def recording():
        items = schedule()
        for it in items:
            if not it.is_decode:
                seen.setdefault(it.request.request_id, []).append((it.start, list(it.request.block_ids)))
        return items

    engine.scheduler.schedule = recording
    return seen


def test_eviction_under_pressure_takes_the_least_recently_used_tails_first(llama_dir):
    a, b = _prompt(7, 15), _prompt(8, 30)
    engine = _engine(llama_dir, num_blocks=10)
    alloc, chunks = engine.allocator, _record_schedule(engine)
    short = SamplingParams(max_tokens=2, ignore_eos=True)
    out = _drive(engine, {0: [("a", a, short)]})
    # a: 15 prompt + 1 output tokens computed -> blocks 0-3 all full and cached, freed tail first
    assert chunks["a"] == [(0, [0, 1, 2, 3])] and (alloc.num_cached, alloc.num_evictable) == (4, 4)
    out |= _drive(engine, {0: [("b", b, SamplingParams(max_tokens=1))]})
    # b needs 8 blocks: the 6 never-cached ones, then a's two least recently used (its tail)
    assert chunks["b"] == [(0, [4, 5, 6, 7, 8, 9, 3, 2])]
    assert alloc.num_cached == 2 + 7  # a's head blocks, b's full ones (its block 2 is partial)
    out |= _drive(engine, {0: [("c", a, short)]})
    # c hits a's surviving head, takes b's uncached partial block, then evicts the oldest (3)
    assert _cached(out["c"]) == 8 and chunks["c"] == [(8, [0, 1, 2, 3])]
    assert (alloc.num_cached, alloc.num_evictable, alloc.num_free, alloc.num_used) == (10, 10, 10, 0)
    assert _tokens(out["a"]) == _tokens(out["c"]) == hf_greedy(llama_dir, a, 2, ignore_eos=True)
    assert _tokens(out["b"]) == hf_greedy(llama_dir, b, 1)


def _run_shared(path: str, caching: bool, a: list[int], b: list[int]):
    """a prefills in chunks of 8 over steps 0-3, then decodes; b (sharing a's head) and c (a's
    prompt again) arrive during a's decode. The outputs, the chunks, and the refcounts of a's
    first 7 blocks at every step that all three run."""
    engine = _engine(path, caching=caching, chunk_size=8)
    chunks = _record_schedule(engine)
    refs: list[list[int]] = []

    def watch(step: int) -> None:
        if {"a", "b", "c"} <= engine.requests.keys():
            ra, rb, rc = (engine.requests[r] for r in "abc")
            assert not caching or rb.block_ids[:6] == ra.block_ids[:6] and rc.block_ids[:7] == ra.block_ids[:7]
            refs.append([engine.allocator.refcount(x) for x in ra.block_ids[:7]])

    sampling = SamplingParams(max_tokens=12, ignore_eos=True)
    out = _drive(engine, {0: [("a", a, sampling)], 5: [("b", b, sampling), ("c", a, sampling)]}, watch)
    return out, {r: [start for start, _ in c] for r, c in chunks.items()}, refs


def test_a_shared_prefix_under_chunked_prefill_and_concurrent_decode(llama_dir):
    a = _prompt(9, 30)
    b = a[:26] + _prompt(10, 14)  # shares 6 full blocks with a
    out, starts, refs = _run_shared(llama_dir, True, a, b)
    assert [_cached(out[r]) for r in "abc"] == [0, 24, 28]
    assert starts == {"a": [0, 8, 16, 24], "b": [24, 32], "c": [28]}
    assert refs and refs[0] == [3] * 6 + [2]  # blocks 0-5 held by all three, block 6 by a and c
    off, off_starts, _ = _run_shared(llama_dir, False, a, b)
    assert [_cached(off[r]) for r in "abc"] == [0, 0, 0] and off_starts["c"] == [0, 8, 16, 24]
    tokens = {r: _tokens(out[r]) for r in "abc"}
    assert tokens == {r: _tokens(off[r]) for r in "abc"}
    assert tokens["b"] == hf_greedy(llama_dir, b, 12, ignore_eos=True)
    assert tokens["a"] == tokens["c"] == hf_greedy(llama_dir, a, 12, ignore_eos=True)


def test_preempting_a_request_that_shares_blocks(llama_dir):
    shared = _prompt(11, 12)
    a, b = shared + [7, 8], shared + [9, 10]
    sampling = SamplingParams(max_tokens=20, ignore_eos=True)
    # b runs one step behind a: at step 16 a holds 8 blocks and b 8, 3 of them shared: 13 > 12
    engine = _engine(llama_dir, num_blocks=12)
    reqs = {}

    def grab(step: int) -> None:
        reqs.update(engine.requests)

    out = _drive(engine, {0: [("a", a, sampling)], 1: [("b", b, sampling)]}, grab)
    assert reqs["b"].num_preemptions >= 1, "the pool did not force a preemption"
    assert (_cached(out["a"]), _cached(out["b"])) == (0, 12)
    assert engine.prefix_stats.hit_tokens == 12, "a re-admission is not a new lookup"
    assert [_tokens(out["a"]), _tokens(out["b"])] == [hf_greedy(llama_dir, p, 20, ignore_eos=True) for p in (a, b)]
    off = _drive(_engine(llama_dir, caching=False, num_blocks=12), {0: [("a", a, sampling)], 1: [("b", b, sampling)]})
    assert [_tokens(off["a"]), _tokens(off["b"])] == [_tokens(out["a"]), _tokens(out["b"])]


# ---- disaggregation: reserve, release, add_prefilled -------------------------------------------
def test_reserve_with_token_ids_takes_cached_blocks_first(llama_dir):
    prompt = _prompt(12, 22)
    engine = _engine(llama_dir)
    _drive(engine, {0: [("a", prompt, SamplingParams(max_tokens=1))]})
    cached = engine.allocator.match(block_hashes(prompt, 4))
    assert len(cached) == 5
    blocks, n = engine.reserve("r", 30, token_ids=prompt)
    assert n == 5 and blocks[:5] == cached and len(blocks) == 8
    assert [engine.allocator.refcount(b) for b in blocks] == [1] * 8
    engine.check()
    engine.release("r")
    assert engine.allocator.num_used == 0 and engine.allocator.num_cached == 5
    blocks, n = engine.reserve("s", 30)  # no token ids: nothing cached
    assert n == 0 and not set(blocks) & set(cached)
    engine.release("s")
    engine.check()


def _hand_off(src: LLMEngine, dst: LLMEngine, prompt: list[int], sampling: SamplingParams) -> tuple[int, list[int]]:
    """Prefill on `src`, push the KV of the blocks `dst` lacks, decode on `dst`; (cached blocks, tokens)."""
    src.add_request("pre", prompt_token_ids=prompt, sampling=sampling, prefill_only=True)
    (pre,) = src.step()
    src.check()
    dst_blocks, n = dst.reserve("dec", len(prompt) + sampling.max_tokens, token_ids=prompt)
    k = src.blocks_for(len(prompt))
    # [num_blocks, layers, 2, block_size, kv_heads, head_dim]
    dst.runner.kv[dst_blocks[n:k]] = src.runner.kv[src.requests["pre"].block_ids[n:k]]
    src.release("pre")
    dst.add_prefilled("dec", prompt, pre.token_ids, sampling)
    dst.check()
    return n, pre.token_ids + _tokens(_drive(dst, {})["dec"])


def test_add_prefilled_registers_the_pushed_blocks(llama_dir):
    prompt = _prompt(13, 21)
    sampling = SamplingParams(max_tokens=6, ignore_eos=True)
    src, dst = _engine(llama_dir), _engine(llama_dir)
    n, tokens = _hand_off(src, dst, prompt, sampling)
    assert n == 0 and tokens == hf_greedy(llama_dir, prompt, 6, ignore_eos=True)
    # the pushed KV covered 21 tokens (5 full blocks), the decode filled 5 more: 26 tokens, 6 blocks
    assert dst.allocator.num_cached == 6
    again = _drive(dst, {0: [("again", prompt, sampling)]})["again"]
    assert _cached(again) == 20 and _tokens(again) == tokens
    n, tokens2 = _hand_off(src, dst, prompt, sampling)  # now dst has the prefix: nothing is pushed
    assert n == 5 and tokens2 == tokens


def test_add_prefilled_refuses_cached_blocks_of_other_tokens(llama_dir):
    engine = _engine(llama_dir)
    prompt = _prompt(14, 13)
    _drive(engine, {0: [("a", prompt, SamplingParams(max_tokens=1))]})
    blocks, n = engine.reserve("r", 20, token_ids=prompt)
    assert n == 3
    with pytest.raises(ValueError, match="hold other tokens' KV"):
        engine.add_prefilled("r", _prompt(15, 13), [5], SamplingParams())
    assert engine.reserved == {"r": blocks}
    engine.check()


# ---- worker stats ------------------------------------------------------------------------------
def test_worker_stats_carry_numbered_cache_deltas(llama_dir):
    threads = torch.get_num_threads()
    cfg = EngineConfig(model_path=llama_dir, dtype="float32", num_blocks=32, block_size=4)
    core = WorkerCore("w", "decode", cfg, on_outputs=lambda outs: None)
    try:
        asyncio.run(_stats_checks(core))
    finally:
        core.stop()
        torch.set_num_threads(threads)


async def _stats_checks(core: WorkerCore) -> None:
    info = core.info()
    kv = core.engine.runner.kv  # [num_blocks, layers, 2, block_size, kv_heads, head_dim]
    assert info.prefix_caching and info.block_bytes == kv.numel() * kv.element_size() // 32
    prompt = _prompt(16, 9)
    await core.run(lambda e: e.generate([prompt], SamplingParams(max_tokens=2, ignore_eos=True)))
    hashes = tuple(block_hashes(prompt, 4))  # 9 + 1 computed tokens: 2 full blocks
    s = await core.stats(channels=0)
    assert (s.blocks_cached, s.prefix_query_tokens, s.prefix_hit_tokens) == (2, 9, 0)
    assert s.cache == CacheDelta(1, hashes, (), snapshot=False)
    assert (await core.stats(channels=0)).cache == CacheDelta(2, (), ())
    await core.run(lambda e: e.generate([prompt], SamplingParams(max_tokens=1)))
    s = await core.stats(channels=0, resync=True)
    assert (s.prefix_query_tokens, s.prefix_hit_tokens) == (18, 8)
    assert s.cache == CacheDelta(3, hashes, (), snapshot=True)
