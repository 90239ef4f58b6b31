"""Bench metrics on hand-made timestamps, prefix-cache figures on hand-made prompts and usage, the
client + report against a real gRPC server, the rolling p99 and per-arrangement panels of the
ITL chart, progress lines, and option help.

The router double is a small `Generation` servicer on a free port that streams `max_tokens`
tokens: grpc.aio on the client's own loop for client tests; a thread-pool server for the CLI,
which runs its own event loop (grpc.aio objects must not span two live loops).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
import time
import types
from concurrent import futures

import grpc
import numpy as np
import pytest

from bench import cli as bench_cli
from bench.client import replay
from bench.errors import RouterUnreachable, SloError
from bench.metrics import (
    RequestRecord,
    Slo,
    e2e,
    ideal_hit_rate,
    itls,
    latency_stats_ms,
    meets_slo,
    parse_slo,
    prefix_cache_summary,
    rolling_percentile,
    summarize_run,
    tpot,
    ttft,
)
from bench.report import build_summary, format_report, summarize_arrangements, write_report
from bench.workload import RequestSpec, make_workload
from proto import pdserve_pb2, pdserve_pb2_grpc

SUMMARY_KEYS = {"ttft_ms", "itl_ms", "tpot_ms", "e2e_ms", "output_tok_per_s",
                "goodput_req_per_s", "slo_attainment", "prompt_tokens", "prefix_hit_rate",
                "ideal_hit_rate", "prefill_tokens_computed", "kv_transfer_bytes"}


def _record(send, times, counts, error=None, rid="r") -> RequestRecord:
    return RequestRecord(rid, "test", send, tuple(times), tuple(counts), 10, sum(counts),
                         "length", error)


def test_ttft_itl_tpot_e2e_with_a_multi_token_message():
    record = _record(1.0, [1.5, 1.6, 1.8, 2.0], [1, 1, 2, 1])
    assert ttft(record) == pytest.approx(0.5)
    assert e2e(record) == pytest.approx(1.0)
    np.testing.assert_allclose(itls(record), [0.1, 0.2, 0.0, 0.2])
    assert tpot(record) == pytest.approx(0.5 / 4)


def test_single_token_requests_have_no_tpot_and_are_left_out():
    single = _record(0.0, [0.3], [1])
    assert tpot(single) is None
    summary = summarize_run([single, _record(0.0, [0.1, 0.3], [1, 1])], Slo())
    assert summary["tpot_ms"]["mean"] == pytest.approx(200.0)
    assert summary["ttft_ms"]["mean"] == pytest.approx(200.0)


def test_percentiles_are_numpy_linear_in_ms():
    stats = latency_stats_ms([0.1, 0.2, 0.3, 0.4])
    assert stats == pytest.approx({"mean": 250.0, "p50": 250.0, "p95": 385.0, "p99": 397.0})
    assert latency_stats_ms([]) == {"mean": None, "p50": None, "p95": None, "p99": None}


def test_goodput_attainment_and_throughput_over_the_run():
    records = [
        _record(0.0, [0.5, 0.54, 0.58], [1, 1, 1], rid="ok"),         # ttft .5, tpot .04
        _record(1.0, [3.0, 3.02], [1, 1], rid="late"),               # ttft 2.0
        _record(2.0, [2.2, 2.4, 2.6], [1, 1, 1], rid="choppy"),       # tpot .2
        _record(3.0, [3.1, 10.0], [1, 3], rid="stalled"),            # tpot 6.9/3 = 2.3 > .05
        _record(4.0, [4.1], [1], rid="single"),                      # no tpot: meets
        _record(5.0, [], [], error="UNAVAILABLE: down", rid="failed"),
    ]
    slo = parse_slo("ttft=1.0,tpot=50ms")
    assert [meets_slo(r, slo) for r in records] == [True, False, False, False, True, False]
    summary = summarize_run(records, slo)
    assert summary["wall_s"] == pytest.approx(10.0)
    assert summary["num_errors"] == 1
    assert summary["goodput_req_per_s"] == pytest.approx(0.2)
    assert summary["slo_attainment"] == pytest.approx(2 / 6)
    assert summary["output_tokens"] == 3 + 2 + 3 + 4 + 1
    assert summary["output_tok_per_s"] == pytest.approx(1.3)
    assert summary["request_per_s"] == pytest.approx(0.5)
    assert summary["slo"] == {"ttft_ms": 1000.0, "tpot_ms": 50.0}


def test_parse_slo_units_and_errors():
    assert parse_slo("ttft=500ms, e2e=2") == Slo(ttft_s=0.5, e2e_s=2.0)
    assert parse_slo("") == Slo()
    for bad in ("ttft", "itl=1", "ttft=fast", "tpot=-1"):
        with pytest.raises(SloError):
            parse_slo(bad)


class _StreamingGeneration(pdserve_pb2_grpc.GenerationServicer):
    """Streams max_tokens tokens, 10 ms apart: one, then two per message; max_tokens 13 fails."""

    def __init__(self) -> None:
        self.requests: list[pdserve_pb2.GenerateRequest] = []
        self.in_flight = 0
        self.max_in_flight = 0

    async def Generate(self, request, context):
        self.requests.append(request)
        if request.sampling.max_tokens == 13:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full")
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            left, size = request.sampling.max_tokens, 1
            while left:
                await asyncio.sleep(0.01)
                chunk = min(size, left)
                left -= chunk
                message = pdserve_pb2.GenerateResponse(request_id=request.request_id,
                                                       token_ids=[7] * chunk)
                if not left:
                    message.finish_reason = "length"
                    message.usage.CopyFrom(pdserve_pb2.Usage(completion_tokens=5, queue_ms=1.5))
                yield message
                size = 2
        finally:
            self.in_flight -= 1


def _replay(workload, servicer: _StreamingGeneration) -> list[RequestRecord]:
    """Serves `servicer` and replays `workload` against it, both on one event loop."""

    async def main() -> list[RequestRecord]:
        server = grpc.aio.server()
        pdserve_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            return await replay(f"127.0.0.1:{port}", workload, "router", show_progress=False)
        finally:
            await server.stop(None)

    return asyncio.run(main())


A = list(range(1, 11))  # 10 tokens: with block size 4, full blocks [1..4], [5..8]


def test_ideal_hit_rate_reuses_leading_blocks_seen_before_and_computes_the_last_token():
    prompts = [
        A,                            # nothing seen: 0
        A[:8] + [50, 51],             # both of A's blocks: 8
        A[:4] + [60] * 4,             # A's first block, then a new one: 4
        A[:8],                        # 2 full blocks seen, but its last token is computed: 4
        [99] + A[:8],                 # the same tokens one position later: 0
        A[4:8] + A[:4] + [0],         # A's second block first: a different prefix, 0
    ]
    assert ideal_hit_rate(prompts, 4) == pytest.approx((8 + 4 + 4) / (10 + 10 + 8 + 8 + 9 + 9))
    assert ideal_hit_rate([A, A, A], 4) == pytest.approx(16 / 30)
    assert ideal_hit_rate([A, A], 16) == 0.0  # no full block
    assert ideal_hit_rate([], 4) == 0.0


def _cache_record(prompt: int, usage: dict, error: str | None = None) -> RequestRecord:
    return RequestRecord("r", "test", 0.0, (0.1,), (1,), prompt, 1, "length", error, usage)


def test_prefix_cache_summary_counts_successful_requests_and_tolerates_absent_fields():
    records = [_cache_record(40, {"cached_tokens": 32, "kv_transfer_bytes": 100}),
               _cache_record(20, {"cached_tokens": 0, "kv_transfer_bytes": 50}),
               _cache_record(30, {}),  # no cached_tokens: counts 0
               _cache_record(10, {"prompt_tokens_details": {"cached_tokens": 8}}),  # OpenAI's place
               _cache_record(99, {"cached_tokens": 99}, error="UNAVAILABLE: gone")]
    assert prefix_cache_summary(records) == {
        "prompt_tokens": 100, "prefix_hit_rate": 0.4, "prefill_tokens_computed": 60, "kv_transfer_bytes": 150}
    assert prefix_cache_summary([_cache_record(40, {})]) == {
        "prompt_tokens": 40, "prefix_hit_rate": None, "prefill_tokens_computed": None, "kv_transfer_bytes": None}


def test_every_run_is_summarized_with_the_cache_figures_and_keyed_by_kind():
    records = {name: [_cache_record(64, {"cached_tokens": cached, "kv_transfer_bytes": 0})]
               for name, cached in (("cache_aware", 48), ("round_robin", 16))}
    summaries = summarize_arrangements(records, parse_slo(""), ideal_hit_rate=0.75)
    assert all(SUMMARY_KEYS <= set(s) and s["ideal_hit_rate"] == 0.75 for s in summaries.values())
    assert [s["prefill_tokens_computed"] for s in summaries.values()] == [16, 48]
    doc = build_summary(summaries, _workload([1]), parse_slo(""), {}, kind="policies")
    assert list(doc["policies"]) == ["cache_aware", "round_robin"] and "arrangements" not in doc
    table = format_report(summaries, "policy", {"shared_fraction": 0.75}).splitlines()
    assert table[table.index("prefix cache (tokens)") + 1].split() == [
        "policy", "prompt", "computed", "hit", "rate", "ideal", "KV", "MiB"]
    assert [line.split()[1:5] for line in table if line.startswith(("cache_aware ", "round_robin "))][-2:] == [
        ["64", "16", "75.0%", "75.0%"], ["64", "48", "25.0%", "75.0%"]]
    assert table[-1] == "workload: a shared prefix makes up 75.0% of the prompt tokens"


def _workload(max_tokens: list[int], concurrency: int | None = None, gap: float = 0.02):
    specs = [RequestSpec(f"req-{i}", i * gap, (16 + i, 17, 18), n)
             for i, n in enumerate(max_tokens)]
    return make_workload("test", specs, concurrency, {"preset": "test"})


def test_client_records_every_message_and_sends_exact_sampling(tmp_path):
    servicer = _StreamingGeneration()
    workload = _workload([5, 1, 4, 13])
    records = _replay(workload, servicer)
    by_id = {r.request_id: r for r in records}
    assert [by_id[f"req-{i}"].message_tokens for i in range(3)] == [(1, 2, 2), (1,), (1, 2, 1)]
    assert by_id["req-3"].error.startswith("RESOURCE_EXHAUSTED")
    for record in (by_id["req-0"], by_id["req-2"]):
        times = record.message_times_s
        assert record.send_s < times[0] and list(times) == sorted(times)
        assert ttft(record) >= 0.01 and record.finish_reason == "length"
        assert record.usage["queue_ms"] == 1.5 and record.usage["prefill_ms"] == 0.0
    sent = {r.prompt_token_ids[0]: r for r in servicer.requests}
    assert len({r.request_id for r in servicer.requests}) == 4
    assert all(r.sampling.ignore_eos and r.sampling.temperature == 0 for r in sent.values())
    assert [sent[16 + i].sampling.max_tokens for i in range(4)] == [5, 1, 4, 13]
    assert list(sent[16].prompt_token_ids) == [16, 17, 18]

    summaries = summarize_arrangements({"router": records}, parse_slo("ttft=1"))
    summary = build_summary(summaries, workload, parse_slo("ttft=1"), {"router": "test"})
    write_report(tmp_path, summary, {"router": records}, plot=True)
    doc = json.loads((tmp_path / "summary.json").read_text())
    arrangement = doc["arrangements"]["router"]
    assert SUMMARY_KEYS <= set(arrangement)
    for key in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
        assert set(arrangement[key]) == {"mean", "p50", "p95", "p99"}
    assert arrangement["num_errors"] == 1 and arrangement["slo_attainment"] == 0.75
    assert doc["workload"]["num_requests"] == 4
    lines = (tmp_path / "requests.jsonl").read_text().splitlines()
    assert {json.loads(line)["request_id"] for line in lines} == set(by_id)
    assert all((tmp_path / name).stat().st_size > 0
               for name in ("ttft_cdf.png", "itl_cdf.png", "itl_over_time.png"))


def test_closed_loop_keeps_concurrency_in_flight():
    servicer = _StreamingGeneration()
    records = _replay(_workload([6] * 8, concurrency=2, gap=0.0), servicer)
    assert all(r.ok and r.output_tokens == 6 for r in records)
    assert servicer.max_in_flight == 2


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_unreachable_router_is_a_typed_error():
    address = f"127.0.0.1:{_free_port()}"
    with pytest.raises(RouterUnreachable, match=address):
        asyncio.run(replay(address, _workload([2]), "router", connect_timeout_s=0.3,
                           show_progress=False))


def _bench(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="pdserve")
    bench_cli.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", *argv])
    return args.func(args)


class _ThreadedGeneration(pdserve_pb2_grpc.GenerationServicer):
    """One token per message, 5 ms apart, served from a thread pool."""

    def Generate(self, request, context):
        for index in range(request.sampling.max_tokens):
            time.sleep(0.005)
            last = index == request.sampling.max_tokens - 1
            yield pdserve_pb2.GenerateResponse(token_ids=[7],
                                               finish_reason="length" if last else "")


@pytest.fixture
def threaded_router():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    pdserve_pb2_grpc.add_GenerationServicer_to_server(_ThreadedGeneration(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(None).wait(5)


def test_cli_measures_a_running_router_and_writes_the_report(threaded_router, tmp_path, capsys):
    address = threaded_router
    assert _bench("--router", address, "--num-requests", "6", "--rate", "50", "--input-len",
                  "8", "--output-len", "4", "--slo", "ttft=1,tpot=1", "--out", str(tmp_path),
                  "--no-progress") == 0
    out = capsys.readouterr().out
    assert "== router: 6 requests, 0 failed" in out and "TTFT" in out
    doc = json.loads((tmp_path / "summary.json").read_text())
    assert SUMMARY_KEYS <= set(doc["arrangements"]["router"])
    assert doc["arrangements"]["router"]["slo_attainment"] == 1.0
    assert doc["workload"]["preset"] == "steady" and doc["workload"]["seed"] == 0
    assert "UNIMPLEMENTED" in doc["cluster"]["status"]["error"]


def test_cli_unreachable_router_exits_2(tmp_path, capsys):
    assert _bench("--router", f"127.0.0.1:{_free_port()}", "--connect-timeout", "0.3",
                  "--num-requests", "2", "--out", str(tmp_path), "--no-progress") == 2
    assert "not reachable" in capsys.readouterr().err


def test_cli_rejects_unknown_arrangements(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "router.config.loader",
                        types.SimpleNamespace(load_config=lambda path: None))
    monkeypatch.setitem(sys.modules, "router.launch", types.SimpleNamespace(
        LocalCluster=None, ensure_model=None))
    assert _bench("--config", "c.yaml", "--arrangements", "colocated,split",
                  "--out", str(tmp_path), "--max-context", "512") == 2
    assert "unknown ['split']" in capsys.readouterr().err


def test_request_groups_are_summarized_apart():
    from bench.report import format_report, summarize_arrangements

    stream = [_record(0.0, [0.1, 0.2, 0.3], [1, 1, 1], rid=f"stream-{i}") for i in range(3)]
    burst = [_record(1.0, [1.5, 2.5], [1, 1], rid="burst-0")]
    summary = summarize_arrangements({"colocated": stream + burst}, parse_slo(""))["colocated"]
    assert set(summary["groups"]) == {"stream", "burst"}
    assert summary["groups"]["stream"]["itl_ms"]["p99"] == pytest.approx(100.0)
    assert summary["groups"]["burst"]["itl_ms"]["p99"] == pytest.approx(1000.0)
    assert summary["groups"]["stream"]["num_requests"] == 3 and summary["num_requests"] == 4
    assert "by request group" in format_report({"colocated": summary})


def test_itl_while_a_burst_lands_leaves_the_burst_out():
    from bench.report import BURST_TAIL_S, summarize_arrangements

    # stream gaps end at 0.1, 0.2 (before), 5.0 (inside [4, 5 + tail]) and 20.0 (after)
    stream = _record(0.0, [0.05, 0.1, 0.2, 5.0, 20.0], [1, 1, 1, 1, 1], rid="stream-0")
    burst = _record(4.0, [4.5, 4.6], [1, 1], rid="burst-0")
    summary = summarize_arrangements({"a": [stream, burst]}, parse_slo(""),
                                     {"start_s": 4.0, "end_s": 5.0})["a"]
    assert summary["during_burst_window_s"] == [4.0, 5.0 + BURST_TAIL_S]
    assert summary["during_burst_itl_ms"]["p50"] == pytest.approx(4800.0)  # the one gap 0.2 -> 5.0


def test_rolling_percentile_looks_back_one_window():
    times = np.array([0.0, 1.0, 2.0, 3.0, 4.0])
    values = np.array([10.0, 20.0, 30.0, 40.0, 50.0])
    grid, p50 = rolling_percentile(times, values, window_s=1.5, q=50, points=5)
    np.testing.assert_allclose(grid, [0, 1, 2, 3, 4])
    np.testing.assert_allclose(p50, [10, 15, 25, 35, 45])  # (t - 1.5, t] holds two points after the first
    grid, p99 = rolling_percentile(np.array([0.0, 5.0]), np.array([1.0, 2.0]), window_s=1.0, points=3)
    assert np.isnan(p99[1]) and p99[0] == 1.0 and p99[2] == 2.0  # nothing arrived in (1.5, 2.5]
    assert rolling_percentile(np.array([]), np.array([]), 1.0)[0].size == 0


def test_itl_over_time_has_a_panel_per_arrangement_with_p99_and_burst():
    from bench.plot import itl_over_time_figure

    records = {name: [_record(0.0, [0.1, 0.2, 0.5, 0.6], [1, 1, 1, 1], rid=f"stream-{i}") for i in range(3)]
               for name in ("colocated", "disaggregated", "peer")}
    fig = itl_over_time_figure(records, {"start_s": 0.2, "end_s": 0.4})
    assert [ax.get_title(loc="left") for ax in fig.axes] == ["colocated", "disaggregated", "peer"]
    for ax in fig.axes:
        assert len(ax.collections) == 1 and len(ax.lines) == 1 and len(ax.patches) == 1  # points, p99, burst
        assert ax.get_shared_x_axes().joined(ax, fig.axes[0]) and ax.get_shared_y_axes().joined(ax, fig.axes[0])


def test_progress_prints_a_line_every_few_seconds_when_not_a_terminal(capsys):
    servicer = _StreamingGeneration()

    async def main() -> list[RequestRecord]:
        server = grpc.aio.server()
        pdserve_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            return await replay(f"127.0.0.1:{port}", _workload([30] * 4, concurrency=2, gap=0.0), "colocated",
                                progress_every_s=0.05)
        finally:
            await server.stop(None)

    assert all(r.ok for r in asyncio.run(main()))  # 2 rounds of 2 requests, ~0.3 s each
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) >= 5 and all(line.startswith("colocated: ") for line in lines)
    assert "in flight" in lines[0] and lines[-1].startswith("colocated: 4/4 requests done (0 failed), 0 in flight")


def test_every_bench_option_has_a_help_line():
    parser = argparse.ArgumentParser(prog="pdserve")
    bench = bench_cli.add_parser(parser.add_subparsers(dest="command", required=True))
    undocumented = [a.option_strings for a in bench._actions if not a.help]
    assert not undocumented
