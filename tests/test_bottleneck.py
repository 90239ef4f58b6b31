"""Per-step telemetry and per-token kinds in the engine; the bottleneck attribution and the decision
on hand-made records; the router's queue-wait split; end to end through a live 1+1 cluster: the
usage carries the TTFT split and the token kinds, the bench collects every worker's step records,
and the request log is a trace `pdserve bench --trace` replays and `pdserve inspect` reads."""

from __future__ import annotations

import json
import time
from collections import deque
from pathlib import Path

import numpy as np
import pytest

from bench.bottleneck import (
    analyze,
    collect_steps,
    itl_limit,
    step_summary,
    ttft_limit,
    ttft_parts_ms,
)
from bench.decision import rank
from bench.metrics import RequestRecord
from bench.trace import read_trace
from cli.main import main as pdserve
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.telemetry import KVWaitClock, StepLog
from protocol.sampling import SamplingParams
from protocol.telemetry import TokenKind
from router.lifecycle.admission import QueueWaits


def _engine(path: str, **kw) -> LLMEngine:
    kw.setdefault("num_blocks", 256)
    return LLMEngine(EngineConfig(model_path=path, enable_prefix_caching=False, **{"dtype": "float32", **kw}))


def _drain(engine: LLMEngine, kinds: dict[str, str], timings: dict | None = None) -> None:
    while engine.has_unfinished():
        for out in engine.step():
            kinds[out.request_id] = kinds.get(out.request_id, "") + out.step_kind
            if timings is not None and out.prefill_timing is not None:
                timings[out.request_id] = out.prefill_timing


# ---- the engine: kinds, first-token timing, step records ------------------------------------
def test_decodes_sharing_a_step_with_prefill_chunks_are_interference(llama_dir):
    engine = _engine(llama_dir, max_num_batched_tokens=64, chunk_size=32)
    engine.add_request("stream", prompt_token_ids=list(range(10, 30)), sampling=SamplingParams(max_tokens=8, ignore_eos=True))
    kinds: dict[str, str] = {}
    for _ in range(3):  # prefill + 2 decodes alone
        for out in engine.step():
            kinds["stream"] = kinds.get("stream", "") + out.step_kind
    timings: dict = {}
    added = time.perf_counter()  # "long" arrived a second before the engine got it (a router queue)
    engine.add_request("long", prompt_token_ids=list(range(200, 300)), sampling=SamplingParams(max_tokens=2, ignore_eos=True),
                       arrived_at=added - 1.0)
    _drain(engine, kinds, timings)
    drained = time.perf_counter()
    # 100 prompt tokens in chunks of 32: four steps of prefill, each with one decode of "stream"
    assert kinds == {"stream": "FDD" + "IIII" + "D", "long": "FD"}
    steps = engine.telemetry.since(0)
    assert [(s.decode_rows, s.prefill_rows, s.prefill_tokens) for s in steps[:7]] == [
        (0, 1, 20), (1, 0, 0), (1, 0, 0), (1, 1, 32), (1, 1, 32), (1, 1, 32), (1, 1, 4)]
    long = timings["long"]
    chunk_steps = sum(s.wall_s for s in steps[3:7])
    assert long.compute_s == pytest.approx(chunk_steps)  # the four steps that computed its prompt
    assert long.kv_wait_s == 0.0  # blocks were free throughout
    # queued: the second before the engine, then only the gaps between its steps
    assert 1.0 <= long.queue_s <= 1.0 + (drained - added) - long.compute_s


def test_preempted_handed_off_and_resumed_tokens_say_so(llama_dir):
    # two requests outgrow a 6-block pool of 8-token blocks: one is preempted and recomputed
    engine = _engine(llama_dir, num_blocks=6, block_size=8)
    for i in range(2):
        engine.add_request(f"q{i}", prompt_token_ids=list(range(20 + i, 35 + i)),
                           sampling=SamplingParams(max_tokens=30, ignore_eos=True))
    kinds: dict[str, str] = {}
    _drain(engine, kinds)
    preempted = sum(s.preemptions for s in engine.telemetry.since(0))
    assert preempted == engine.scheduler.num_preemptions >= 1
    assert sum(k.count(TokenKind.PREEMPTED) for k in kinds.values()) >= 1
    assert all(k[0] == TokenKind.FIRST and len(k) == 30 for k in kinds.values())

    engine = _engine(llama_dir)
    prompt = list(range(40, 60))
    blocks, _ = engine.reserve("h", len(prompt) + 1)
    engine.add_prefilled("h", prompt, [7], SamplingParams(max_tokens=4, ignore_eos=True))
    engine.add_request("m", prompt_token_ids=prompt, output_token_ids=[7, 8],
                       sampling=SamplingParams(max_tokens=4, ignore_eos=True))
    kinds = {}
    _drain(engine, kinds)
    assert kinds["h"] == "KDD"  # its KV was pushed: the first token here waited for the hand-off
    assert kinds["m"] == "MD"  # moved from another worker: recomputed, then decodes


def test_a_step_that_recomputes_a_preempted_request_marks_its_neighbours_gaps_recompute(llama_dir):
    # 3 prompts of 8 tokens in a 6-block pool of 8-token blocks, all admitted in the first step,
    # so every later prefill chunk is a preempted request's recompute: no gap is interference
    engine = _engine(llama_dir, num_blocks=6, block_size=8)
    for i, n in enumerate((30, 10, 40)):
        engine.add_request(f"q{i}", prompt_token_ids=list(range(20 + i, 28 + i)),
                           sampling=SamplingParams(max_tokens=n, ignore_eos=True))
    kinds: dict[str, str] = {}
    _drain(engine, kinds)
    # q2 (last admitted) is preempted twice as q0 and q1 grow; when q1 finishes, q2's context is
    # recomputed in the step that also decodes q0: q0's 11th token waited for that recompute
    assert kinds == {"q0": "F" + "D" * 9 + "R" + "D" * 19, "q1": "F" + "D" * 9,
                     "q2": "F" + "D" * 8 + "P" + "D" * 6 + "P" + "D" * 23}
    assert engine.scheduler.num_preemptions == 2


def test_step_log_returns_each_record_once_and_forgets_the_oldest():
    log = StepLog(capacity=3)
    for i in range(5):
        log.append(wall_s=i, decode_rows=1, prefill_rows=0, prefill_tokens=0, blocks_used=0, blocks_free=0,
                   preemptions=0, waiting=0)
    assert [r.seq for r in log.since(0)] == [3, 4, 5]  # the ring kept the last three
    assert [r.seq for r in log.since(4)] == [5]
    assert log.since(5) == []


class _CountingRing(deque):
    """A deque that counts the records read out of it."""

    read = 0

    def __iter__(self):
        for r in super().__iter__():
            self.read += 1
            yield r

    def __reversed__(self):
        for r in super().__reversed__():
            self.read += 1
            yield r


def test_step_log_reads_only_the_records_it_returns():
    """The engine thread answers telemetry polls: asking a full ring of 1000 for its last 3 steps
    must read 3 records, not copy the ring (at the default capacity, 100k records)."""
    log = StepLog(capacity=1000)
    for i in range(1500):
        log.append(wall_s=i, decode_rows=1, prefill_rows=0, prefill_tokens=0, blocks_used=0, blocks_free=0,
                   preemptions=0, waiting=0)
    log._records = _CountingRing(log._records, maxlen=1000)
    assert [r.seq for r in log.since(1497)] == [1498, 1499, 1500]
    assert log._records.read == 3
    assert [r.seq for r in log.since(0)][:2] == [501, 502] and len(log.since(0)) == 1000


def test_kv_wait_clock_counts_only_blocked_time():
    clock = KVWaitClock()
    clock.set_blocked(True, now=10.0)
    assert clock.total(now=12.5) == pytest.approx(2.5)
    clock.set_blocked(True, now=13.0)  # still blocked: the interval goes on
    clock.set_blocked(False, now=14.0)
    clock.set_blocked(False, now=20.0)
    assert clock.total(now=30.0) == pytest.approx(4.0)


def test_queue_waits_charge_each_wait_to_what_was_missing():
    waits = QueueWaits()
    waits.failed("prefill", now=1.0)
    waits.failed("kv", now=3.0)  # 2 s waiting for a prefill slot
    waits.failed("prefill", now=3.5)  # 0.5 s for KV
    waits.failed(None, now=4.0)  # placed
    assert waits.spent == {"prefill": pytest.approx(2.5), "kv": pytest.approx(0.5)}


# ---- attribution on hand-made records --------------------------------------------------------
def _rec(rid: str, send: float, gaps: list[float], kinds: str, ttft_s: float = 0.1, **usage) -> RequestRecord:
    times = send + ttft_s + np.concatenate([[0.0], np.cumsum(gaps)])
    usage = {"kv_wait_ms": 0.0, "prefill_queue_ms": 0.0, "prefill_compute_ms": 50.0, "token_steps": kinds} | usage
    return RequestRecord(rid, "run", send, tuple(times), (1,) * len(times), 10, len(times), "length", None, usage)


def test_itl_tail_named_by_the_kind_most_of_its_gaps_have():
    # 19 gaps of 10 ms on decode-only steps, 1 of 200 ms after a step that ran prefill, per request
    records = [_rec(f"s{i}", i, [0.01] * 9 + [0.2] + [0.01] * 10, "F" + "D" * 9 + "I" + "D" * 10)
               for i in range(10)]
    found = itl_limit(records)
    assert found["limit"] == "interference"
    assert found["shares"]["interference"] == pytest.approx(1.0)  # the p95 gap is 200 ms: only those
    assert found["sentence"].startswith("p99 ITL 200 ms: 100% of gaps at or above p95")
    assert found["sentence"].endswith("steps that also ran prefill chunks: scheduling interference.")
    # inside a window that holds no interference gap, decode steps are the limit
    assert itl_limit(records, window_s=(0.0, 0.15))["limit"] == "decode"


def test_itl_tail_of_recompute_steps_is_named_kv_memory():
    records = [_rec(f"s{i}", i, [0.01] * 9 + [0.2] + [0.01] * 10, "F" + "D" * 9 + "R" + "D" * 10)
               for i in range(10)]
    found = itl_limit(records)
    assert found["limit"] == "recompute" and found["shares"]["interference"] == 0.0
    assert found["sentence"].endswith("recomputed a preempted request's context: KV memory (preemption recompute).")


def test_ttft_tail_split_into_its_parts():
    fast = [_rec(f"f{i}", i, [0.01], "FD", ttft_s=0.1, prefill_compute_ms=80.0) for i in range(19)]
    slow = _rec("slow", 30, [0.01], "FD", ttft_s=1.0, kv_wait_ms=100.0, prefill_queue_ms=600.0,
                prefill_compute_ms=200.0)
    assert ttft_parts_ms(slow) == pytest.approx({"kv_capacity": 100.0, "prefill_queue": 600.0,
                                                 "prefill_compute": 200.0, "transfer": 100.0, "retry": 0.0})
    moved = _rec("moved", 40, [0.01], "FD", ttft_s=1.0, prefill_compute_ms=200.0, migrations=1)
    assert ttft_parts_ms(moved)["retry"] == pytest.approx(800.0)  # the failed attempt's time is in it
    found = ttft_limit(fast + [slow])
    assert found["tail_requests"] == 1 and found["limit"] == "prefill_queue"
    assert found["shares"]["prefill_queue"] == pytest.approx(0.6)
    assert "60% of the time to first token" in found["sentence"]
    # an endpoint that reports no timings: no limit, not a guess
    bare = RequestRecord("x", "run", 0.0, (0.1, 0.2), (1, 1), 10, 2, "length")
    assert analyze([bare]) == {"ttft_p99": None, "itl_p99": None}


def test_step_summary_per_pool():
    steps = [{"wall_s": 0.01, "decode_rows": 4, "prefill_rows": 0, "preemptions": 0, "blocks_used": 10},
             {"wall_s": 0.20, "decode_rows": 4, "prefill_rows": 1, "preemptions": 1, "blocks_used": 30},
             {"wall_s": 0.01, "decode_rows": 4, "prefill_rows": 0, "preemptions": 0, "blocks_used": 12}]
    summary = step_summary({"w0": {"pool": "decode", "blocks_total": 64, "steps": steps}}, wall_s=1.0)["decode"]
    assert summary["steps"] == 3 and summary["preemptions"] == 1 and summary["kv_blocks_used_peak"] == 30
    assert summary["share_with_prefill"] == pytest.approx(1 / 3)
    assert summary["step_ms_with_prefill"]["p50"] == pytest.approx(200.0)
    assert summary["busy"] == pytest.approx(0.22)


def _summary(attainment: float, goodput: float, itl_p99: float, tok_s: float) -> dict:
    return {"slo_attainment": attainment, "goodput_req_per_s": goodput, "output_tok_per_s": tok_s, "wall_s": 10.0,
            "good_output_tokens": tok_s * 10 * attainment, "ttft_ms": {"p99": 500.0}, "itl_ms": {"p99": itl_p99},
            "bottleneck": {"itl_p99": {"limit": "interference"}, "ttft_p99": {"limit": "prefill_queue"}}}


def test_ranking_at_equal_workers_and_the_sentence_citing_its_numbers():
    summaries = {"colocated": _summary(0.70, 1.40, 900.0, 100.0), "disaggregated": _summary(0.95, 1.90, 80.0, 90.0)}
    decision = rank(summaries, dict.fromkeys(summaries, 2), cost_per_worker_hour=3.6)
    best, second = decision["ranking"]
    assert (best["name"], second["name"], decision["decided_by"]) == ("disaggregated", "colocated", "slo_attainment")
    assert best["tok_per_worker_s"] == pytest.approx(45.0)
    assert best["usd_per_million_tokens"] == pytest.approx(3.6 * 2 / 3600 / 90.0 * 1e6)
    text = decision["recommendation"]
    assert text.startswith("Recommend disaggregated at 2 workers each: it leads colocated on SLO attainment")
    assert "95% of requests met the SLO against 70%" in text and "p99 ITL 80 ms against 900" in text
    # tied on attainment and goodput (within 1% and 2%): the lower p99 ITL decides
    tied = {"a": _summary(1.0, 2.00, 300.0, 100.0), "b": _summary(1.0, 1.98, 100.0, 100.0)}
    assert [r["name"] for r in rank(tied, dict.fromkeys(tied, 2))["ranking"]] == ["b", "a"]


# ---- end to end through a live cluster ---------------------------------------------------------
def _last_seqs(steps: dict) -> dict[str, int]:
    return {name: max((s["seq"] for s in w["steps"]), default=0) for name, w in steps.items()}


def test_usage_log_and_step_records_through_a_live_cluster(served, capsys):
    """On the session's shared 1 + 1 cluster (conftest), which logs every request: only the step
    records and log lines after this test's start are its own."""
    from tests.cluster_util import Client

    cluster, log = served, Path(served.cfg.router.request_log)
    seen_steps = _last_seqs(collect_steps(cluster, 0.0))
    seen_lines = len(log.read_text().splitlines()) if log.exists() else 0
    client = Client(cluster.address)
    prompts = [list(range(100, 100 + 600)), list(range(100, 100 + 600)) + [5] * 40, list(range(300, 340))]
    finals = [client.tokens(p, max_tokens=6, ignore_eos=True)[1] for p in prompts]
    client.close()
    for final in finals:
        u = final.usage
        assert u.token_steps == "FKDDDD"  # first token from prefill, then after the KV hand-off
        assert u.prefill_queue_ms >= 0 and u.kv_wait_ms >= 0
        assert u.prefill_compute_ms + u.prefill_queue_ms + u.kv_wait_ms <= u.ttft_ms + 1e-6
    steps = collect_steps(cluster, 0.0)
    assert {w["pool"] for w in steps.values()} == {"prefill", "decode"}
    # the prefill compute each usage reports is the wall time of the prefill steps that computed
    # its prompt: 600 tokens in two steps (a prefill worker with no decode rows takes a prompt whole
    # up to the step's token budget, 512 on a CPU: engine/scheduler.py); the second prompt's 37
    # cached blocks skipped, 48 tokens left; the third, 40 tokens (one request at a time)
    assert served.cfg.step_tokens(served.cfg.prefill) == 512
    name, prefill = next((n, w["steps"]) for n, w in steps.items() if w["pool"] == "prefill")
    chunks = [s for s in prefill if s["seq"] > seen_steps.get(name, 0) and s["prefill_rows"]]
    assert [s["prefill_tokens"] for s in chunks] == [512, 88, 48, 40]
    assert [f.usage.cached_tokens for f in finals] == [0, 37 * 16, 0]
    walls = [s["wall_s"] for s in chunks]
    assert [f.usage.prefill_compute_ms for f in finals] == pytest.approx(
        [(walls[0] + walls[1]) * 1e3, walls[2] * 1e3, walls[3] * 1e3], rel=1e-4)
    name, decode = next((n, w["steps"]) for n, w in steps.items() if w["pool"] == "decode")
    mine = [s for s in decode if s["seq"] > seen_steps.get(name, 0)]
    assert sum(s["decode_rows"] for s in mine) == 3 * 5  # every decode token came from a logged step

    everything = [json.loads(line) for line in log.read_text().splitlines()]
    lines = everything[seen_lines:]
    assert [(x["input_length"], x["output_length"], x["finish_reason"]) for x in lines] == [
        (600, 6, "length"), (640, 6, "length"), (40, 6, "length")]
    assert len(lines[0]["hash_ids"]) == 1 and lines[1]["hash_ids"] == lines[0]["hash_ids"]  # shared 512 tokens
    assert lines[2]["hash_ids"] == [] and "prompt_token_ids" not in lines[0]  # no prompts unless asked
    assert lines[0]["e2e_ms"] >= lines[0]["ttft_ms"] > 0
    trace = read_trace(log)[seen_lines:]  # Mooncake format: pdserve bench --trace replays it
    assert [r.input_length for r in trace] == [600, 640, 40]
    assert trace[0].timestamp_ms <= trace[1].timestamp_ms <= trace[2].timestamp_ms
    capsys.readouterr()
    assert pdserve(["inspect", str(log), "--model", cluster.cfg.model.path, "--json"]) == 0
    seen = json.loads(capsys.readouterr().out)
    assert (seen["kind"], seen["num_requests"], seen["durations"]) == ("request log", len(everything), "measured")
