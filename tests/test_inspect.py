"""`pdserve inspect` on hand-made files: a Mooncake trace (lengths, the arrival peak, the ideal hit rate
over its hash_ids, KV against `pdserve plan`'s budget), a router request log (measured durations,
queue, hit rate), a bench requests.jsonl (one run of it), the one-page plot, and bad input."""

from __future__ import annotations

import json

import pytest

from bench.metrics import RequestRecord
from bench.report import record_to_json
from cli.main import main as pdserve
from sizing.memory import BUILTIN_SHAPES, plan_memory

GIB = 1024**3


def _write(path, objs) -> str:
    path.write_text("".join(json.dumps(o) + "\n" for o in objs))
    return str(path)


def _trace(tmp_path) -> str:
    shared = [(0, 1100, [1, 2, 3]), (1000, 1100, [1, 2, 4]), (2000, 600, [1, 5]), (3000, 300, [6])]
    lines = [{"timestamp": t, "input_length": n, "output_length": 50, "hash_ids": ids} for t, n, ids in shared]
    lines += [{"timestamp": 1000 * s, "input_length": 300, "output_length": 50, "hash_ids": [100 + s]}
              for s in range(4, 20)]
    lines += [{"timestamp": 10_000 + 50 * i, "input_length": 100, "output_length": 50, "hash_ids": []}
              for i in range(10)]  # a burst: 10 requests in half a second
    return _write(tmp_path / "trace.jsonl", sorted(lines, key=lambda o: o["timestamp"]))


def _inspect(capsys, *argv: str) -> tuple[int, str, str]:
    code = pdserve(["inspect", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_a_trace_lengths_peak_reuse_and_kv(tmp_path, capsys):
    code, out, _ = _inspect(capsys, _trace(tmp_path), "--bucket", "2", "--json")
    assert code == 0
    r = json.loads(out)
    assert (r["kind"], r["num_requests"], r["duration_s"]) == ("Mooncake trace", 30, 19.0)
    assert r["input_length"]["p50"] == 300 and r["input_length"]["max"] == 1100
    # r1 reuses r0's two full blocks, r2 one; 512-token blocks; last tokens always computed
    assert r["ideal_hit_rate"] == pytest.approx((2 * 512 + 512) / (1100 + 1100 + 600 + 300 + 16 * 300 + 10 * 100))
    assert r["peaks"] == [10.0]  # 12 arrivals in [10, 12) against 2 in every other bucket
    plan = plan_memory(BUILTIN_SHAPES["llama-3.1-8b"], "bfloat16", 80 * GIB, 8 * GIB, 1)
    kv = r["kv"]
    assert (kv["kv_bytes_per_token"], kv["capacity_bytes"]) == (128 * 1024, plan.kv_budget_bytes)
    burst = next(row for row in r["timeline"] if row["start_s"] == 10.0)
    assert burst["in_flight_max"] >= 10 and burst["kv_bytes_max"] == burst["kv_tokens_max"] * 128 * 1024
    assert r["durations"] == "estimated" and r["measured_hit_rate"] is None


def test_the_table_marks_the_peak_and_says_durations_are_estimated(tmp_path, capsys):
    code, out, _ = _inspect(capsys, _trace(tmp_path), "--bucket", "2", "--kv-capacity", "1GiB")
    assert code == 0
    assert "KV: llama-3.1-8b bfloat16, 128.00 KiB per token; capacity 1.00 GiB = 8,192 tokens" in out
    peak_rows = [line for line in out.splitlines() if "*" in line and "-" in line.split()[0]]
    assert [row.split()[0] for row in peak_rows] == ["10-12"]
    assert "in flight and KV are estimated" in out


def test_a_request_log_has_measured_durations_queue_and_hits(tmp_path, capsys):
    lines = [{"timestamp": 0, "input_length": 1000, "output_length": 10, "hash_ids": [7], "e2e_ms": 4000,
              "queue_ms": 1500, "cached_tokens": 0},
             {"timestamp": 1000, "input_length": 1000, "output_length": 10, "hash_ids": [7], "e2e_ms": 3000,
              "queue_ms": 0, "cached_tokens": 512}]
    code, out, _ = _inspect(capsys, _write(tmp_path / "log.jsonl", lines), "--bucket", "1", "--json")
    r = json.loads(out)
    assert (code, r["kind"], r["durations"]) == (0, "request log", "measured")
    assert r["measured_hit_rate"] == pytest.approx(512 / 2000) and r["ideal_hit_rate"] == pytest.approx(512 / 2000)
    first, second = r["timeline"][:2]
    assert first["waiting_mean"] == pytest.approx(1.0) and second["waiting_mean"] == pytest.approx(0.5)
    assert [row["in_flight_max"] for row in r["timeline"]] == [1, 2, 2, 2]  # both end by 4 s


def test_one_run_of_a_bench_requests_jsonl(tmp_path, capsys):
    def line(run: str, rid: str, send: float) -> dict:
        record = RequestRecord(rid, run, send, (send + 0.1, send + 0.5), (1, 9), 64, 10, "length",
                               usage={"queue_ms": 0.0, "cached_tokens": 32})
        return record_to_json(record, [11, 22, 33, 44], 16)
    lines = [line(run, f"r{i}", i * 0.5) for run in ("colocated", "disaggregated") for i in range(4)]
    path = _write(tmp_path / "requests.jsonl", lines)
    code, out, _ = _inspect(capsys, path, "--arrangement", "disaggregated", "--json")
    r = json.loads(out)
    assert (code, r["kind"], r["num_requests"], r["block_size"]) == (0, "bench run 'disaggregated'", 4, 16)
    assert r["ideal_hit_rate"] == pytest.approx(3 * 48 / (4 * 64))  # 3 blocks each after the first
    assert r["measured_hit_rate"] == pytest.approx(0.5)
    code, _, err = _inspect(capsys, path, "--arrangement", "nope")
    assert code == 2 and "--arrangement 'nope': the file has colocated, disaggregated" in err


def test_plot_writes_one_png_page(tmp_path, capsys):
    png = tmp_path / "page.png"
    code, _, err = _inspect(capsys, _trace(tmp_path), "--plot", str(png))
    assert code == 0 and f"wrote {png}" in err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(("text", "message"), [
    ("not json\n", "cannot read it as JSON lines"),
    ('{"a": 1}\n', "neither a Mooncake trace, a request log nor a bench requests.jsonl"),
    ('{"timestamp": 0, "input_length": "x", "output_length": 1}\n', "a trace line lacks or garbles"),
])
def test_bad_files_exit_2_with_one_line(tmp_path, capsys, text, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(text)
    code, out, err = _inspect(capsys, str(path))
    assert code == 2 and out == "" and message in err and err.count("\n") == 1


@pytest.mark.parametrize("command", ["inspect", "plan", "bench"])
def test_every_option_has_a_help_line(command):
    import argparse

    from cli.main import build_parser

    (subcommands,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    missing = [a.option_strings or a.dest for a in subcommands.choices[command]._actions if not a.help]
    assert not missing, f"pdserve {command}: options without help: {missing}"
