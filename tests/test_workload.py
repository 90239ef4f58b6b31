"""Bench workloads: seeded arrivals and lengths, presets, Mooncake trace replay (a hash id is the
same tokens everywhere) and scaling."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from bench import cli as bench_cli
from bench.errors import TraceError, WorkloadError
from bench.presets import CONVERSATION_WINDOW, PRESETS, WorkloadOptions, build_workload
from bench.trace import TraceScaling, parse_window, read_trace, trace_workload
from bench.workload import arrival_times, clip_lengths

TRACE_LINES = [
    {"timestamp": 0, "input_length": 1024, "output_length": 64, "hash_ids": [1, 2]},
    {"timestamp": 500, "input_length": 1100, "output_length": 32, "hash_ids": [1, 2, 3]},
    {"timestamp": 2000, "input_length": 600, "output_length": 10, "hash_ids": [1, 9]},
    {"timestamp": 5000, "input_length": 512, "output_length": 8, "hash_ids": [7]},
]


def _write_trace(path, lines) -> str:
    path.write_text("".join((json.dumps(line) if isinstance(line, dict) else line) + "\n"
                            for line in lines))
    return str(path)


@pytest.mark.parametrize("preset", list(PRESETS))
def test_every_preset_is_deterministic_for_a_seed_and_fits_the_context(preset):
    opts = WorkloadOptions(preset=preset, max_context=512, seed=7)
    first, again = build_workload(opts), build_workload(opts)
    assert first == again
    assert first.requests, preset
    assert len({r.request_id for r in first.requests}) == len(first.requests)
    assert all(r.num_prompt_tokens + r.max_tokens <= 512 for r in first.requests)
    assert all(16 <= t < 256 for r in first.requests for t in r.prompt_token_ids)
    arrivals = [r.arrival_s for r in first.requests]
    assert arrivals == sorted(arrivals)
    other = build_workload(WorkloadOptions(preset=preset, max_context=512, seed=8))
    assert other.requests != first.requests


def test_poisson_arrivals_have_the_asked_rate_and_gamma_is_burstier():
    rng = np.random.default_rng(0)
    poisson = np.diff(arrival_times(20_000, 5.0, 1.0, rng))
    bursty = np.diff(arrival_times(20_000, 5.0, 0.25, rng))
    assert 1 / poisson.mean() == pytest.approx(5.0, rel=0.03)
    assert 1 / bursty.mean() == pytest.approx(5.0, rel=0.06)
    assert poisson.std() / poisson.mean() == pytest.approx(1.0, rel=0.05)
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, rel=0.1)  # CV = 1/sqrt(shape)


def test_concurrency_without_rate_is_a_closed_loop():
    workload = build_workload(WorkloadOptions(preset="steady", concurrency=4, num_requests=10))
    assert workload.concurrency == 4
    assert {r.arrival_s for r in workload.requests} == {0.0}


def test_overrides_win_over_preset_defaults():
    workload = build_workload(WorkloadOptions(preset="steady", num_requests=7, input_len=40,
                                              output_len=9, range_ratio=0.0))
    assert [(r.num_prompt_tokens, r.max_tokens) for r in workload.requests] == [(40, 9)] * 7


def test_clip_lengths_keeps_the_sum_within_the_context():
    assert clip_lengths(100, 20, 512) == (100, 20)
    assert clip_lengths(1000, 20, 512) == (492, 20)
    assert clip_lengths(1000, 1000, 512) == (256, 256)
    with pytest.raises(WorkloadError):
        clip_lengths(1, 1, 1)


def test_long_context_prompts_are_near_the_context():
    workload = build_workload(WorkloadOptions(preset="long-context", max_context=1024))
    assert min(r.num_prompt_tokens for r in workload.requests) > 0.7 * 1024


def test_morning_burst_marks_its_window_and_lands_long_prompts_in_it():
    workload = build_workload(WorkloadOptions(preset="morning-burst", max_context=1024))
    burst = workload.metadata["burst"]
    assert burst["end_s"] > burst["start_s"] > 0
    burst_requests = [r for r in workload.requests if r.request_id.startswith("burst-")]
    assert len(burst_requests) == burst["num_requests"] >= 4
    assert all(burst["start_s"] <= r.arrival_s <= burst["end_s"] for r in burst_requests)
    streaming = [r for r in workload.requests if r.request_id.startswith("stream-")]
    assert min(r.num_prompt_tokens for r in burst_requests) > max(
        r.num_prompt_tokens for r in streaming)
    assert workload.describe()["burst"] == burst


def test_shared_prefix_requests_share_their_groups_prefix():
    workload = build_workload(WorkloadOptions(preset="shared-prefix", max_context=1024))
    prefix_len = workload.metadata["prefix_tokens"]
    groups: dict[str, set] = {}
    for r in workload.requests:
        groups.setdefault(r.request_id.split("-")[0], set()).add(r.prompt_token_ids[:prefix_len])
    assert len(groups) == workload.metadata["num_prefixes"]
    assert all(len(prefixes) == 1 for prefixes in groups.values())
    assert len({next(iter(p)) for p in groups.values()}) == len(groups)
    fixed = build_workload(WorkloadOptions(preset="shared-prefix", input_len=64, range_ratio=0.0))
    assert fixed.describe()["shared_fraction"] == 0.75 and fixed.metadata["prefix_tokens"] == 48


def test_trace_scaling_window_and_shared_prefix_tokens(tmp_path):
    records = read_trace(_write_trace(tmp_path / "t.jsonl", TRACE_LINES))
    scaling = TraceScaling(length_scale=8, time_scale=2, window_start_s=0, window_end_s=3)
    workload = trace_workload(records, scaling, max_context=4096, vocab=(16, 256), seed=1)
    a, b, c = workload.requests
    assert [r.arrival_s for r in workload.requests] == [0.0, 0.25, 1.0]
    assert [r.num_prompt_tokens for r in workload.requests] == [128, 138, 75]
    assert [r.max_tokens for r in workload.requests] == [8, 4, 1]
    assert scaling.block_tokens == 64
    assert b.prompt_token_ids[:128] == a.prompt_token_ids  # hash ids [1, 2] shared
    assert c.prompt_token_ids[:64] == a.prompt_token_ids[:64]  # only hash id 1 shared
    assert c.prompt_token_ids[64:75] != a.prompt_token_ids[64:75]
    assert workload.metadata["scaling"]["block_tokens"] == 64
    assert workload.metadata["scaling"]["length_scale"] == 8


def test_a_hash_id_is_the_same_tokens_in_every_request_and_run(tmp_path):
    lines = [{"timestamp": 0, "input_length": 1100, "output_length": 8, "hash_ids": [1, 2, 3]},
             {"timestamp": 10, "input_length": 700, "output_length": 8, "hash_ids": [4, 2]},
             {"timestamp": 20, "input_length": 1536, "output_length": 8, "hash_ids": [5, 3, 2]},
             {"timestamp": 30, "input_length": 40, "output_length": 8, "hash_ids": [1]}]
    records = read_trace(_write_trace(tmp_path / "t.jsonl", lines))
    scaling = TraceScaling(length_scale=8)  # 64-token blocks

    def blocks() -> list[list[tuple[int, ...]]]:
        workload = trace_workload(records, scaling, max_context=4096, vocab=(16, 256), seed=3)
        return [[r.prompt_token_ids[i:i + 64] for i in range(0, r.num_prompt_tokens, 64)]
                for r in workload.requests]

    a, b, c, d = blocks()
    assert blocks() == [a, b, c, d]  # every run
    assert len(a[2]) == 10 and len(b[1]) == 24 and len(d[0]) == 5  # partial last blocks
    assert b[1] == a[1][:24] and c[2] == a[1]  # hash id 2, wherever it stands
    assert len(c[1]) == 64 and c[1][:10] == a[2]  # hash id 3: whole in c, cut short in a
    assert d[0] == a[0][:5]
    assert len({a[0], b[0], c[0]}) == 3
    other = trace_workload(records, scaling, max_context=4096, vocab=(16, 256), seed=4)
    assert other.requests[0].prompt_token_ids != tuple(t for block in a for t in block)


def test_trace_prompts_are_clipped_to_the_context(tmp_path):
    records = read_trace(_write_trace(tmp_path / "t.jsonl", TRACE_LINES))
    workload = trace_workload(records, TraceScaling(), max_context=300, vocab=(16, 256), seed=1)
    assert all(r.num_prompt_tokens + r.max_tokens <= 300 for r in workload.requests)


def test_conversation_preset_replays_the_shipped_window_with_prefixes():
    workload = build_workload(WorkloadOptions(preset="conversation", max_context=2048))
    block = workload.metadata["scaling"]["block_tokens"]
    assert block == 32 and len(workload.requests) > 200
    first3 = workload.requests[:3]  # the trace's first requests all open with hash id 0
    assert first3[0].prompt_token_ids[:block] == first3[1].prompt_token_ids[:block]
    assert first3[0].prompt_token_ids[block:2 * block] != first3[1].prompt_token_ids[
        block:2 * block]
    assert len(read_trace(CONVERSATION_WINDOW)) == len(workload.requests)


def test_window_selects_and_rebases_arrivals(tmp_path):
    path = _write_trace(tmp_path / "t.jsonl", TRACE_LINES)
    workload = build_workload(WorkloadOptions(trace=path, window=parse_window("0.5:10")))
    assert [r.arrival_s for r in workload.requests] == [0.0, 1.5, 4.5]
    with pytest.raises(WorkloadError, match="no requests"):
        build_workload(WorkloadOptions(trace=path, window=parse_window("100:200")))


@pytest.mark.parametrize(("bad_line", "reason"), [
    ("{not json", "not valid JSON"),
    ('{"timestamp": 1, "output_length": 5, "hash_ids": []}', "'input_length'"),
    ('{"timestamp": -1, "input_length": 5, "output_length": 5}', "'timestamp'"),
    ('{"timestamp": 1, "input_length": 5, "output_length": 5, "hash_ids": [1, "x"]}',
     "'hash_ids'"),
    ("[1, 2]", "JSON object"),
])
def test_malformed_trace_names_the_line(tmp_path, bad_line, reason):
    path = _write_trace(tmp_path / "bad.jsonl", [TRACE_LINES[0], "", bad_line])
    with pytest.raises(TraceError, match=reason) as info:
        read_trace(path)
    assert info.value.line == 3
    assert "bad.jsonl:3: " in str(info.value)


def test_window_syntax_errors():
    assert parse_window("60:") == (60.0, None)
    for text in ("60", "a:b"):
        with pytest.raises(WorkloadError, match="--window"):
            parse_window(text)


def _bench(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="pdserve")
    bench_cli.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", *argv])
    return args.func(args)


def test_cli_malformed_trace_exits_2_naming_the_line(tmp_path, capsys):
    path = _write_trace(tmp_path / "bad.jsonl", [TRACE_LINES[0], '{"timestamp": "x"}'])
    assert _bench("--router", "127.0.0.1:1", "--trace", path, "--out", str(tmp_path)) == 2
    err = capsys.readouterr().err
    assert "bad.jsonl:2:" in err and "'timestamp'" in err
    assert not (tmp_path / "summary.json").exists()


@pytest.mark.parametrize(("argv", "message"), [
    (["--vocab-range", "9"], "--vocab-range"),
    (["--preset", "morning-burst", "--concurrency", "2"], "--rate"),
    (["--slo", "latency=1"], "--slo"),
    (["--trace", "/no/such/trace.jsonl"], "cannot read trace"),
])
def test_cli_bad_workload_options_exit_2(tmp_path, capsys, argv, message):
    assert _bench("--router", "127.0.0.1:1", "--out", str(tmp_path), *argv) == 2
    assert message in capsys.readouterr().err
