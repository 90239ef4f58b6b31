"""Prefill and decode pools of different sizes (prefill.num_blocks / decode.num_blocks): each stage
is held to what it keeps (a prefill worker: the prompt and its next token; a decode worker:
prompt + max_tokens), a request that cannot finish anywhere is refused at once, and no block leaks."""

from __future__ import annotations

import grpc
import pytest
import ray

from router.launch import LocalCluster
from tests.cluster_util import Client, cluster_config, wait_until, whole
from tests.reference import hf_greedy

pytestmark = pytest.mark.usefixtures("ray_instance")
BS, PREFILL_BLOCKS, DECODE_BLOCKS = 16, 8, 40  # prefill: 128 tokens; decode: 640


@pytest.fixture(scope="module")
def uneven(ray_instance, llama_dir):
    cfg = cluster_config(llama_dir, prefill={"replicas": 1, "num_cpus": 0.5, "num_blocks": PREFILL_BLOCKS},
                         decode={"replicas": 1, "num_cpus": 0.5, "num_blocks": DECODE_BLOCKS})
    with LocalCluster(cfg) as c:
        yield c


def _refused(client: Client, prompt: list[int], max_tokens: int) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        client.tokens(prompt, max_tokens=max_tokens, ignore_eos=True)
    return err.value.code(), err.value.details()


def test_the_pools_have_the_sizes_asked(uneven):
    sizes = {w.info.pool: ray.get(w.actor.check.remote(), timeout=30)["total"] for w in uneven.router.pools.all()}
    assert sizes == {"prefill": PREFILL_BLOCKS, "decode": DECODE_BLOCKS}


def test_a_long_generation_from_a_prompt_only_prefill_can_hold_succeeds(uneven, llama_dir):
    client = Client(uneven.address)
    prompt = [(7 * i) % 1500 + 10 for i in range(100)]  # 100 + 1 tokens: 7 of prefill's 8 blocks
    tokens, last = client.tokens(prompt, max_tokens=300, ignore_eos=True)  # 400 tokens: 25 blocks, decode only
    assert tokens == hf_greedy(llama_dir, prompt, 300, ignore_eos=True)
    assert last.usage.migrations == 0 and last.finish_reason == "length"
    client.close()
    wait_until(lambda: whole(uneven), 30, "no block held after the long generation")


def test_what_cannot_finish_anywhere_is_invalid_at_once(uneven):
    client = Client(uneven.address)
    too_long_for_prefill = [11] * 128  # 128 + 1 tokens: 9 blocks, the prefill pool has 8
    assert _refused(client, too_long_for_prefill, 4) == (
        grpc.StatusCode.INVALID_ARGUMENT, f"the request needs 9 KV blocks but the largest worker KV pool has "
                                          f"{PREFILL_BLOCKS}; lower max_tokens or the prompt length")
    assert _refused(client, [11] * 20, 640) == (  # 660 tokens: 42 blocks, the decode pool has 40
        grpc.StatusCode.INVALID_ARGUMENT, f"the request needs 42 KV blocks but the largest worker KV pool has "
                                          f"{DECODE_BLOCKS}; lower max_tokens or the prompt length")
    assert uneven.router.metrics.registry.get_sample_value("pdserve_request_migrations_total") in (None, 0.0)
    client.close()
    wait_until(lambda: whole(uneven), 30, "no block held after the refusals")
