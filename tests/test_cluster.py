"""End to end through real Ray actors, real gRPC and real KV channels: tokens identical to
transformers' generate in every arrangement, bad requests get their status, blocks never leak."""

from __future__ import annotations

import random
import threading
import time

import grpc
import pytest
import ray

from router.launcher import LocalCluster
from tests.cluster_util import Client, cluster_config
from tests.reference import hf_greedy


@pytest.fixture(scope="module", autouse=True)
def ray_instance():
    ray.init(num_cpus=8, include_dashboard=False, object_store_memory=128 << 20, log_to_driver=False)
    yield
    ray.shutdown()


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 2000) for _ in range(rng.randint(4, 60))] for _ in range(n)]


def _assert_no_leaks(cluster: LocalCluster) -> None:
    """Every worker's pool is whole again: free + used == total and nothing used."""
    for w in cluster.router.pools.all():
        counts = ray.get(w.actor.check.remote())
        assert counts["used"] == 0 and counts["free"] == counts["total"], f"{w.name}: {counts}"


@pytest.mark.parametrize("mode, replicas", [("disaggregated", 1), ("disaggregated", 2), ("colocated", 2)])
def test_grpc_tokens_match_generate(llama_dir, mode, replicas):
    cfg = cluster_config(llama_dir, mode=mode, prefill={"replicas": replicas if mode == "disaggregated" else 0},
                         decode={"replicas": replicas})
    prompts = _prompts(16, seed=replicas)
    with LocalCluster(cfg) as cluster:
        client = Client(cluster.address)
        got = client.many(prompts, max_tokens=12, ignore_eos=True)
        assert got == [hf_greedy(llama_dir, p, 12, ignore_eos=True) for p in prompts]
        workers = {w.name for w in client.status().workers}
        assert len(workers) == (2 * replicas if mode == "disaggregated" else replicas)
        _assert_no_leaks(cluster)
        client.close()


@pytest.fixture(scope="module")
def cluster(llama_dir):
    with LocalCluster(cluster_config(llama_dir)) as c:
        yield c


def test_bad_requests_get_their_status_and_good_ones_still_finish(cluster, llama_dir):
    client = Client(cluster.address)
    good_prompt = _prompts(1, seed=9)[0]
    result: dict = {}
    t = threading.Thread(target=lambda: result.update(tokens=client.tokens(good_prompt, max_tokens=30, ignore_eos=True)[0]))
    t.start()
    bad = [
        ({"prompt": ""}, "prompt is empty"),
        ({"prompt": "hi", "prompt_ids": [5]}, "not both"),
        ({"prompt_ids": [5, 10**6]}, "outside the vocabulary"),
        ({"prompt_ids": [5], "max_tokens": 5000}, "exceeds the model's context"),
        ({"prompt_ids": [5], "temperature": -1.0}, "temperature must be >= 0"),
        ({"prompt_ids": [5], "top_p": 1.5}, "top_p must be in (0, 1]"),
    ]
    for kwargs, message in bad:
        with pytest.raises(grpc.RpcError) as err:
            list(client.stream(**kwargs))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, kwargs
        assert message in err.value.details()
    t.join(60)
    assert result["tokens"] == hf_greedy(llama_dir, good_prompt, 30, ignore_eos=True)
    client.close()


def test_client_disconnect_frees_blocks_within_a_second(cluster):
    client = Client(cluster.address)
    call = client.stream(_prompts(1, seed=11)[0], max_tokens=1500, ignore_eos=True)
    for i, _ in enumerate(call):
        if i == 3:
            break
    call.cancel()
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        used = [w.kv_blocks_used for w in client.status().workers]
        if not any(used):
            break
        time.sleep(0.05)
    assert not any(w.kv_blocks_used for w in client.status().workers)
    _assert_no_leaks(cluster)
    client.close()


def test_usage_reports_workers_and_timings(cluster):
    client = Client(cluster.address)
    tokens, last = client.tokens(_prompts(1, seed=12)[0], max_tokens=5, ignore_eos=True)
    assert last.finish_reason == "length" and len(tokens) == 5
    u = last.usage
    assert u.completion_tokens == 5 and u.prefill_worker.startswith("prefill-") and u.decode_worker.startswith("decode-")
    assert u.ttft_ms > 0
    client.close()
