"""router.decode_reservation: after_prefill (the prefill runs first, its worker holds the KV until a
decode worker has room): in the simulator, a decode pool with room for one request no longer holds
back the next prompt's prefill; on the real cluster (the shared 1 + 1 `served`), greedy tokens equal
to before_prefill's and transformers', every block back, and a cancel while the computed KV waits
for its decode reservation reaches both workers."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest
import ray
import yaml

from bench.workload import RequestSpec, make_workload
from cli.main import main as pdserve
from protocol.messages import PrefillTask
from protocol.outputs import FinishReason
from protocol.sampling import SamplingParams
from router.config.loader import load_config
from router.lifecycle.life import Phase
from simulate.cli import emulated
from simulate.run import simulate
from tests.cluster_util import Client, faults, wait_until
from tests.reference import hf_greedy

ROOT = Path(__file__).resolve().parent.parent
BS = 16


def _mode(cfg, mode: str):
    return dataclasses.replace(cfg, router=dataclasses.replace(cfg.router, decode_reservation=mode))


def test_a_bad_mode_is_one_line_naming_the_key_and_exit_2(tmp_path, capsys):
    bad = tmp_path / "cluster.yaml"
    bad.write_text(yaml.safe_dump({"router": {"decode_reservation": "later"}}))
    capsys.readouterr()
    code = pdserve(["serve", "--config", str(bad)])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "router.decode_reservation" in err, err
    assert "'before_prefill', 'after_prefill'" in err, err


# ---- in the simulator -------------------------------------------------------------------
@pytest.fixture(scope="module")
def one_decode_slot():
    """1P+1D H100 x Llama-3.1-8B whose decode worker holds the KV of one 1,000-token request only."""
    base = load_config(str(ROOT / "cluster.yaml"))
    cfg, em = emulated(base, dataclasses.replace(base.emulate, device="h100", model="llama-3.1-8b"), "test")
    return dataclasses.replace(cfg, mode="disaggregated", prefill=dataclasses.replace(cfg.prefill, replicas=1),
                               decode=dataclasses.replace(cfg.decode, replicas=1, num_blocks=80)), em


def test_after_prefill_computes_the_next_prompt_while_decode_kv_is_full(one_decode_slot):
    cfg, em = one_decode_slot
    # r1's 1,024 tokens fill whole blocks: its reservation is for the KV computed (1,024 tokens and
    # the next), not for the context with its first token (one block more, which no push fills)
    lengths = (1000, 1024, 1000)
    specs = [RequestSpec(f"r{i}", 0.001 * i, tuple(range(1000 + i, 1000 + i + n)), 32) for i, n in enumerate(lengths)]
    workload = make_workload("full-decode", specs, None, {})
    runs = {mode: simulate(_mode(cfg, mode), em, workload, mode, rpc_s=0.0) for mode in ("before_prefill",
                                                                                      "after_prefill")}
    for run in runs.values():
        assert all(r.ok and r.output_tokens == 32 and r.usage["migrations"] == 0 for r in run.records)
        assert all(c["used"] == 0 and c["free"] == c["total"] for c in run.checks.values()), run.checks
    before, after = ([r for r in runs[m].records] for m in ("before_prefill", "after_prefill"))
    first_token = lambda r: r.message_times_s[0]  # noqa: E731
    # before_prefill: the second request's prompt waits for the first's decode KV to be freed
    assert first_token(before[1]) > before[0].end_s
    # after_prefill: it is computed (and its first token streamed) while the first still decodes;
    # its KV waits on the prefill worker, so its second token comes after the first request ended
    assert first_token(after[1]) < after[0].end_s and first_token(after[2]) < after[0].end_s
    assert after[1].message_times_s[1] > after[0].end_s and after[1].usage["prefill_worker"] == "prefill-0"
    assert after[1].usage["kv_wait_ms"] == 0  # a part of TTFT: the wait after the first token is not in it
    # the same KV went over the link; r0, whose decode worker had room while it computed, was
    # reserved and aimed then: its second token came as soon after its first as before_prefill's
    # r0's did (its KV streamed while computed; no aim after the first token)
    assert [r.usage["kv_transfer_bytes"] for r in after] == [r.usage["kv_transfer_bytes"] for r in before]
    assert min(r.usage["kv_transfer_bytes"] for r in after) > 0
    gap = lambda r: r.message_times_s[1] - r.message_times_s[0]  # noqa: E731
    assert gap(after[0]) == pytest.approx(gap(before[0]), abs=1e-6) and gap(after[1]) > gap(before[0])


def test_a_kv_that_finds_no_decode_room_by_the_queue_deadline_fails_and_frees_every_block(one_decode_slot):
    """The first request's KV fills the decode worker (3,800 tokens of a 270-block pool) for the
    ~2.7 s of its 400 tokens; the second's prompt is computed, its first token streamed, and its KV
    waits on the prefill worker until its 1 s queue deadline: it fails then (UNAVAILABLE, naming
    the wait), the first finishes, and no block stays held on either worker."""
    cfg, em = one_decode_slot
    cfg = dataclasses.replace(cfg, router=dataclasses.replace(cfg.router, decode_reservation="after_prefill",
                                                              queue_timeout_s=1.0),
                              decode=dataclasses.replace(cfg.decode, num_blocks=270))
    specs = [RequestSpec("long", 0.0, tuple(range(1000, 4800)), 400),
             RequestSpec("late", 0.6, tuple(range(5000, 5900)), 8)]  # after the first has its reservation
    run = simulate(cfg, em, make_workload("deadline", specs, None, {}), "deadline", rpc_s=0.0)
    long_, late = run.records
    assert long_.ok and long_.output_tokens == 400 and long_.end_s > late.send_s + 1.0
    assert late.output_tokens == 1 and late.message_times_s[0] < late.send_s + 1.0
    assert "no decode worker had room for this request's KV within 1 s" in late.error, late.error
    assert all(c["used"] == 0 and c["free"] == c["total"] for c in run.checks.values()), run.checks


# ---- on the real cluster ----------------------------------------------------------------
@pytest.fixture(scope="module")
def after_on(served):
    """The shared 1 + 1 cluster with after_prefill for this module's tests; back as found after."""
    attempts = served.router.attempts
    before = attempts.rc
    attempts.rc = dataclasses.replace(before, decode_reservation="after_prefill")
    yield served
    attempts.rc = before


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(f"test_decode_reservation-{seed}")  # its own prompts: the shared cache holds others'
    return [rng.randrange(10, 2000) for _ in range(n)]


def _blocks(cluster) -> list[dict]:
    return ray.get([w.actor.check.remote() for w in cluster.router.pools.all()], timeout=30)


def _whole(cluster) -> bool:
    return all(c["used"] == 0 and c["free"] == c["total"] for c in _blocks(cluster))


def test_after_prefill_tokens_equal_before_prefill_and_transformers(after_on, llama_dir):
    client = Client(after_on.address)
    (prefill,), (decode,) = after_on.router.pools.ready("prefill"), after_on.router.pools.ready("decode")
    prompts = [_tokens(70, 1), _tokens(33, 2), _tokens(4 * BS, 6)]  # the last fills its blocks exactly
    outs = []
    for prompt in prompts:
        tokens, last = client.tokens(prompt, max_tokens=8, ignore_eos=True)
        assert (last.usage.prefill_worker, last.usage.decode_worker) == (prefill.name, decode.name)
        assert last.usage.kv_transfer_bytes > 0 and last.usage.migrations == 0
        outs.append(tokens)
    attempts = after_on.router.attempts
    after_rc, attempts.rc = attempts.rc, dataclasses.replace(attempts.rc, decode_reservation="before_prefill")
    try:
        assert [client.tokens(p, max_tokens=8, ignore_eos=True)[0] for p in prompts] == outs
    finally:
        attempts.rc = after_rc
    assert outs == [hf_greedy(llama_dir, p, 8, ignore_eos=True) for p in prompts]
    wait_until(lambda: _whole(after_on), 30, "every block free on both workers")
    client.close()


def test_a_cancel_while_the_kv_waits_for_its_decode_reservation_frees_both_workers(after_on):
    """Every decode reservation refused (fault injection): the prompt is computed, its first token
    streams, and its KV waits on the prefill worker, held exactly; the client cancels; the
    request is gone and every block on both workers is free."""
    router = after_on.router
    client = Client(after_on.address)
    prompt = _tokens(90, 3)
    with faults(after_on, reserve_refuse_rate=1.0):
        stream = client.stream(prompt, max_tokens=16, ignore_eos=True)
        first = next(stream)
        assert len(first.token_ids) == 1
        wait_until(lambda: any(life.phase is Phase.RESERVING and life.waiting_for == "kv"
                               for life in router.lives.values()), 30, "the KV waiting for a reservation")
        (held,) = [life for life in router.lives.values() if life.phase is Phase.RESERVING]
        assert held.prefill is not None and held.decode is None
        prefill_blocks, decode_blocks = _blocks(after_on)
        assert prefill_blocks["used"] == -(-len(prompt) // BS)  # the prompt's KV, held for the hand-off
        assert decode_blocks["used"] == 0
        stream.cancel()
        wait_until(lambda: not router.lives, 30, "the request gone")
    wait_until(lambda: _whole(after_on), 30, "every block free on both workers")
    client.close()


def test_a_kv_never_aimed_is_dropped_by_the_prefill_worker_after_its_hold(after_on):
    """A prefill with no decode worker and a 1 s hold, called on the worker directly (a router that
    never aims): its first token comes back, its blocks are held, then freed at the hold's end; a
    late `aim` is told the request is gone."""
    (prefill,), (decode,) = after_on.router.pools.ready("prefill"), after_on.router.pools.ready("decode")
    prompt = _tokens(50, 5)
    task = PrefillTask("unaimed-1", prompt, SamplingParams(max_tokens=4, ignore_eos=True), None, skip_blocks=None,
                       hold_s=1.0)
    result = ray.get(prefill.actor.prefill.remote(task, None), timeout=60)
    assert result.finish_reason is FinishReason.PREFILLED
    held = ray.get(prefill.actor.check.remote(), timeout=30)
    wait_until(lambda: _whole(after_on), 30, "the un-aimed KV dropped")
    assert held["used"] in (0, -(-len(prompt) // BS))  # held until the hold ran out (or already out on a slow host)
    assert ray.get(prefill.actor.aim.remote("unaimed-1", 0, decode.name, None), timeout=30) is False
