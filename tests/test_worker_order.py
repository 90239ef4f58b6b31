"""Ray does not keep an async actor's calls in submission order: a worker must serve a call that
overtook the one sent before it. Real worker actors, called directly as the router calls them."""

from __future__ import annotations

import random
import time

import pytest
import ray

from decode_worker.worker import DecodeWorker
from kv_transfer import KVTransferConfig
from prefill_worker.worker import PrefillWorker
from protocol.messages import GenerateTask, PrefillTask, Reservation, StartDecode
from protocol.outputs import FinishReason
from protocol.sampling import SamplingParams
from tests.cluster_util import cluster_config
from tests.reference import hf_greedy

pytestmark = pytest.mark.usefixtures("ray_instance")  # one local Ray for the module (conftest)

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def workers(llama_dir):
    cfg = cluster_config(llama_dir)
    transfer = KVTransferConfig(timeout_s=cfg.kv_transfer.timeout_s)
    prefill = ray.remote(PrefillWorker).options(num_cpus=0.5, max_concurrency=1000).remote(
        "prefill-0", cfg.engine_config(cfg.prefill), transfer)
    decode = ray.remote(DecodeWorker).options(num_cpus=0.5, max_concurrency=1000).remote(
        "decode-0", cfg.engine_config(cfg.decode), transfer)
    ray.get([prefill.ready.remote(), decode.ready.remote()], timeout=120)
    yield prefill, decode
    ray.get([prefill.shutdown.remote(), decode.shutdown.remote()], timeout=60)
    for actor in (prefill, decode):
        ray.kill(actor)


def _prompt(seed: int) -> list[int]:
    return [random.Random(seed).randrange(10, 500) for _ in range(40)]


def _tokens(decode, request_id: str, deadline_s: float = 60.0) -> list[int]:
    """The decode worker's outputs for `request_id` until it finishes."""
    tokens, end = [], time.monotonic() + deadline_s
    while time.monotonic() < end:
        for out in ray.get(decode.poll.remote(0.5), timeout=10):
            if out.request_id == request_id:
                tokens += out.token_ids
                if out.finished:
                    return tokens
    raise TimeoutError(f"{request_id} did not finish within {deadline_s} s")


def _idle(actor) -> dict:
    counts = ray.get(actor.check.remote(), timeout=30)
    assert counts["free"] + counts["used"] == counts["total"]
    return counts


def test_an_aim_that_overtakes_its_early_prefill_still_sends_the_kv(workers, llama_dir):
    prefill, decode = workers
    prompt = _prompt(1)
    reserved = ray.get(decode.reserve.remote(Reservation("a.0", len(prompt) + 1, 60.0, tuple(prompt))), timeout=30)
    assert reserved is not None and reserved.cached_blocks == 0
    assert ray.get(prefill.aim.remote("a.0", reserved.cached_blocks), timeout=30)  # before the prefill call
    task = PrefillTask("a.0", prompt, GREEDY, "decode-0", skip_blocks=None)  # as sent during the reservation
    res = ray.get(prefill.prefill.remote(task, decode), timeout=60)
    assert res.finish_reason is FinishReason.PREFILLED
    ray.get(decode.start.remote(StartDecode("a.0", prompt, [res.token_id], GREEDY, len(res.text), 30.0)), timeout=30)
    assert [res.token_id] + _tokens(decode, "a.0") == hf_greedy(llama_dir, prompt, 6, ignore_eos=True)
    assert _idle(prefill)["used"] == 0 and _idle(decode)["used"] == 0


def test_an_abort_that_overtakes_its_prefill_refuses_it(workers):
    prefill, _ = workers
    ray.get(prefill.abort.remote("b.0"), timeout=30)
    assert not ray.get(prefill.aim.remote("b.0", 0), timeout=30)
    # refused as cancelled (the worker raises CancelledError: Ray reports the task cancelled), not
    # failed on its way (a RayTaskError of another kind) and not served
    with pytest.raises(ray.exceptions.TaskCancelledError, match="was cancelled"):
        ray.get(prefill.prefill.remote(PrefillTask("b.0", _prompt(2), GREEDY, "decode-0"), None), timeout=60)
    counts = _idle(prefill)
    assert counts["used"] == 0 and counts["requests"] == 0


def test_an_abort_that_overtakes_its_colocated_generate_leaves_nothing_running(workers):
    _, decode = workers
    served = ray.get(decode.stats.remote(), timeout=30).served
    ray.get(decode.abort.remote("c.0"), timeout=30)
    ray.get(decode.generate.remote(GenerateTask("c.0", _prompt(3), GREEDY)), timeout=30)
    # had the generate been taken, its 6 tokens would leave within a few steps: none ever does
    outputs, end = [], time.monotonic() + 1.0
    while time.monotonic() < end:
        outputs += [out for out in ray.get(decode.poll.remote(0.2), timeout=10) if out.request_id == "c.0"]
    assert outputs == []
    assert ray.get(decode.stats.remote(), timeout=30).served == served
    counts = _idle(decode)
    assert counts["used"] == 0 and counts["requests"] == 0 and counts["reserved"] == 0


def test_an_abort_that_overtakes_its_reservation_refuses_it(workers):
    _, decode = workers
    ray.get(decode.abort.remote("d.0"), timeout=30)
    prompt = _prompt(4)
    assert ray.get(decode.reserve.remote(Reservation("d.0", len(prompt) + 1, 60.0, tuple(prompt))), timeout=30) is None
    counts = _idle(decode)
    assert counts["used"] == 0 and counts["reserved"] == 0
