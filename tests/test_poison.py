"""A request that breaks the forward pass harms nobody else (issue 46, finding 7): the engine runs
a failed step again in halves (engine/isolation.py), fails the request whose forward fails alone
with a message that says so, and the others go on where they are, token for token, uncharged.

The poison is fault injection's `poison_token` (worker_runtime/faults.py): every forward holding a
prompt with that token fails, naming no culprit. The cluster test goes through the real front
doors of the session's shared cluster."""

from __future__ import annotations

import json
import random
import threading
import time
import urllib.error
import urllib.request

import grpc
import pytest
import ray

from engine.config import EngineConfig
from engine.isolation import ForwardFailed, isolate
from engine.llm_engine import LLMEngine
from protocol.outputs import FinishReason, RequestOutput
from protocol.sampling import SamplingParams
from tests.cluster_util import Client, faults, wait_until, whole
from tests.reference import hf_greedy
from worker_runtime.engine_loop import EngineLoop
from worker_runtime.faults import FaultConfig, Faults

POISON = 7  # no good prompt below holds it (they draw from 10..1999)
FORWARD_BREAKS = "the model's forward pass fails on this request"


def _prompt(seed: int, n: int = 24) -> list[int]:
    rng = random.Random(f"poison-{seed}")
    return [rng.randrange(10, 2000) for _ in range(n)]


def _runner(bad: set[int], calls: list[list[int]]):
    """A forward over ints that fails when it holds any of `bad`; records each call's items."""
    def run(part: list[int]) -> list[int]:
        calls.append(part)
        if bad & set(part):
            raise ForwardFailed(RuntimeError(f"bad {sorted(bad & set(part))}"))
        return part
    return run


@pytest.mark.parametrize("bad", [{0}, {5}, {7}, {2, 6}, {0, 1}])
def test_isolation_runs_every_good_item_once_and_names_each_culprit(bad):
    calls: list[list[int]] = []
    found = isolate(list(range(8)), _runner(bad, calls))
    assert not found.gave_up
    assert sorted(found.outputs) == sorted(set(range(8)) - bad)  # each good item's step ran exactly once
    assert sorted(c for c, _ in found.culprits) == sorted(bad)
    assert all(f"bad [{c}]" in str(e) for c, e in found.culprits)
    assert all(part == sorted(part) for part in calls)  # parts keep the step's order
    if len(bad) == 1:
        assert len(calls) <= 2 * 3  # 2·log2(8)


def test_isolation_gives_up_when_no_forward_succeeds():
    """Every forward fails (a broken device): after bit_length(n)+1 failures isolation stops, and
    a step of one item cannot be isolated at all; nothing ran."""
    calls: list[list[int]] = []
    found = isolate(list(range(64)), _runner(set(range(64)), calls))
    assert found.gave_up and not found.outputs and len(calls) == (64).bit_length() + 1
    lone = isolate([3], _runner({3}, calls := []))
    assert lone.gave_up and not calls
    pair = isolate([3, 4], _runner({3, 4}, calls := []))
    assert pair.gave_up and not pair.outputs and len(calls) == 2  # both failed alone: not told from a broken worker


@pytest.fixture(scope="module")
def engine(llama_dir) -> LLMEngine:
    engine = LLMEngine(EngineConfig(model_path=llama_dir, num_blocks=128, dtype="float32"))
    engine.before_forward = Faults(FaultConfig(poison_token=POISON), "test").before_forward
    return engine


def _run_loop(engine: LLMEngine, add, ids: set[str]) -> tuple[list[RequestOutput], EngineLoop]:
    outputs: list[RequestOutput] = []
    loop = EngineLoop(lambda: engine, outputs.extend, name="poison")
    loop.call(add).result(10)
    deadline = time.monotonic() + 60  # bounds a hang only
    while {o.request_id for o in outputs if o.finished} != ids and time.monotonic() < deadline:
        time.sleep(0.01)
    loop.stop()
    return outputs, loop


def _by_request(outputs: list[RequestOutput]) -> dict[str, list[RequestOutput]]:
    out: dict[str, list[RequestOutput]] = {}
    for o in outputs:
        out.setdefault(o.request_id, []).append(o)
    return out


def test_a_poison_prompt_among_decodes_fails_alone_and_the_rest_are_token_exact(engine, llama_dir):
    """Five requests decode; a sixth whose prompt breaks every forward arrives among them (its
    prefill chunk and their decodes share the step). It fails for good, naming the forward; the
    step does not raise (a worker's loop would count no failed step); the five finish as
    transformers' generate does; no block is held."""
    sampling = SamplingParams(max_tokens=12, ignore_eos=True)
    prompts = {f"good-{i}": _prompt(i) for i in range(5)}
    for rid, p in prompts.items():
        engine.add_request(rid, prompt_token_ids=p, sampling=sampling)
    outputs = engine.step()  # their prefills: the poison comes in while they decode
    engine.add_request("poison", prompt_token_ids=_prompt(99)[:10] + [POISON] + _prompt(98)[:10], sampling=sampling)
    while engine.has_unfinished():
        outputs += engine.step()
    by_id = _by_request(outputs)
    (failed,) = by_id.pop("poison")
    assert failed.finish_reason is FinishReason.ERROR and not failed.retryable
    assert FORWARD_BREAKS in failed.text and f"holds token {POISON}" in failed.text
    for rid, outs in by_id.items():
        assert [t for o in outs for t in o.token_ids] == hf_greedy(llama_dir, prompts[rid], 12, ignore_eos=True), rid
        assert outs[-1].finish_reason is FinishReason.LENGTH and not any(o.retryable for o in outs)
    assert engine.allocator.num_used == 0
    engine.check()


def test_a_poison_prompt_alone_fails_its_step_retryably(engine):
    """Alone in its batch the poison cannot be told from a broken worker: the step fails as every
    failed step did, retryably (the request moves), and the loop counts it."""
    outputs, loop = _run_loop(engine, lambda e: e.add_request(
        "alone", prompt_token_ids=[POISON] * 5, sampling=SamplingParams(max_tokens=4)), {"alone"})
    assert [(o.request_id, o.finish_reason, o.retryable) for o in outputs] == [("alone", FinishReason.ERROR, True)]
    assert f"holds token {POISON}" in outputs[0].text and loop.beat().failed_steps_in_a_row == 1
    assert engine.allocator.num_used == 0
    engine.check()


def _hold_until_queued(worker, count: int) -> None:
    """Occupy `worker`'s engine thread until `count` prefills wait for it (each is queued on the
    engine by then), so that they all start in one step."""
    def hold(actor) -> None:
        def wait(engine) -> None:
            deadline = time.monotonic() + 20  # within router.unresponsive_s (30 s): a hang fails, no worker is replaced
            while len(actor._waiters) < count and time.monotonic() < deadline:
                time.sleep(0.005)
        actor.core.loop.call(wait)
    ray.get(worker.actor.__ray_call__.remote(hold), timeout=30)


def _post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_a_poison_request_in_a_prefill_batch_fails_alone_through_the_front_doors(served, llama_dir):
    """Five gRPC requests and one HTTP request whose prompt breaks the forward reach one prefill
    worker together and start in one step. The poison gets HTTP 500 saying the forward fails on it;
    the five stream exactly transformers' tokens with no migration; the worker stays; no block is
    held after."""
    prompts = [_prompt(10 + i) for i in range(5)]
    references = [hf_greedy(llama_dir, p, 8, ignore_eos=True) for p in prompts]
    prefill = served.router.pools.workers["prefill"][0]
    client = Client(served.address)
    results: dict = {}

    def good(i: int) -> None:
        try:
            results[i] = client.tokens(prompts[i], max_tokens=8, ignore_eos=True)
        except grpc.RpcError as e:
            results[i] = e

    def bad() -> None:
        results["poison"] = _post(f"{served.http_url}/completions",
                                  {"prompt": _prompt(20)[:12] + [POISON], "max_tokens": 8})
    with faults(served, poison_token=POISON):
        _hold_until_queued(prefill, len(prompts) + 1)
        threads = [threading.Thread(target=good, args=(i,)) for i in range(len(prompts))]
        threads.append(threading.Thread(target=bad))
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    status, body = results.pop("poison")
    assert status == 500 and body["error"]["type"] == "server_error", body
    assert FORWARD_BREAKS in body["error"]["message"] and "the requests batched with it ran" in body["error"]["message"]
    for i, (tokens, last) in sorted(results.items()):
        assert tokens == references[i] and last.finish_reason == "length", i
        assert last.usage.migrations == 0, i
    assert not prefill.stopped and served.router.pools.workers["prefill"] == [prefill]
    wait_until(lambda: whole(served), 60, "the cluster to be whole: no request, no block held")
    client.close()
