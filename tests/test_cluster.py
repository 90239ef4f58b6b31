"""End to end through real Ray actors, real gRPC and real KV channels: tokens identical to
transformers' generate in every arrangement, bad requests get their status, blocks never leak."""

from __future__ import annotations

import random
import threading
import time

import grpc
import pytest
import ray

from proto import pdserve_pb2 as pb
from router.launch import LocalCluster
from router.lifecycle.life import Phase
from tests.cluster_util import Client, cluster_config, faults, kv_bytes, set_faults, wait_until
from tests.reference import hf_greedy

pytestmark = pytest.mark.usefixtures("ray_instance")  # one local Ray for the module (conftest)


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(f"test_cluster-{seed}")  # its own prompts: the shared clusters' caches hold others'
    return [[rng.randrange(10, 2000) for _ in range(rng.randint(4, 60))] for _ in range(n)]


def _assert_no_leaks(cluster: LocalCluster) -> None:
    """Every worker's pool is whole again: free + used == total and nothing used."""
    for w in cluster.router.pools.all():
        counts = ray.get(w.actor.check.remote())
        assert counts["used"] == 0 and counts["free"] == counts["total"], f"{w.name}: {counts}"


def _assert_tokens_match_generate(cluster: LocalCluster, llama_dir: str, num_workers: int, seed: int) -> None:
    prompts = _prompts(16, seed=seed)
    client = Client(cluster.address)
    got = client.many(prompts, max_tokens=12, ignore_eos=True)
    assert got == [hf_greedy(llama_dir, p, 12, ignore_eos=True) for p in prompts]
    assert len({w.name for w in client.status().workers}) == num_workers
    _assert_no_leaks(cluster)
    client.close()


@pytest.mark.parametrize("mode, workers", [("disaggregated", 4), ("colocated", 2)], ids=["disaggregated-2", "colocated-2"])
def test_grpc_tokens_match_generate(served_2x2, served_colocated, llama_dir, mode, workers):
    cluster = served_2x2 if mode == "disaggregated" else served_colocated  # shared: 2 + 2, or 2 colocated
    assert cluster.cfg.mode == mode
    _assert_tokens_match_generate(cluster, llama_dir, workers, seed=2)


def test_colocated_requests_wait_for_kv_in_the_router_queue_not_an_engine_queue(served_colocated, llama_dir):
    """Colocated placement counts KV as a reservation does: while long requests hold all but 18
    of each worker's 256 blocks, a request needing 26 waits in the router's queue (where
    router.queue_timeout_s bounds it and the predicted wait refuses at arrival), not in an
    engine's waiting queue where nothing bounds it; once they end it is placed, token-exact."""
    cluster, client = served_colocated, Client(served_colocated.address)
    rng = random.Random("test_cluster-kv-wait")
    big = [[rng.randrange(10, 2000) for _ in range(1900)] for _ in range(4)]  # 119 blocks, 125 at the end
    small = [rng.randrange(10, 2000) for _ in range(400)]  # 26 blocks
    out: dict = {}

    def run(key, prompt, max_tokens):
        out[key] = client.tokens(prompt, max_tokens=max_tokens, ignore_eos=True)[0]
    threads = [threading.Thread(target=run, args=(i, p, 100)) for i, p in enumerate(big)]
    # slow steps (100 decode steps: 10 s or more) keep the long requests' blocks held while the
    # small one arrives, however fast the engine decodes; normal speed again once it is seen queued
    with faults(cluster, step_delay_s=0.1):
        for t in threads:
            t.start()
        wait_until(lambda: sum(bool(life.output_token_ids) for life in cluster.router.lives.values()) == 4, 60,
                   "the four long requests decoding")
        threads.append(threading.Thread(target=run, args=("small", small, 8)))
        threads[-1].start()
        wait_until(lambda: cluster.router.admission.waiting == 1, 10, "the small request queued in the router")
        queued = [life for life in cluster.router.lives.values() if life.decode is None]
        assert len(queued) == 1 and queued[0].phase is Phase.QUEUED
        stats = ray.get([w.actor.stats.remote() for w in cluster.router.pools.all()], timeout=30)
        assert sum(st.waiting for st in stats) == 0  # no engine holds it in a queue
        assert sum(len(life.output_token_ids) < 100 for life in cluster.router.lives.values()) >= 4  # still decoding
    for t in threads:
        t.join(60)
    assert out["small"] == hf_greedy(llama_dir, small, 8, ignore_eos=True)
    assert [len(out[i]) for i in range(4)] == [100] * 4
    wait_until(lambda: not cluster.router.lives, 10, "every request to end")
    _assert_no_leaks(cluster)
    client.close()


@pytest.fixture(scope="module")
def cluster(served):  # the session's default 1 + 1 cluster (conftest)
    return served


def test_grpc_tokens_match_generate_on_one_prefill_and_one_decode_worker(cluster, llama_dir):
    _assert_tokens_match_generate(cluster, llama_dir, 2, seed=1)


def test_workers_run_with_the_allocator_and_threads_auto_picks(cluster, served_colocated):
    """`malloc: auto` and `torch_threads: auto` (the defaults): every CPU worker process has
    tcmalloc mapped where this host has the library, and glibc's malloc where it has not
    (worker_runtime/malloc.py); and runs its Ray CPU share in torch threads, twice that when
    colocated, at most the cores it may use (worker_runtime/threads.py; a share of 0.5 counts as 1)."""
    from worker_runtime import malloc

    expected = "tcmalloc" if malloc.tcmalloc() else "system"

    def probe(actor):
        import os

        import torch
        return malloc.in_use(), torch.get_num_threads(), len(os.sched_getaffinity(0))
    for shared, per_cpu in ((cluster, 1), (served_colocated, 2)):
        seen = ray.get([w.actor.__ray_call__.remote(probe) for w in shared.router.pools.all()], timeout=30)
        assert len(seen) == 2 and [m for m, _, _ in seen] == [expected] * 2
        assert all(threads == min(per_cpu, cores) for _, threads, cores in seen), (per_cpu, seen)


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


def _finished(cluster: LocalCluster, reason: str) -> float:
    return cluster.router.metrics.registry.get_sample_value("pdserve_requests_total", {"finish_reason": reason}) or 0


def test_client_disconnect_frees_blocks_long_before_the_request_would_end(cluster):
    client = Client(cluster.address)
    cancelled, finished = _finished(cluster, "cancelled"), _finished(cluster, "length")
    with faults(cluster, step_delay_s=0.02):  # 1500 tokens: 30 s or more if nothing stopped it
        call = client.stream(_prompts(1, seed=11)[0], max_tokens=1500, ignore_eos=True)
        for i, _ in enumerate(call):
            if i == 3:
                break
        assert any(w.kv_blocks_used for w in client.status().workers)
        call.cancel()
        t0 = time.monotonic()
        wait_until(lambda: not any(w.kv_blocks_used for w in client.status().workers), 10, "the blocks to be freed",
                   every=0.05)
        assert time.monotonic() - t0 < 10  # not the 30 s to the end: the cancel freed them
    assert _finished(cluster, "cancelled") == cancelled + 1 and _finished(cluster, "length") == finished
    _assert_no_leaks(cluster)
    client.close()


def test_usage_reports_workers_and_timings(cluster, llama_dir):
    client = Client(cluster.address)
    prompt = _prompts(1, seed=12)[0]
    tokens, last = client.tokens(prompt, max_tokens=5, ignore_eos=True)
    assert last.finish_reason == "length" and len(tokens) == 5
    u = last.usage
    assert u.prompt_tokens == len(prompt) and u.completion_tokens == 5
    assert u.prefill_worker.startswith("prefill-") and u.decode_worker.startswith("decode-")
    assert u.ttft_ms > 0 and u.kv_transfer_ms > 0
    block_size = cluster.cfg.kv_cache.block_size
    assert u.kv_transfer_bytes == kv_bytes(llama_dir, len(prompt), block_size) > 0
    client.close()


class _Timed(threading.Thread):
    """Streams one request on a thread: its tokens, last message, and when (monotonic) its
    first token and its last message arrived."""

    def __init__(self, client: Client, prompt: list[int], max_tokens: int, delay_s: float = 0.0):
        super().__init__()
        self.client, self.prompt, self.max_tokens, self.delay_s = client, prompt, max_tokens, delay_s
        self.tokens: list[int] = []
        self.last: pb.GenerateResponse | None = None
        self.first_s = self.end_s = None

    def run(self) -> None:
        time.sleep(self.delay_s)
        for msg in self.client.stream(self.prompt, max_tokens=self.max_tokens, ignore_eos=True):
            if self.first_s is None and msg.token_ids:
                self.first_s = time.monotonic()
            self.tokens.extend(msg.token_ids)
            self.last = msg
        self.end_s = time.monotonic()


def test_scale_while_streaming_loses_nothing(cluster, llama_dir):
    """On the shared 1 + 1 cluster, which it scales back to 1 + 1 at the end."""
    prompts, long_prompts, long_tokens = _prompts(32, seed=21), _prompts(6, seed=22), 200
    expected = [hf_greedy(llama_dir, p, 40, ignore_eos=True) for p in prompts]
    long_expected = [hf_greedy(llama_dir, p, long_tokens, ignore_eos=True) for p in long_prompts]
    client = Client(cluster.address)
    try:
        streams = [_Timed(client, p, 40, delay_s=0.05 * i) for i, p in enumerate(prompts)]  # spread over the scaling
        for s in streams:
            s.start()
        shapes = []
        for pool, n in (("prefill", 2), ("decode", 2)):
            resp = client.admin.Scale(pb.ScaleRequest(pool=pool, replicas=n), timeout=120)
            assert resp.replicas == n
            shapes.append(sorted(w.name.split("-")[0] for w in client.status().workers))
        # long requests still decoding on both decode workers when the shrink begins: steps of 20 ms
        # or more keep each decoding for 4 s or more, so the status polls see it however loaded the host
        with faults(cluster, step_delay_s=0.02):
            long_streams = [_Timed(client, p, long_tokens) for p in long_prompts]
            for s in long_streams:
                s.start()
            deadline = time.monotonic() + 60
            while not (all(s.first_s for s in long_streams)
                       and all(w.running for w in client.status().workers if w.pool == "decode")):
                assert time.monotonic() < deadline, "the long requests never ran on both decode workers"
                time.sleep(0.02)
            scale_began = time.monotonic()
            resp = client.admin.Scale(pb.ScaleRequest(pool="decode", replicas=1), timeout=120)
        assert resp.replicas == 1 and len(resp.stopped) == 1
        shapes.append(sorted(w.name.split("-")[0] for w in client.status().workers))
        for s in streams + long_streams:
            s.join(120)
        # every request completed exactly once, with correct tokens
        assert [s.tokens for s in streams] == expected
        assert [s.tokens for s in long_streams] == long_expected
        assert shapes == [["decode", "prefill", "prefill"], ["decode", "decode", "prefill", "prefill"],
                          ["decode", "prefill", "prefill"]]
        # the drained worker held work: requests decoded on it were streaming when Scale began,
        # and finished there (a drain waits for them; nothing moved to another worker)
        drained = [s for s in long_streams if s.last.usage.decode_worker == resp.stopped[0]]
        assert any(s.first_s < scale_began < s.end_s for s in drained), (resp.stopped, scale_began)
        assert [s.last.usage.migrations for s in streams + long_streams] == [0] * (len(prompts) + len(long_prompts))
        _assert_no_leaks(cluster)
    finally:
        for pool in ("prefill", "decode"):
            client.admin.Scale(pb.ScaleRequest(pool=pool, replicas=1), timeout=120)
        client.close()


@pytest.fixture(scope="module")
def tight(llama_dir):
    """1 + 1 with 8 KV blocks of 16 tokens per worker (a 100-token prompt reserves 7, so a second
    one must wait), a router queue of one and a 30 s shutdown grace; the module's last test shuts
    it down."""
    cfg = cluster_config(llama_dir, kv_cache={"num_blocks": 8}, router={"max_queue": 1, "shutdown_grace_s": 30})
    cluster = LocalCluster(cfg).__enter__()
    yield cluster
    if cluster._thread.is_alive():  # the shutdown test did not get to stop it
        cluster.__exit__(None, None, None)


def test_full_queue_is_resource_exhausted_and_others_finish(tight):
    cluster = tight
    client = Client(cluster.address)
    set_faults(cluster, step_delay_s=0.1)  # the first holds its blocks for 2 s or more
    first = client.stream([7] * 100, max_tokens=20, ignore_eos=True)
    next(first)  # holds 7 of the decode worker's 8 blocks
    second = client.stream([8] * 100, max_tokens=20, ignore_eos=True)  # waits in the router queue
    wait_until(lambda: client.status().router_queue == 1, 10, "the second request to queue")
    with pytest.raises(grpc.RpcError) as err:
        list(client.stream([9] * 100, max_tokens=20, ignore_eos=True))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "queue is full" in err.value.details()
    assert client.status().router_queue == 1  # refused while the first still held its blocks
    set_faults(cluster)
    assert sum(len(m.token_ids) for m in first) == 19
    assert sum(len(m.token_ids) for m in second) == 20
    _assert_no_leaks(cluster)
    client.close()


def test_health_and_reflection(cluster):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    channel = grpc.insecure_channel(cluster.address)
    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    responses = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
    names = {s.name for r in responses for s in r.list_services_response.service}
    assert {"pdserve.v1.Generation", "pdserve.v1.Admin", "grpc.health.v1.Health"} <= names
    channel.close()


def test_shutdown_finishes_in_flight_and_refuses_new(tight, llama_dir):
    cluster = tight  # stopped here: the module's last test
    stopper = threading.Thread(target=cluster.__exit__, args=(None, None, None))
    client = Client(cluster.address)
    try:
        prompt = _prompts(1, seed=31)[0][:20]  # + 90 tokens: 7 of the 8 blocks
        set_faults(cluster, step_delay_s=0.02)  # 90 tokens: 1.8 s or more, still in flight when refused
        stream = client.stream(prompt, max_tokens=90, ignore_eos=True)
        got = list(next(stream).token_ids)
        stopper.start()
        wait_until(lambda: not cluster.router.accepting, 5, "the shutdown to begin", every=0.01)
        with pytest.raises(grpc.RpcError) as err:
            list(client.stream(prompt, max_tokens=5))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert len(cluster.router.lives) == 1, "the accepted request ended before the refusal"
        for msg in stream:  # the accepted request still completes within the grace period
            got.extend(msg.token_ids)
        assert got == hf_greedy(llama_dir, prompt, 90, ignore_eos=True)
    finally:  # the cluster stops also when an assertion failed
        if stopper.ident is None:
            cluster.__exit__(None, None, None)
        stopper.join(60)
        client.close()
