"""Chunk-wise KV streaming end to end (prefill_worker/push.py -> kv_transfer -> decode_worker/
handoff.py) on real Ray actors: prompts that span many prefill chunks arrive token-exact, a
piece that fails mid-stream migrates the request, a cancel mid-stream leaks nothing; after each
every worker's pool is whole and passes check() (free + used == total, refcounts = holders)."""

from __future__ import annotations

import random
import time

import pytest
import ray

from router.launch import LocalCluster
from tests.cluster_util import Client, cluster_config
from tests.reference import hf_greedy

pytestmark = pytest.mark.usefixtures("ray_instance")
CHUNKED = {"chunk_size": 16, "max_num_batched_tokens": 16}  # one block per step: many pieces


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


def test_streamed_prompts_over_many_chunks_are_token_exact_and_a_cancel_leaks_nothing(llama_dir):
    cfg = cluster_config(llama_dir, scheduler=CHUNKED, kv_transfer={"stream_chunks": True},
                         faults={"step_delay_s": 0.02})
    with LocalCluster(cfg) as cluster:
        client = Client(cluster.address)
        for seed, n in ((1, 95), (2, 128), (3, 33)):  # a partial last block, whole blocks, two chunks
            prompt = _prompt(seed, n)
            tokens, last = client.tokens(prompt, max_tokens=12, ignore_eos=True)
            assert tokens == hf_greedy(llama_dir, prompt, 12, ignore_eos=True), f"prompt of {n}"
            assert last.usage.migrations == 0
        _no_leaks(cluster)
        call = client.stream(_prompt(4, 240), max_tokens=8, ignore_eos=True)  # 15 steps of >= 20 ms
        time.sleep(0.15)
        call.cancel()
        _no_leaks(cluster)
        client.close()


def test_a_piece_failing_mid_stream_migrates_token_exact(llama_dir):
    cfg = cluster_config(llama_dir, scheduler=CHUNKED, prefill={"replicas": 2}, decode={"replicas": 2},
                         router={"migration_limit": 20}, faults={"transfer_fail_rate": 0.15, "seed": 3})
    with LocalCluster(cfg) as cluster:
        client = Client(cluster.address)
        migrated = 0
        for seed in range(4):
            prompt = _prompt(10 + seed, 90)  # 6 pieces each: most attempts lose one
            tokens, last = client.tokens(prompt, max_tokens=6, ignore_eos=True)
            assert tokens == hf_greedy(llama_dir, prompt, 6, ignore_eos=True)
            migrated += last.usage.migrations
        assert migrated >= 1
        _no_leaks(cluster)
        client.close()
