"""A prefill worker's step order (engine/scheduler.py `_shortest_first`), on the scheduler alone
(no model): short prompts placed behind a long one are not held for its whole prefill, and the
long one keeps half of every step. Sizes as simulate/gpu_cluster.yaml's (8,192-token budget)."""

from __future__ import annotations

from engine.config import EngineConfig
from engine.kv_cache import BlockAllocator
from engine.request import Request
from engine.scheduler import Scheduler
from protocol.sampling import SamplingParams


def _prefill_worker() -> Scheduler:
    config = EngineConfig(model_path="unused", max_num_batched_tokens=8192, chunk_size=2048, max_num_seqs=64,
                          enable_prefix_caching=False)
    return Scheduler(config, BlockAllocator(20_000, enable_caching=False))


def _prompt(name: str, n: int) -> Request:
    return Request(name, list(range(n)), SamplingParams(max_tokens=1), None, prefill_only=True)


def _step(s: Scheduler) -> dict[str, int]:
    """One step: the tokens each request computes; a finished prompt leaves (as the engine's does)."""
    items = s.schedule()
    for it in items:
        it.request.num_computed_tokens += it.num_tokens
    for it in items:
        if it.request.num_uncomputed_tokens == 0:
            s.finish(it.request, keep_blocks=True)
    return {it.request.request_id: it.num_tokens for it in items}


def test_a_short_prompt_behind_a_long_one_starts_at_once_and_the_fewest_tokens_left_go_first():
    """A 100k-token prompt is running when prompts of 1,000 and 7,000 tokens arrive: they start in
    the next step within half its budget (the 1,000 whole, 3,096 of the 7,000), the long one takes
    the other half; the 7,000's rest goes first in the step after. In arrival order they waited for
    all 100k (12 more steps of 8,192, ~7 s on an H100)."""
    s = _prefill_worker()
    s.add(_prompt("long", 100_000))
    assert _step(s) == {"long": 8192}
    s.add(_prompt("short", 1000))
    s.add(_prompt("mid", 7000))
    assert _step(s) == {"short": 1000, "mid": 3096, "long": 4096}
    assert _step(s) == {"mid": 3904, "long": 4288}
    assert [r.request_id for r in s.running] == ["long"]


def test_prompts_of_one_length_keep_their_arrival_order():
    """Two 16k-token prompts: the first is computed whole before the second starts, as in arrival
    order (the second is not shorter than what the first has left)."""
    s = _prefill_worker()
    s.add(_prompt("a", 16_384))
    s.add(_prompt("b", 16_384))
    assert [_step(s) for _ in range(4)] == [{"a": 8192}, {"a": 8192}, {"b": 8192}, {"b": 8192}]


def test_a_long_prompt_still_finishes_under_a_stream_of_short_ones():
    """A 4,000-token prompt arrives before every step (half the worker): a 50k-token prompt
    running still computes the other half of each step and finishes."""
    s = _prefill_worker()
    s.add(_prompt("long", 50_000))
    done = _step(s)["long"]
    for k in range(12):
        s.add(_prompt(f"short{k}", 4000))
        done += _step(s).get("long", 0)
    assert done == 50_000
