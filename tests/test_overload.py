"""Hostile load end to end, on real Ray actors, gRPC, HTTP and KV channels: an engine thread that
stalls (a stuck CUDA or NCCL call) makes its worker a dead one, a failed engine step fails only
its culprit, and a saturated cluster refuses at arrival instead of after router.queue_timeout_s.

One cluster for the module (a start costs 8-10 s): disaggregated, 1 prefill + 2 decode workers,
short deadlines (calls 2 s, an engine silent 3 s is a dead worker, 2 s in the queue), one prefill
at a time, 32-token prefill chunks. Faults go on one worker at a time and off again."""

from __future__ import annotations

import json
import random
import re
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
import ray

from protocol.messages import Reservation
from router.launch import LocalCluster
from router.lifecycle.life import Phase
from router.pools.monitor import BEAT_EVERY_S, POLL_WAIT_S, STEP_FAILURES_LIMIT
from tests.cluster_util import (
    Client,
    cluster_config,
    set_worker_faults,
    wait_until,
    whole,
)
from tests.reference import hf_greedy

pytestmark = pytest.mark.usefixtures("ray_instance")
UNRESPONSIVE_S = 3.0
CALL_TIMEOUT_S = 2.0
QUEUE_TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def busy(ray_instance, llama_dir):
    cfg = cluster_config(
        llama_dir, decode={"replicas": 2}, scheduler={"chunk_size": 32, "max_num_batched_tokens": 32},
        router={"http_port": 0, "call_timeout_s": CALL_TIMEOUT_S, "unresponsive_s": UNRESPONSIVE_S,
                "queue_timeout_s": QUEUE_TIMEOUT_S, "restart_backoff_s": 0.2, "max_prefill_inflight": 1,
                "migration_limit": 3})
    with LocalCluster(cfg) as cluster:
        yield cluster


def _prompt(seed: int, n: int = 24) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 2000) for _ in range(n)]


def _healed(cluster: LocalCluster) -> None:
    wait_until(lambda: whole(cluster), 60, "the cluster to be whole: pools healed, no request, no KV block held",
               every=0.1)


def _stream(client: Client, prompt: list[int], out: dict, key, **sampling) -> threading.Thread:
    """Stream a request on a thread; `out[key]` is (tokens, last message) or the RpcError."""
    def run() -> None:
        tokens, last = [], None
        try:
            for msg in client.stream(prompt, **sampling):
                tokens.extend(msg.token_ids)
                last = msg
            out[key] = (tokens, last)
        except grpc.RpcError as e:
            out[key] = e
    t = threading.Thread(target=run)
    t.start()
    return t


def _decoding(cluster: LocalCluster, count: int) -> list:
    wait_until(lambda: sum(life.phase is Phase.DECODING and bool(life.output_token_ids)
                           for life in cluster.router.lives.values()) == count, 30, f"{count} requests decoding")
    return list(cluster.router.lives.values())


def test_a_stalled_engine_is_a_dead_worker_and_placement_goes_on(busy, llama_dir):
    """The decode engine serving a request blocks (faults.stall_engine_s: a step stuck in a CUDA
    call) while its actor still answers. It is failed within unresponsive_s + one poll, the request
    finishes on the other decode worker token for token, and requests placed meanwhile never wait
    in the queue longer than one call deadline."""
    client = Client(busy.address)
    prompt, other = _prompt(1), _prompt(2)
    reference = hf_greedy(llama_dir, prompt, 150, ignore_eos=True)
    other_reference = hf_greedy(llama_dir, other, 4, ignore_eos=True)
    out: dict = {}
    streaming = _stream(client, prompt, out, "stalled", max_tokens=150, ignore_eos=True)
    (life,) = _decoding(busy, 1)
    stalled = life.decode
    set_worker_faults([stalled], stall_engine_s=3600)
    t0 = time.monotonic()
    placed: list = []
    done = threading.Event()

    def keep_placing() -> None:
        while not done.is_set():
            placed.append(client.tokens(other, max_tokens=4, ignore_eos=True))
    placing = threading.Thread(target=keep_placing)
    placing.start()
    try:
        # bounds the detection too: unresponsive_s + one poll + one beat, and 10 s for a loaded host
        wait_until(lambda: stalled.stopped, UNRESPONSIVE_S + POLL_WAIT_S + BEAT_EVERY_S + 10,
                   "the stalled worker to be failed")
        detected_s = time.monotonic() - t0
    finally:
        done.set()
        placing.join(60)
        streaming.join(60)
    assert "its engine made no progress" in busy.router.pools.health["decode"].last_failure
    tokens, last = out["stalled"]
    assert tokens == reference and last.finish_reason == "length"
    assert last.usage.migrations == 1 and last.usage.decode_worker != stalled.name
    assert placed and all(tokens == other_reference for tokens, _ in placed)
    # none waited for the stall to be found: each gave up on the stalled worker at its call deadline
    assert max(last.usage.queue_ms for _, last in placed) < detected_s * 1e3
    _healed(busy)
    client.close()


def _hold(worker) -> None:
    """Occupy `worker`'s engine thread until `_release` (60 s at most: a failed test lets it go)."""
    def hold(actor) -> None:
        actor.test_release = threading.Event()
        actor.core.loop.call(lambda engine: actor.test_release.wait(60))
    ray.get(worker.actor.__ray_call__.remote(hold), timeout=30)


def _release(worker) -> None:
    ray.get(worker.actor.__ray_call__.remote(lambda actor: actor.test_release.set()), timeout=30)


def _reserve_wait(seconds: float):
    """For __ray_call__: sets the actor process's RESERVE_WAIT_S (a closure, so Ray pickles it by value)."""
    def set_it(actor) -> None:
        import decode_worker.worker as module  # the actor's own copy of the module
        module.RESERVE_WAIT_S = seconds
    return set_it


def test_a_reserve_the_engine_cannot_take_in_time_answers_no_room_and_holds_nothing(busy):
    """The router waits for a reserve under its admission lock: a decode engine busy in a long step
    (held until the test lets it go) answers "no room" after RESERVE_WAIT_S, while the step still
    runs, and never makes the reservation it gave up on; a free engine reserves as before."""
    w = busy.router.pools.workers["decode"][0]
    _hold(w)
    try:
        assert ray.get(w.actor.reserve.remote(Reservation("overload-late", 40, 30.0)), timeout=30) is None
    finally:
        _release(w)  # answered while held: the hold ends only here
    wait_until(lambda: ray.get(w.actor.check.remote(), timeout=30)["used"] == 0, 10, "the hold to end")
    assert ray.get(w.actor.check.remote(), timeout=30)["reserved"] == 0  # it was never made
    reserved = ray.get(w.actor.reserve.remote(Reservation("overload-now", 40, 30.0)), timeout=30)
    assert reserved is not None and reserved.num_blocks == 3
    ray.get(w.actor.abort.remote("overload-now"), timeout=30)
    _healed(busy)


def test_a_reserve_answers_no_room_at_the_deadline_it_carries(busy):
    """A reserve carries the request's queue deadline (Reservation.wait_s): on an engine held in a
    long step it answers "no room" then, not after RESERVE_WAIT_S (raised to an hour here, so an
    answer while the engine is held can only come from the carried deadline), and holds nothing."""
    w = busy.router.pools.workers["decode"][0]
    ray.get(w.actor.__ray_call__.remote(_reserve_wait(3600.0)), timeout=30)
    _hold(w)
    try:
        t0 = time.monotonic()
        assert ray.get(w.actor.reserve.remote(Reservation("overload-soon", 40, 30.0, wait_s=0.3)), timeout=30) is None
        assert time.monotonic() - t0 >= 0.3
    finally:
        _release(w)
        ray.get(w.actor.__ray_call__.remote(_reserve_wait(1.0)), timeout=30)
    wait_until(lambda: ray.get(w.actor.check.remote(), timeout=30)["used"] == 0, 10, "the hold to end")
    assert ray.get(w.actor.check.remote(), timeout=30)["reserved"] == 0
    _healed(busy)


def test_a_request_no_engine_can_take_is_refused_at_its_queue_deadline(busy):
    """Every decode engine is held in a long step past a new request's queue deadline: the request
    hears UNAVAILABLE at router.queue_timeout_s, not later. Before, each reserve waited its own
    RESERVE_WAIT_S past the deadline, and an early prefill dropped for "no room" placed the
    request again with a fresh queue timeout (heard after up to twice the timeout)."""
    client = Client(busy.address)
    (prefill,), decode = busy.router.pools.workers["prefill"], busy.router.pools.workers["decode"]
    for i in range(10):  # the prefill worker has a channel to each decode worker: prefills start early
        if prefill.peers >= {w.name for w in decode}:
            break
        client.many([_prompt(10 * i + j) for j in range(4)], max_tokens=2)
    assert prefill.peers >= {w.name for w in decode}
    for w in decode:
        _hold(w)  # until released below, however late the refusal comes: it cannot be served meanwhile
    try:
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as refused:
            client.tokens(_prompt(6), max_tokens=2)
        heard_s = time.monotonic() - t0
    finally:
        for w in decode:
            _release(w)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value
    assert f"no worker had capacity for this request within {QUEUE_TIMEOUT_S:g} s" in refused.value.details()
    # at its deadline, not at twice it (the old fault); the margin, QUEUE_TIMEOUT_S, is the router
    # loop's lateness a loaded host may add (the engines are held meanwhile, so nothing else ends it)
    assert QUEUE_TIMEOUT_S <= heard_s < 2 * QUEUE_TIMEOUT_S, heard_s
    _healed(busy)
    client.close()


def test_a_failed_step_fails_its_culprit_alone_and_moves_the_rest(busy, llama_dir):
    """One engine step fails on a decode worker, naming its longest request (a long context's CUDA
    OOM; faults.fail_culprit). That request fails INTERNAL; the worker's other requests move and
    finish token for token; requests on the other worker never notice; the worker stays."""
    client = Client(busy.address)
    prompts = {n: _prompt(n, n) for n in (20, 40, 60, 100)}
    references = {n: hf_greedy(llama_dir, p, 80, ignore_eos=True) for n, p in prompts.items()}
    out: dict = {}
    # decode steps held to 30 ms while the prompts are prefilled one at a time: the first requests
    # are still decoding when the last arrives, however fast the engine decodes
    decoders = busy.router.pools.workers["decode"]
    set_worker_faults(decoders, step_delay_s=0.03)
    threads = [_stream(client, p, out, n, max_tokens=80, ignore_eos=True) for n, p in prompts.items()]
    lives = _decoding(busy, len(prompts))
    on = {len(life.prompt_token_ids): life.decode for life in lives}
    victim = on[100]
    set_worker_faults(decoders)
    set_worker_faults([victim], fail_steps=1, fail_culprit="longest")
    for t in threads:
        t.join(60)
    try:
        err = out.pop(100)
        assert isinstance(err, grpc.RpcError) and err.code() == grpc.StatusCode.INTERNAL
        assert "injected step failure" in err.details() and "ran out of memory" in err.details()
        for n, (tokens, last) in out.items():
            assert tokens == references[n] and last.finish_reason == "length", n
            assert last.usage.migrations == (on[n] is victim), (n, on[n].name, victim.name)
        assert not victim.stopped
    finally:
        set_worker_faults([victim])
    _healed(busy)
    client.close()


def test_a_worker_whose_steps_keep_failing_is_replaced_and_nothing_is_lost(busy, llama_dir):
    """Every engine step of one decode worker fails (a device gone bad) with no culprit named: each
    failure moves its requests elsewhere, and after STEP_FAILURES_LIMIT failed steps in a row the
    monitor replaces the worker. Every request finishes token for token; no block is held after."""
    client = Client(busy.address)
    victim = busy.router.pools.workers["decode"][0]
    set_worker_faults([victim], fail_steps=1000)
    # up to 16 requests, one after another, until the victim is replaced: each lands on the emptier
    # worker, the victim included, and how many it gets before its third failed step depends on timing
    prompts = [_prompt(300 + i) for i in range(16)]
    references = [hf_greedy(llama_dir, p, 12, ignore_eos=True) for p in prompts]
    out: dict = {}
    for i, p in enumerate(prompts):
        _stream(client, p, out, i, max_tokens=12, ignore_eos=True).join(60)
        if victim.stopped:
            break
    wait_until(lambda: victim.stopped, 30, "the failing worker to be replaced")
    failed = re.search(r"(\d+) engine steps failed in a row", busy.router.pools.health["decode"].last_failure)
    assert failed and int(failed.group(1)) >= STEP_FAILURES_LIMIT  # the monitor polls: one more may have failed
    assert out and all(not isinstance(v, grpc.RpcError) for v in out.values()), out
    for i, (tokens, last) in out.items():
        assert tokens == references[i] and last.finish_reason == "length", i
    assert all(last.usage.decode_worker != victim.name for _, last in out.values())  # it finished none
    assert any(last.usage.migrations for _, last in out.values())  # and failed some, which moved
    _healed(busy)
    client.close()


def _post(url: str, body: dict) -> tuple[int, str | None, dict]:
    """Status, Retry-After header (None if absent) and JSON body of a POST."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, r.headers.get("Retry-After"), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Retry-After"), json.loads(e.read())


def test_a_saturated_cluster_refuses_at_arrival_with_retry_after(busy, llama_dir):
    """Slow prefills (one at a time) build a queue; once the router has measured how fast it
    places, a request that would wait longer than queue_timeout_s gets RESOURCE_EXHAUSTED at once,
    with trailing metadata `retry-after`, and HTTP 429 with a Retry-After header: not UNAVAILABLE
    after the queue timeout."""
    client = Client(busy.address)
    admission = busy.router.admission
    prefill = busy.router.pools.workers["prefill"]
    out: dict = {}
    set_worker_faults(prefill, step_delay_s=0.2)
    try:
        threads = [_stream(client, _prompt(100 + i), out, i, max_tokens=2, ignore_eos=True) for i in range(24)]
        wait_until(lambda: admission.predicted_wait_s() > QUEUE_TIMEOUT_S, 10, "a predicted wait over the timeout")
        with pytest.raises(grpc.RpcError) as refused:
            list(client.stream(_prompt(99), max_tokens=2))
        status, http_retry_after, body = _post(f"{busy.http_url}/completions",
                                      {"model": Path(llama_dir).name, "prompt": _prompt(98), "max_tokens": 2})
        for t in threads:
            t.join(60)
    finally:
        set_worker_faults(prefill)
    # refused at arrival: "saturated" is the arrival prediction's word (a wait that ran out its
    # queue_timeout_s says "no worker had capacity ... within"), so no timing is needed to tell them apart
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "the cluster is saturated" in refused.value.details()
    retry_after = dict(refused.value.trailing_metadata())["retry-after"]
    assert int(retry_after) >= 1
    assert status == 429 and int(http_retry_after) >= 1
    assert body["error"]["code"] == "queue_full" and "router.queue_timeout_s" in body["error"]["message"]
    finished = [v for v in out.values() if not isinstance(v, grpc.RpcError)]
    assert finished and all(last.finish_reason == "length" for _, last in finished)
    refusals = {v.code() for v in out.values() if isinstance(v, grpc.RpcError)}
    assert refusals <= {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED}, refusals
    _healed(busy)
    assert ray.is_initialized()
    client.close()
