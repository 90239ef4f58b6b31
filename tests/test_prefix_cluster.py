"""Prefix caching through the real cluster: Ray actors, gRPC, KV channels.

A repeated prefix is computed once per worker, the decode worker that holds it receives only
the new blocks, cache-aware placement sends a conversation back to the workers that hold it,
tokens stay identical to transformers' generate, and no block leaks.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest
import ray

from router.launch import LocalCluster
from tests.cluster_util import Client, faults
from tests.reference import hf_greedy

pytestmark = pytest.mark.usefixtures("ray_instance")  # one local Ray for the module (conftest)
BS = 16


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(f"test_prefix_cluster-{seed}")  # its own prompts: the shared clusters' caches hold others'
    return [rng.randrange(10, 2000) for _ in range(n)]


def _assert_whole(cluster: LocalCluster) -> None:
    """No request holds a block; cached blocks are free to evict (free + used == total)."""
    for w in cluster.router.pools.all():
        counts = ray.get(w.actor.check.remote())
        assert counts["used"] == 0 and counts["free"] == counts["total"], f"{w.name}: {counts}"


def _usage(client: Client, prompt: list[int], max_tokens: int = 6) -> tuple[list[int], object]:
    tokens, last = client.tokens(prompt, max_tokens=max_tokens, ignore_eos=True)
    return tokens, last.usage


def _usages_together(client: Client, prompts: list[list[int]]) -> list[tuple[list[int], object]]:
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: _usage(client, p), prompts))


@pytest.fixture(scope="module")
def cache_aware(served_2x2):  # the shared 2 + 2 cluster (conftest)
    assert served_2x2.router.pools.placer.policies == {"prefill": "cache_aware", "decode": "cache_aware"}
    return served_2x2


def test_repeated_prefix_is_computed_once_and_only_new_blocks_move(cache_aware, llama_dir):
    client = Client(cache_aware.address)
    system = _tokens(5 * BS, seed=1)  # a shared "system prompt" of 5 full blocks
    first = system + _tokens(7, seed=2)
    second = system + _tokens(9, seed=3)
    t1, u1 = _usage(client, first)
    t2, u2 = _usage(client, second)
    assert t1 == hf_greedy(llama_dir, first, 6, ignore_eos=True)
    assert t2 == hf_greedy(llama_dir, second, 6, ignore_eos=True)
    assert u1.cached_tokens == 0 and u1.kv_cached_blocks == 0
    # the same prefill and decode workers: 5 blocks reused there, only the 6th block is sent
    assert (u2.prefill_worker, u2.decode_worker) == (u1.prefill_worker, u1.decode_worker)
    assert u2.cached_tokens == 5 * BS
    assert u2.kv_cached_blocks == 5
    block_bytes = u1.kv_transfer_bytes // 6  # the first request sent all of its 6 blocks
    assert u2.kv_transfer_bytes == 1 * block_bytes
    _assert_whole(cache_aware)
    client.close()


def test_cache_aware_places_a_prefix_where_load_would_not(cache_aware, llama_dir):
    """Two new system prompts, sent together while prefills are slow, land on different workers;
    a follow-up of the one held by the later-named workers goes back there under cache_aware
    (its prefix is not computed again), while the load policy, asked on the same cluster for the
    same request, picks the idle first-named workers and computes it all."""
    client = Client(cache_aware.address)
    systems = [_tokens(5 * BS, seed=50), _tokens(5 * BS, seed=51)]
    with faults(cache_aware, step_delay_s=0.1):  # the first is still prefilling when the second is placed
        firsts = [u for _, u in _usages_together(client, [s + _tokens(7, seed=52) for s in systems])]
    prefills = sorted(w.name for w in cache_aware.router.pools.workers["prefill"])
    decodes = sorted(w.name for w in cache_aware.router.pools.workers["decode"])
    assert {u.prefill_worker for u in firsts} == set(prefills), "the two prompts shared a prefill worker"
    [(system, held)] = [(s, u) for s, u in zip(systems, firsts, strict=True) if u.prefill_worker == prefills[1]]
    follow_up = system + _tokens(9, seed=53)
    expected = hf_greedy(llama_dir, follow_up, 6, ignore_eos=True)

    tokens, aware = _usage(client, follow_up)
    assert tokens == expected
    assert (aware.prefill_worker, aware.decode_worker) == (held.prefill_worker, held.decode_worker)
    assert aware.cached_tokens == 5 * BS and aware.kv_cached_blocks == 5
    placer = cache_aware.router.pools.placer
    policies = dict(placer.policies)
    placer.policies = {"prefill": "load", "decode": "load"}
    try:
        tokens, load = _usage(client, follow_up)
    finally:
        placer.policies = policies
    assert tokens == expected
    assert load.prefill_worker == prefills[0] != aware.prefill_worker
    assert load.cached_tokens == 0  # that worker never saw this system prompt
    if held.decode_worker != decodes[0]:
        assert load.decode_worker == decodes[0] and load.kv_cached_blocks == 0
    _assert_whole(cache_aware)
    client.close()


def test_a_conversation_returns_to_the_workers_that_hold_it(cache_aware, llama_dir):
    """Turn 2 = turn 1's prompt + its answer + a new message: the earlier turn is cached."""
    client = Client(cache_aware.address)
    turn1 = _tokens(3 * BS + 5, seed=10)
    answer, u1 = _usage(client, turn1, max_tokens=20)
    turn2 = turn1 + answer + _tokens(6, seed=11)
    registry = cache_aware.router.metrics.registry

    def counters() -> dict[str, float]:
        out = {f"{kind}_{pool}": registry.get_sample_value(f"pdserve_prefix_cache_{kind}_tokens_total",
                                                          {"pool": pool}) or 0
               for kind in ("query", "hit") for pool in ("prefill", "decode")}
        return out | {"saved": registry.get_sample_value("pdserve_kv_transfer_saved_bytes_total") or 0}

    before = counters()
    t2, u2 = _usage(client, turn2)
    counted = {k: v - before[k] for k, v in counters().items()}
    assert t2 == hf_greedy(llama_dir, turn2, 6, ignore_eos=True)
    assert u2.prefill_worker == u1.prefill_worker and u2.decode_worker == u1.decode_worker
    assert u2.cached_tokens == 3 * BS  # the prompt's full blocks (the answer's were never on prefill)
    # the decode worker computed the answer too: every full block of turn 1 + answer is there
    assert u2.kv_cached_blocks == (len(turn1) + len(answer) - 1) // BS
    status = client.status()
    cached = {w.name: w.kv_blocks_cached for w in status.workers}
    assert cached[u1.prefill_worker] >= 3 and cached[u1.decode_worker] >= u2.kv_cached_blocks
    # the router's counters moved by exactly this request's lookups and what it did not send
    block_bytes = cache_aware.router.pools.workers["decode"][0].info.block_bytes
    assert counted == {"query_prefill": len(turn2), "query_decode": len(turn2), "hit_prefill": u2.cached_tokens,
                       "hit_decode": u2.kv_cached_blocks * BS, "saved": u2.kv_cached_blocks * block_bytes}
    metrics = cache_aware.router.metrics.render().decode()
    hit = registry.get_sample_value("pdserve_prefix_cache_hit_tokens_total", {"pool": "prefill"})
    assert f'pdserve_prefix_cache_hit_tokens_total{{pool="prefill"}} {hit}' in metrics  # what /metrics serves
    _assert_whole(cache_aware)
    client.close()


def test_concurrent_requests_sharing_a_new_prefix_stay_exact(cache_aware, llama_dir):
    client = Client(cache_aware.address)
    shared = _tokens(4 * BS, seed=20)
    prompts = [shared + _tokens(3 + i, seed=30 + i) for i in range(6)]
    got = client.many(prompts, max_tokens=8, ignore_eos=True)
    assert got == [hf_greedy(llama_dir, p, 8, ignore_eos=True) for p in prompts]
    _assert_whole(cache_aware)
    client.close()


def test_caching_off_computes_everything(served_small, llama_dir):
    cluster = served_small  # shared (conftest): 1 + 1, kv_cache.prefix_caching off
    assert not cluster.cfg.kv_cache.prefix_caching
    client = Client(cluster.address)
    prompt = _tokens(4 * BS + 3, seed=40)
    for _ in range(2):
        tokens, usage = _usage(client, prompt)
        assert tokens == hf_greedy(llama_dir, prompt, 6, ignore_eos=True)
        assert usage.cached_tokens == 0 and usage.kv_cached_blocks == 0
    assert all(w.kv_blocks_cached == 0 for w in client.status().workers)
    _assert_whole(cluster)
    client.close()
