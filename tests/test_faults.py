"""Every failure path end to end, on real Ray actors, gRPC and KV channels: a worker killed or
hung mid-request, a failed KV transfer, a cancel while a reservation is in flight, a scale
Ray cannot place, bad input next to good requests. Each checks the client's exact outcome
(tokens identical to an undisturbed run, or the precise status) and that no KV block leaks.

Shared clusters serve the module (a start costs 8-10 s; conftest): `cluster`, 2 + 2 workers,
`small`, 1 + 1 with tight router limits (one prefill at a time, a queue of one, one migration,
short deadlines) and 32-token prefill chunks, and 2 colocated workers. Faults are switched on at
run time for the test that needs them (tests/cluster_util.py: set_faults) and off again after
it; a test that kills a worker waits for its pool to heal."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import threading
import time

import grpc
import pytest
import ray
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proto import pdserve_pb2 as pb
from router.launch import LocalCluster
from router.lifecycle.life import Phase
from tests.cluster_util import (
    Client,
    faults,
    held_engines,
    set_faults,
    set_worker_faults,
    wait_until,
)
from tests.reference import hf_greedy

pytestmark = pytest.mark.usefixtures("ray_instance")  # one local Ray for the module (conftest)


def _prompt(seed: int, n: int = 24) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 2000) for _ in range(n)]


def _no_leaks(cluster: LocalCluster, timeout: float = 5.0) -> None:
    """Every live worker's pool is whole again (within `timeout`: aborts are asynchronous)."""
    def whole() -> bool:
        counts = [ray.get(w.actor.check.remote(), timeout=10) for w in cluster.router.pools.all()
                  if not w.stopped]
        return all(c["used"] == 0 and c["free"] == c["total"] for c in counts)
    wait_until(whole, timeout, "every KV block to be free")


def _worker(cluster: LocalCluster, name: str):
    return next(w for w in cluster.router.pools.all() if w.name == name)


def _stream_and_kill(client: Client, cluster: LocalCluster, prompt, kill_after: int, **sampling):
    """Stream a request; after `kill_after` messages kill the decode worker serving it."""
    tokens, last, killed = [], None, None
    for i, msg in enumerate(client.stream(prompt, **sampling)):
        tokens.extend(msg.token_ids)
        last = msg
        if i == kill_after:
            # this request's life: the one streaming (another test's may still be ending)
            holder = next(life.decode for life in cluster.router.lives.values()
                          if life.decode is not None and life.output_token_ids and not life.ended)
            killed = holder.name
            ray.kill(holder.actor, no_restart=True)
    return tokens, last, killed


def _finished(cluster: LocalCluster, reason: str) -> float:
    return cluster.router.metrics.registry.get_sample_value("pdserve_requests_total", {"finish_reason": reason}) or 0


@pytest.fixture(scope="module")
def cluster(served_2x2):  # shared (conftest): 2 + 2, call deadlines 3 s, restart backoff 0.2 s, drain timeout 1 s
    return served_2x2


@pytest.fixture(scope="module")
def small(served_small):  # shared (conftest): 1 + 1, tight router limits, 32-token prefill chunks
    return served_small


# seeded sampling across a decode worker's death is also the chaos soak's (every kill, token-exact
# against a reference) and the colocated test's below: here it is the exhaustive tier
@pytest.mark.parametrize("sampling", [dict(), pytest.param(dict(temperature=0.8, top_p=0.875, seed=11),
                                                           marks=pytest.mark.exhaustive)], ids=["greedy", "seeded"])
def test_decode_worker_death_mid_stream_migrates_token_exact(cluster, llama_dir, sampling):
    client = Client(cluster.address)
    prompt = _prompt(1)
    args = dict(max_tokens=60, ignore_eos=True, **sampling)
    reference, _ = client.tokens(prompt, **args)  # undisturbed run, same cluster
    if not sampling:
        assert reference == hf_greedy(llama_dir, prompt, 60, ignore_eos=True)
    prefill_names = {w.name for w in cluster.router.pools.workers["prefill"]}
    tokens, last, killed = _stream_and_kill(client, cluster, prompt, kill_after=5, **args)
    assert tokens == reference and last.finish_reason == "length"
    assert last.usage.migrations == 1 and last.usage.decode_worker != killed  # one kill: one move
    assert {w.name for w in cluster.router.pools.workers["prefill"]} == prefill_names  # peers stay healthy
    wait_until(lambda: len(cluster.router.pools.ready("decode")) == 2, 60, "the decode pool to heal")
    pools = {p.pool: p for p in client.status().pools}
    assert pools["decode"].restarts >= 1 and killed in pools["decode"].last_failure
    assert pools["decode"].ready == pools["decode"].target == 2
    _no_leaks(cluster)
    client.close()


def test_colocated_worker_death_recomputes_elsewhere(served_colocated):
    cluster = served_colocated  # shared (conftest): 2 colocated workers, restart backoff 0.2 s
    client = Client(cluster.address)
    prompt = _prompt(7)
    args = dict(max_tokens=80, ignore_eos=True, temperature=0.75, seed=5)
    reference, _ = client.tokens(prompt, **args)
    tokens, last, killed = _stream_and_kill(client, cluster, prompt, kill_after=3, **args)
    assert tokens == reference and last.usage.migrations == 1 and last.usage.decode_worker != killed
    wait_until(lambda: len(cluster.router.pools.ready("decode")) == 2, 60, "the pool to heal")
    _no_leaks(cluster)
    client.close()


def test_prefill_worker_death_mid_prefill_is_retried(cluster, llama_dir):
    # slow prefill steps (faults.step_delay_s) keep the 300-token prompt (19 chunks of 16 on the
    # shared 2 + 2 cluster) prefilling for two seconds or more; the kill lands in them
    client = Client(cluster.address)
    prompt = _prompt(2, n=300)
    result: dict = {}
    set_worker_faults(cluster.router.pools.workers["prefill"], step_delay_s=0.1)
    try:
        t = threading.Thread(target=lambda: result.update(out=client.tokens(prompt, max_tokens=4, ignore_eos=True)))
        t.start()
        wait_until(lambda: any(life.phase is Phase.PREFILLING for life in cluster.router.lives.values()), 10, "a prefill")
        victim = next(life.prefill for life in cluster.router.lives.values() if life.prefill is not None)
        ray.kill(victim.actor, no_restart=True)
        t.join(60)
    finally:
        set_faults(cluster)  # off on the surviving worker too
    tokens, last = result["out"]
    assert tokens == hf_greedy(llama_dir, prompt, 4, ignore_eos=True)
    assert last.usage.migrations == 1 and last.usage.prefill_worker != victim.name
    wait_until(lambda: len(cluster.router.pools.ready("prefill")) == 2, 60, "the prefill pool to heal")
    _no_leaks(cluster)
    client.close()


def test_cancel_while_reserve_is_in_flight_leaks_nothing(cluster, tmp_path):
    """The decode engines are held (as behind a long step) until the cancel has reached the
    router, so no reservation can answer before it: each cancel lands while its reserve call is in
    flight, a seeded pause after the request began reserving apart (the early prefill not yet
    sent, computing, or done). The hold ends on that event, not after a guess of how long a loaded
    host takes to get there, and within the 3 s reserve deadline whatever happens."""
    client = Client(cluster.address)
    rng = random.Random(3)
    cancelled = _finished(cluster, "cancelled")
    for pause in [0.0] + [rng.uniform(0.0, 0.3) for _ in range(3)]:
        # the holds begin before the reserve call: under its 3 s deadline
        with held_engines(cluster.router.pools.ready("decode"), 2.8, tmp_path):
            call = client.stream(_prompt(3), max_tokens=200, ignore_eos=True)
            wait_until(lambda: any(life.phase is Phase.RESERVING for life in cluster.router.lives.values()), 2,
                       "a reserve")
            (life,) = cluster.router.lives.values()
            time.sleep(pause)
            call.cancel()
            wait_until(lambda life=life: life.ended, 2, "the cancel to reach the router")
            # the router records the decode worker once the reservation answered (never here)
            assert life.phase is Phase.CANCELLED and life.usage.decode_worker == "", (life.phase, life.usage)
        _no_leaks(cluster)  # waits for the held engines: the late reservation is freed, not kept
    assert _finished(cluster, "cancelled") == cancelled + 4
    client.close()


def test_scale_beyond_ray_is_refused_at_once(cluster):
    client = Client(cluster.address)
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        client.admin.Scale(pb.ScaleRequest(pool="decode", replicas=64), timeout=30)  # router.max_pool_replicas
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "CPU" in err.value.details() and "62 more decode" in err.value.details()
    assert time.monotonic() - t0 < 10
    assert {p.pool: p.target for p in client.status().pools} == {"prefill": 2, "decode": 2}
    client.close()


def test_bad_sampling_values_fail_alone(cluster, llama_dir):
    client = Client(cluster.address)
    prompts = [_prompt(10 + i) for i in range(3)]
    results: list = [None] * 3
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, client.tokens(prompts[i], max_tokens=20,
                                                                                            ignore_eos=True)[0]))
               for i in range(3)]
    for t in threads:
        t.start()
    for value in (float("nan"), float("inf"), 1e-45):
        with pytest.raises(grpc.RpcError) as err:
            list(client.stream(_prompt(5), max_tokens=20, temperature=value))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, value
        assert "temperature" in err.value.details()
    for t in threads:
        t.join(60)
    assert results == [hf_greedy(llama_dir, p, 20, ignore_eos=True) for p in prompts]
    _no_leaks(cluster)
    client.close()


def test_request_ids_limits_and_namespace(cluster):
    client = Client(cluster.address)
    with pytest.raises(grpc.RpcError) as err:
        list(client.gen.Generate(pb.GenerateRequest(request_id="x" * 300, prompt_token_ids=[5, 6]), timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "300 characters" in err.value.details()
    # an id shaped like the router's own attempt ids, and the longest allowed one, are just labels
    for rid in ("0.0", "y" * 128):
        msgs = list(client.gen.Generate(pb.GenerateRequest(request_id=rid, prompt_token_ids=[5, 6],
                                                           sampling=pb.SamplingParams(max_tokens=3)), timeout=30))
        assert all(m.request_id == rid for m in msgs) and msgs[-1].finish_reason
    first = client.gen.Generate(pb.GenerateRequest(request_id="dup", prompt_token_ids=[5, 6],
                                                   sampling=pb.SamplingParams(max_tokens=100, ignore_eos=True)),
                                timeout=30)
    next(first)
    with pytest.raises(grpc.RpcError) as err:
        list(client.gen.Generate(pb.GenerateRequest(request_id="dup", prompt_token_ids=[5]), timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "already in flight" in err.value.details()
    assert sum(len(m.token_ids) for m in first) == 99
    with pytest.raises(grpc.RpcError) as err:
        list(client.stream(prompt="a" * ((1 << 20) + 1), max_tokens=2))  # one byte past router.max_prompt_bytes
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "bytes" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:  # past what any request can need: gRPC refuses the message itself
        list(client.stream(prompt="a" * (2 << 20), max_tokens=2))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in err.value.details()
    _no_leaks(cluster)
    client.close()


def test_stop_string_text_is_exact_across_the_hand_off(cluster, llama_dir):
    client = Client(cluster.address)
    tok = cluster.router.tokenizer
    prompt = _prompt(21)
    full, _ = client.tokens(prompt, max_tokens=30, ignore_eos=True)
    text = tok.decode(full, skip_special_tokens=True)
    stop = text[6:9]
    assert stop and stop not in text[:6]
    msgs = list(client.stream(prompt, max_tokens=30, ignore_eos=True, stop=[stop]))
    streamed = "".join(m.text for m in msgs)
    ids = [t for m in msgs for t in m.token_ids]
    assert streamed == tok.decode(ids, skip_special_tokens=True).split(stop)[0] == text[:text.index(stop)]
    assert msgs[-1].finish_reason == "stop"
    # without a stop string, the streamed text is exactly the decode of the streamed ids
    msgs = list(client.stream(prompt, max_tokens=30, ignore_eos=True))
    assert "".join(m.text for m in msgs) == text
    client.close()


def test_drain_timeout_moves_the_remaining_requests(cluster, llama_dir):
    client = Client(cluster.address)
    prompts = [_prompt(61), _prompt(62)]
    expected = [hf_greedy(llama_dir, p, 160, ignore_eos=True) for p in prompts]
    results: list = [None, None]
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, client.tokens(prompts[i], max_tokens=160,
                                                                                            ignore_eos=True)))
               for i in range(2)]
    # placement balances by the router's view (running from the last stats + in flight): start
    # from a view that shows both decode workers idle, not the last test's stale counts
    wait_until(lambda: not any(w.running or w.inflight for w in cluster.router.pools.workers["decode"]), 20,
               "the router's view of both decode workers idle")
    with faults(cluster, step_delay_s=0.02):  # 160 tokens: 3.2 s or more, past the 1 s drain timeout
        for t in threads:
            t.start()
        wait_until(lambda: all(w.inflight for w in cluster.router.pools.workers["decode"]), 20, "both decode workers busy")
        resp = client.admin.Scale(pb.ScaleRequest(pool="decode", replicas=1), timeout=60)
        [stopped] = resp.stopped
        for t in threads:
            t.join(90)
    assert [r[0] for r in results] == expected  # the drained worker's request finished elsewhere
    moved = [r[1].usage for r in results if r[1].usage.migrations]
    assert len(moved) == 1 and moved[0].decode_worker != stopped
    client.admin.Scale(pb.ScaleRequest(pool="decode", replicas=2), timeout=120)
    _no_leaks(cluster)
    client.close()


def test_hung_worker_is_replaced_and_status_stays_prompt(small):
    cluster = small
    client = Client(cluster.address)
    prompt = _prompt(31)
    reference, _ = client.tokens(prompt, max_tokens=400, ignore_eos=True)
    decode = cluster.router.pools.workers["decode"][0]
    pid = ray.get(decode.actor.__ray_call__.remote(lambda self: os.getpid()))
    got: list = []
    streaming = threading.Event()

    def run() -> None:
        for msg in client.stream(prompt, max_tokens=400, ignore_eos=True):
            got.append(msg)
            streaming.set()
    t = threading.Thread(target=run)
    t.start()
    assert streaming.wait(30)
    os.kill(pid, signal.SIGSTOP)  # a real hang: the process stops answering anything
    try:
        t0 = time.monotonic()
        client.status()
        assert time.monotonic() - t0 < 6  # one stats deadline (2 s), not forever
        t.join(90)
        last = got[-1]
        assert [t for m in got for t in m.token_ids] == reference and last.finish_reason == "length"
        assert last.usage.migrations >= 1 and last.usage.decode_worker != decode.name
    finally:
        with contextlib.suppress(ProcessLookupError):  # the router killed it: the usual end
            os.kill(pid, signal.SIGCONT)
    pools = {p.pool: p for p in client.status().pools}
    assert "no answer" in pools["decode"].last_failure
    wait_until(lambda: len(cluster.router.pools.ready("decode")) == 1, 60, "the decode pool to heal")
    _no_leaks(cluster)
    client.close()


def test_failed_transfers_end_in_unavailable_not_a_hang(small):
    cluster = small  # router.migration_limit 1: the second failure is the last
    client = Client(cluster.address)
    t0 = time.monotonic()
    with faults(cluster, transfer_fail_rate=1.0), pytest.raises(grpc.RpcError) as err:
        list(client.stream(_prompt(41), max_tokens=10, ignore_eos=True))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "failed on 2 workers" in err.value.details() and "injected transfer failure" in err.value.details()
    assert time.monotonic() - t0 < 20
    _no_leaks(cluster)
    client.close()


def test_a_refused_reservation_under_an_early_prefill_places_the_request_again(cluster, llama_dir):
    """router.prefill_during_reserve: the prefill starts while the decode reservation is in flight.
    A reservation refused though the router saw room (the fault stands in for a stale view) aborts
    that prefill and places the request again: not a migration, exact tokens, no block held."""
    client = Client(cluster.address)
    registry = cluster.router.metrics.registry

    def counts() -> dict[str, float]:
        early = {o: registry.get_sample_value("pdserve_early_prefills_total", {"outcome": o}) or 0
                 for o in ("aimed", "dropped")}
        return early | {"migrations": registry.get_sample_value("pdserve_request_migrations_total") or 0}

    before = counts()
    with faults(cluster, reserve_refuse_rate=0.5, seed=5):
        for i in range(8):
            prompt = _prompt(90 + i, n=40)
            tokens, last = client.tokens(prompt, max_tokens=6, ignore_eos=True)
            assert tokens == hf_greedy(llama_dir, prompt, 6, ignore_eos=True)
            assert last.usage.migrations == 0
            # done at its first token: the stream ends before the reservation's answer reaches it
            tokens, last = client.tokens(prompt, max_tokens=1)
            assert tokens == hf_greedy(llama_dir, prompt, 1) and last.finish_reason == "length"
            assert last.usage.migrations == 0
    seen = {k: v - before[k] for k, v in counts().items()}
    assert seen["dropped"] >= 1 and seen["aimed"] >= 1 and seen["migrations"] == 0, seen
    _no_leaks(cluster)
    client.close()


def test_saturated_prefill_pool_answers_resource_exhausted(small):
    cluster = small  # router.max_prefill_inflight 1, max_queue 1; prefill chunks of 32 tokens
    client = Client(cluster.address)
    with faults(cluster, step_delay_s=0.1):
        first = client.stream(_prompt(71, n=300), max_tokens=2, ignore_eos=True)  # ~10 slow prefill steps
        wait_until(lambda: any(w.inflight for w in cluster.router.pools.workers["prefill"]), 10, "the first prefill")
        second = client.stream(_prompt(72, n=20), max_tokens=2, ignore_eos=True)  # waits for the prefill slot
        wait_until(lambda: client.status().router_queue == 1, 10, "the second request to queue")
        with pytest.raises(grpc.RpcError) as err:
            list(client.stream(_prompt(73, n=20), max_tokens=2))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "queue is full" in err.value.details()
        assert sum(len(m.token_ids) for m in first) == 2 and sum(len(m.token_ids) for m in second) == 2
    _no_leaks(cluster)
    client.close()


def test_health_follows_an_empty_pool(small, llama_dir):
    cluster = small
    channel = grpc.insecure_channel(cluster.address)
    health = health_pb2_grpc.HealthStub(channel)

    def status():
        return health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status
    assert status() == health_pb2.HealthCheckResponse.SERVING
    ray.kill(cluster.router.pools.workers["decode"][0].actor, no_restart=True)  # its only worker
    wait_until(lambda: status() == health_pb2.HealthCheckResponse.NOT_SERVING, 10, "NOT_SERVING")
    wait_until(lambda: status() == health_pb2.HealthCheckResponse.SERVING, 60, "SERVING again")
    client = Client(cluster.address)
    prompt = _prompt(51)
    tokens, last = client.tokens(prompt, max_tokens=4)
    assert tokens == hf_greedy(llama_dir, prompt, 4) and last.usage.migrations == 0
    client.close()
    channel.close()
    _no_leaks(cluster)
