"""Conditional disaggregation (router.local_prefill): a disaggregated request whose uncached part is
short, or whose prefill pool is backed up, is prefilled on its decode worker.

Checked: the rule itself; a bad threshold is one line naming the key and exit 2; in the
simulator, an idle request prefilled locally takes exactly one step of the cost model and sends
no KV, and a backed-up prefill pool sends some requests local (none with the rule off), every
block free at the end; on the real cluster, a short prompt and a conversation's next turn run on
the decode worker with transformers' greedy tokens, a long prompt still goes through the prefill
pool, and no block is left held.
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest
import ray
import yaml

from bench.workload import RequestSpec, make_workload
from cli.main import main as pdserve
from router.config.loader import load_config
from router.config.schema import LocalPrefillSection
from router.lifecycle.local_prefill import LocalPrefill
from simulate.cli import emulated
from simulate.run import simulate
from sizing.cost_model import StepItem
from tests.cluster_util import Client, wait_until
from tests.reference import hf_greedy

ROOT = Path(__file__).resolve().parent.parent
BS = 16


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(f"test_local_prefill-{seed}")  # its own prompts: the shared cluster's cache holds others'
    return [rng.randrange(10, 2000) for _ in range(n)]


# ---- the rule ----------------------------------------------------------------------------
def test_the_rule_counts_uncached_tokens_and_the_prefill_pools_work_ahead():
    rule = LocalPrefill(LocalPrefillSection(max_uncached_tokens=100, when_prefill_wait_exceeds="auto"))
    assert rule.reason(100, 0, 0) == "short"
    assert rule.reason(101, 0, 101) is None            # the pool's work ahead equals the local cost
    assert rule.reason(101, 0, 102) == "prefill_wait"
    assert rule.reason(101, 50, 10**6) is None          # one long local prefill at a time per decode worker
    assert rule.reason(101, 0, None) == "prefill_wait"  # no prefill worker takes requests
    rule.set(0, 2.0)
    assert rule.reason(1, 0, 0) is None and rule.reason(100, 0, 201) == "prefill_wait"
    assert rule.reason(100, 0, 200) is None
    rule.set(0, "off")
    assert not rule.enabled and rule.reason(5000, 0, None) is None
    with pytest.raises(ValueError, match="when_prefill_wait_exceeds"):
        rule.set(0, 0.0)


@pytest.mark.parametrize("local, message", [
    ({"max_uncached_tokens": -1}, "router.local_prefill.max_uncached_tokens: must be >= 0"),
    ({"max_uncached_tokens": "short"}, "router.local_prefill.max_uncached_tokens: expected an integer"),
    ({"when_prefill_wait_exceeds": 0}, "router.local_prefill.when_prefill_wait_exceeds: must be auto, off or a "
                                       "factor > 0"),
    ({"when_prefill_wait_exceeds": "sometimes"}, "router.local_prefill.when_prefill_wait_exceeds: expected one of "
                                                 "'auto', 'off' or a number, got 'sometimes'"),
    ({"below": 3}, "router.local_prefill.below: unknown key"),
])
def test_a_bad_threshold_is_one_line_naming_the_key_and_exit_2(tmp_path, capsys, local, message):
    bad = tmp_path / "cluster.yaml"
    bad.write_text(yaml.safe_dump({"router": {"local_prefill": local}}))
    capsys.readouterr()
    code = pdserve(["serve", "--config", str(bad)])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and message in err, err


# ---- in the simulator -------------------------------------------------------------------
@pytest.fixture(scope="module")
def h100_1p1d():
    base = load_config(str(ROOT / "cluster.yaml"))
    cfg, em = emulated(base, dataclasses.replace(base.emulate, device="h100", model="llama-3.1-8b"), "test")
    return dataclasses.replace(cfg, mode="disaggregated", prefill=dataclasses.replace(cfg.prefill, replicas=1),
                               decode=dataclasses.replace(cfg.decode, replicas=1)), em


def _local(cfg, max_uncached: int, wait):
    section = LocalPrefillSection(max_uncached_tokens=max_uncached, when_prefill_wait_exceeds=wait)
    return dataclasses.replace(cfg, router=dataclasses.replace(cfg.router, local_prefill=section))


def test_a_short_request_prefilled_locally_takes_one_step_and_sends_no_kv(h100_1p1d):
    cfg, em = h100_1p1d
    prompt = tuple(range(1000, 1200))  # 200 tokens: one chunk
    workload = make_workload("one", [RequestSpec("r0", 0.0, prompt, 5)], None, {})
    run = simulate(_local(cfg, 256, "off"), em, workload, "local", rpc_s=0.0)
    (record,) = run.records
    assert record.ok and record.output_tokens == 5
    assert (record.usage["prefill_worker"], record.usage["decode_worker"]) == ("", "decode-1")
    # the decode worker's own prefill step; no KV piece anywhere
    assert record.message_times_s[0] - record.send_s == pytest.approx(em.cost.step_s((StepItem(200, 200),)), abs=1e-8)
    assert run.link["pieces"] == 0 and record.usage["kv_transfer_bytes"] == 0
    assert all(c["used"] == 0 and c["free"] == c["total"] for c in run.checks.values()), run.checks


def test_a_backed_up_prefill_pool_sends_requests_local_only_with_the_wait_rule(h100_1p1d):
    cfg, em = h100_1p1d
    specs = [RequestSpec(f"r{i}", 0.03 * i, tuple(range(1000 + i, 5000 + i)), 4) for i in range(8)]  # 4,000 each
    workload = make_workload("burst", specs, None, {})
    placed, run_auto = {}, None
    for wait in ("auto", "off"):
        run = simulate(_local(cfg, 0, wait), em, workload, wait, rpc_s=0.0)
        assert all(r.ok and r.output_tokens == 4 for r in run.records)
        assert all(c["used"] == 0 and c["free"] == c["total"] for c in run.checks.values()), run.checks
        placed[wait] = [r.usage["prefill_worker"] for r in run.records]
        run_auto = run if wait == "auto" else run_auto
    assert placed["off"] == ["prefill-0"] * 8
    assert placed["auto"][0] == "prefill-0" and 1 < placed["auto"].count("") < 8, placed["auto"]
    # the decode worker computed the local prompts one at a time: no step carried chunks of two
    decode_steps = run_auto.steps["decode-1"]["steps"]
    assert max(s["prefill_rows"] for s in decode_steps) == 1, [s["prefill_rows"] for s in decode_steps]


# ---- on the real cluster ----------------------------------------------------------------
@pytest.fixture(scope="module")
def local_on(served):  # the shared 1 + 1 cluster (conftest); thresholds back to off after the module
    local = served.router.attempts.local
    local.set(40, "off")
    yield served
    local.set(0, "off")


def _local_prefills(cluster) -> float:
    return cluster.router.metrics.registry.get_sample_value("pdserve_local_prefills_total", {"reason": "short"}) or 0


def _whole(cluster) -> bool:
    counts = ray.get([w.actor.check.remote() for w in cluster.router.pools.all()], timeout=30)
    return all(c["used"] == 0 and c["free"] == c["total"] for c in counts)


def test_short_prompts_and_next_turns_prefill_on_the_decode_worker_token_exact(local_on, llama_dir):
    client = Client(local_on.address)
    (prefill,), (decode,) = local_on.router.pools.ready("prefill"), local_on.router.pools.ready("decode")
    before = _local_prefills(local_on)
    short, long_ = _tokens(30, 1), _tokens(100, 2)
    t_short, last = client.tokens(short, max_tokens=8, ignore_eos=True)
    assert t_short == hf_greedy(llama_dir, short, 8, ignore_eos=True)
    assert (last.usage.prefill_worker, last.usage.decode_worker) == ("", decode.name)
    assert last.usage.kv_transfer_bytes == 0
    t_long, last = client.tokens(long_, max_tokens=8, ignore_eos=True)
    assert t_long == hf_greedy(llama_dir, long_, 8, ignore_eos=True)
    assert last.usage.prefill_worker == prefill.name and last.usage.kv_transfer_bytes > 0
    # the next turn: the decode worker holds the 6 full blocks of the 108-token context before it,
    # so only 128 - 96 = 32 tokens are uncached there (<= 40)
    turn = long_ + t_long + _tokens(20, 3)
    t_turn, last = client.tokens(turn, max_tokens=8, ignore_eos=True)
    assert t_turn == hf_greedy(llama_dir, turn, 8, ignore_eos=True)
    assert (last.usage.prefill_worker, last.usage.decode_worker) == ("", decode.name)
    assert last.usage.cached_tokens == 6 * BS
    assert _local_prefills(local_on) == before + 2
    wait_until(lambda: _whole(local_on), 30, "every block free")
    client.close()
