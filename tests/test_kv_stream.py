"""Chunk-wise KV streaming end to end (prefill_worker/push.py -> kv_transfer -> decode_worker/
handoff.py) on real Ray actors: prompts that span many prefill chunks arrive token-exact, a
piece that fails mid-stream migrates the request, a cancel mid-stream leaks nothing; after each
every worker's pool is whole and passes check() (free + used == total, refcounts = holders).
The shared 2 + 2 cluster serves the module (conftest's served_2x2: one 16-token block per
prefill step); each test switches on the faults it needs at run time."""

from __future__ import annotations

import random
import time

import pytest
import ray

from router.launch import LocalCluster
from router.lifecycle.life import Phase
from tests.cluster_util import Client, faults, wait_until
from tests.reference import hf_greedy

pytestmark = pytest.mark.usefixtures("ray_instance")


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 2000) for _ in range(n)]


def _no_leaks(cluster: LocalCluster, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        counts = [ray.get(w.actor.check.remote(), timeout=10) for w in cluster.router.pools.all()
                  if not w.stopped]
        if all(c["used"] == 0 and c["free"] == c["total"] for c in counts):
            return
        assert time.monotonic() < deadline, f"blocks still held: {counts}"
        time.sleep(0.05)


def _received(decode, attempt_id: str) -> int:
    """Blocks of this attempt's KV that have landed on `decode` (its hand-off table)."""
    def read(actor) -> int:
        slot = actor.handoffs._slots.get(attempt_id)
        return -1 if slot is None else slot.received
    return ray.get(decode.actor.__ray_call__.remote(read), timeout=10)


def _finished(cluster: LocalCluster, reason: str) -> float:
    return cluster.router.metrics.registry.get_sample_value("pdserve_requests_total", {"finish_reason": reason}) or 0


@pytest.fixture(scope="module")
def cluster(served_2x2):  # shared (conftest): 2 + 2, CHUNKED prefill, KV streamed, up to 20 migrations
    cfg = served_2x2.cfg
    assert (cfg.scheduler.chunk_size, cfg.scheduler.max_num_batched_tokens) == (16, 16)
    assert cfg.kv_transfer.stream_chunks and cfg.router.migration_limit == 20
    return served_2x2


def test_streamed_prompts_over_many_chunks_are_token_exact_and_a_cancel_leaks_nothing(cluster, llama_dir):
    client = Client(cluster.address)
    with faults(cluster, step_delay_s=0.02):
        for seed, n in ((1, 95), (2, 128), (3, 33)):  # a partial last block, whole blocks, two chunks
            prompt = _prompt(seed, n)
            tokens, last = client.tokens(prompt, max_tokens=12, ignore_eos=True)
            assert tokens == hf_greedy(llama_dir, prompt, 12, ignore_eos=True), f"prompt of {n}"
            assert last.usage.migrations == 0
    _no_leaks(cluster)
    cancelled = _finished(cluster, "cancelled")
    with faults(cluster, step_delay_s=0.05):  # 15 prefill steps of >= 50 ms
        call = client.stream(_prompt(4, 240), max_tokens=8, ignore_eos=True)
        wait_until(lambda: any(life.phase is Phase.PREFILLING for life in cluster.router.lives.values()), 10,
                   "the prefill")
        (life,) = cluster.router.lives.values()
        decode, attempt_id = life.decode, life.attempt_id
        wait_until(lambda: _received(decode, attempt_id) >= 2, 10, "two pieces of the KV to land")
        call.cancel()
        wait_until(lambda life=life: life.ended, 5, "the cancel to reach the router")
    # cancelled mid-stream: pieces of the KV had landed, the first token had not been computed
    assert life.phase is Phase.CANCELLED and not life.output_token_ids
    assert _finished(cluster, "cancelled") == cancelled + 1
    _no_leaks(cluster)
    client.close()


def test_a_piece_failing_mid_stream_migrates_token_exact(cluster, llama_dir):
    client = Client(cluster.address)
    migrated = 0
    with faults(cluster, transfer_fail_rate=0.15, seed=3):
        for seed in range(4):
            prompt = _prompt(10 + seed, 90)  # 6 pieces each: most attempts lose one
            tokens, last = client.tokens(prompt, max_tokens=6, ignore_eos=True)
            assert tokens == hf_greedy(llama_dir, prompt, 6, ignore_eos=True)
            migrated += last.usage.migrations
    assert migrated >= 1
    _no_leaks(cluster)
    client.close()
