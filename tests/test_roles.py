"""A worker that changes role (prefill <-> decode) without a restart, its weights kept loaded.

On a real 2 + 1 cluster: a prefill worker becomes a decode worker while requests stream (every
one finishes with transformers' greedy tokens: nothing lost), in the same process (same pid), and
serves token-exact under its new name with KV pushed over a fresh channel; then it changes back;
every block is free at the end. The pool manager refuses a change that would empty a pool. In the
simulator the same change keeps its `SimCore` and takes no weights load.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import ray

from protocol.errors import InvalidRequest
from protocol.sampling import SamplingParams
from router.config.loader import load_config
from router.launch import LocalCluster
from router.lifecycle.outcomes import CannotChangeRole
from router.lifecycle.service import Router
from simulate.actors import SimActors
from simulate.cli import emulated
from simulate.run import _validator, run_virtual
from tests.cluster_util import Client, cluster_config, faults, wait_until
from tests.reference import hf_greedy

pytestmark = pytest.mark.usefixtures("ray_instance")  # one local Ray for the module (conftest)
ROOT = Path(__file__).resolve().parent.parent


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(f"test_roles-{seed}")
    return [rng.randrange(10, 2000) for _ in range(n)]


@pytest.fixture(scope="module")
def cluster(llama_dir):
    cfg = cluster_config(llama_dir, prefill={"replicas": 2}, router={"policy": "load"},
                         scheduler={"chunk_size": 16, "max_num_batched_tokens": 32})
    with LocalCluster(cfg) as c:
        yield c


def _pid(w) -> int:
    return ray.get(w.actor.__ray_call__.remote(lambda actor: os.getpid()), timeout=30)


def _whole(c: LocalCluster) -> bool:
    counts = ray.get([w.actor.check.remote() for w in c.router.pools.all() if not w.stopped], timeout=30)
    return all(x["used"] == 0 and x["free"] == x["total"] and x["requests"] == 0 for x in counts)


def _names(c: LocalCluster, pool: str) -> list[str]:
    return sorted(w.name for w in c.router.pools.ready(pool))


def test_a_prefill_worker_becomes_a_decode_worker_mid_traffic_and_back_token_exact(cluster, llama_dir):
    client = Client(cluster.address)
    pools = cluster.router.pools
    moving = next(w for w in pools.ready("prefill") if w.name == "prefill-1")
    pid = _pid(moving)
    prompts = [_tokens(40 + 7 * i, seed=i) for i in range(6)]
    # slow steps: what is placed on prefill-1 is still there when its change begins (it drains)
    with faults(cluster, step_delay_s=0.1), ThreadPoolExecutor(len(prompts)) as streams:
        futures = [streams.submit(client.tokens, p, max_tokens=12, ignore_eos=True) for p in prompts]
        wait_until(lambda: moving.inflight, 60, "a request placed on prefill-1")
        new_name = cluster.call(cluster.router.change_role("prefill-1", "decode"), timeout=120)
        served = [f.result(timeout=120) for f in futures]
    for prompt, (tokens, last) in zip(prompts, served, strict=True):
        assert tokens == hf_greedy(llama_dir, prompt, 12, ignore_eos=True)
        assert last.finish_reason == "length"
    assert "prefill-1" in {last.usage.prefill_worker for _, last in served}  # it drained what it held
    assert (new_name, _names(cluster, "prefill"), _names(cluster, "decode")) == \
        ("decode-3", ["prefill-0"], ["decode-2", "decode-3"])
    (new,) = [w for w in pools.ready("decode") if w.name == new_name]
    assert _pid(new) == pid  # the same process: no restart, its weights kept loaded
    assert pools.targets == {"prefill": 1, "decode": 2}
    # the new decode worker takes requests, its KV pushed from prefill-0 over a fresh channel
    fresh = [_tokens(50, seed=100 + i) for i in range(4)]
    results = [client.tokens(p, max_tokens=8, ignore_eos=True) for p in fresh]
    for prompt, (tokens, _) in zip(fresh, results, strict=True):
        assert tokens == hf_greedy(llama_dir, prompt, 8, ignore_eos=True)
    on_new = [last.usage for _, last in results if last.usage.decode_worker == new_name]
    assert on_new and all(u.prefill_worker == "prefill-0" and u.kv_transfer_bytes > 0 for u in on_new)
    wait_until(lambda: _whole(cluster), 30, "every block free after the change")
    # and back: the decode worker becomes a prefill worker again, still the same process
    back = cluster.call(cluster.router.change_role(new_name, "prefill"), timeout=120)
    assert _names(cluster, "prefill") == sorted(["prefill-0", back]) and _names(cluster, "decode") == ["decode-2"]
    assert _pid(next(w for w in pools.ready("prefill") if w.name == back)) == pid
    again = [_tokens(60, seed=200 + i) for i in range(3)]
    with ThreadPoolExecutor(3) as streams:
        outs = list(streams.map(lambda p: client.tokens(p, max_tokens=8, ignore_eos=True), again))
    for prompt, (tokens, _) in zip(again, outs, strict=True):
        assert tokens == hf_greedy(llama_dir, prompt, 8, ignore_eos=True)
    assert back in {last.usage.prefill_worker for _, last in outs}
    wait_until(lambda: _whole(cluster), 30, "every block free after changing back")
    client.close()


def test_a_change_that_would_empty_a_pool_or_names_nobody_is_refused(cluster):
    (decode,) = cluster.router.pools.ready("decode")
    with pytest.raises(CannotChangeRole, match=f"{decode.name} is the last ready decode worker"):
        cluster.call(cluster.router.change_role(decode.name, "prefill"))
    with pytest.raises(CannotChangeRole, match="is a prefill worker already"):
        cluster.call(cluster.router.change_role("prefill-0", "prefill"))
    with pytest.raises(InvalidRequest, match="no live worker is named 'prefill-9'"):
        cluster.call(cluster.router.change_role("prefill-9", "decode"))
    assert decode.accepting and cluster.router.pools.targets == {"prefill": 2, "decode": 1}


# ---- in the simulator -------------------------------------------------------------------
async def _simulated(cfg, em, prompts: list[list[int]], change: bool) -> tuple[list[list[int]], dict, float]:
    actors = SimActors(em, em.cost.shape, cfg.kv_cache.block_size)
    router = Router(cfg, actors=actors, validator=_validator(em.cost.shape, cfg), nonce=lambda: "0" * 16)
    await router.start()

    async def one(i: int, prompt: list[int]) -> list[int]:
        await asyncio.sleep(0.01 * i)
        life = router.accept(f"r{i}", prompt, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
        return [t for chunk in [c async for c in router.generate(life)] for t in chunk.token_ids]
    tasks = [asyncio.create_task(one(i, p)) for i, p in enumerate(prompts)]
    took = 0.0
    if change:
        await asyncio.sleep(0.02)
        began = asyncio.get_running_loop().time()
        await router.change_role("prefill-1", "decode")
        took = asyncio.get_running_loop().time() - began
    outs = await asyncio.gather(*tasks)
    checks = {w.name: await w.actor.check.remote() for w in router.pools.all() if not w.stopped}
    router.monitor.stop()
    for worker in actors.workers.values():
        worker.core.stop()
    return outs, checks, took


def test_in_the_simulator_a_role_change_keeps_its_core_and_loses_nothing():
    base = load_config(str(ROOT / "cluster.yaml"))
    cfg, em = emulated(base, dataclasses.replace(base.emulate, device="h100", model="llama-3.1-8b"), "test")
    cfg = dataclasses.replace(cfg, prefill=dataclasses.replace(cfg.prefill, replicas=2))
    prompts = [_tokens(3000, seed=300 + i) for i in range(8)]
    runs = {}
    for change in (False, True):
        runs[change] = run_virtual(lambda change=change: _simulated(cfg, em, prompts, change))
    assert runs[True][0] == runs[False][0]  # every request's tokens, as without the change
    checks = runs[True][1]
    assert sorted(checks) == ["decode-2", "decode-3", "prefill-0"]
    assert all(c["used"] == 0 and c["free"] == c["total"] for c in checks.values()), checks
    assert 0 < runs[True][2] < em.startup_s  # drained and switched, faster than loading the weights
