"""The arithmetic of the hand-off and KV-channel benchmarks' reports (no cluster: fixed inputs)."""

from __future__ import annotations

import pytest

from scripts.bench_handoff import summarize
from scripts.bench_kv_transfer import host_limits


def _run(second_ms: float, step_ms: float) -> dict:
    return {"ttft_ms": 1000.0, "second_ms": second_ms, "third_ms": step_ms, "kv_transfer_ms": 5.0}


def test_handoff_rows_split_the_second_token_wait_into_the_decode_step_and_the_hand_off():
    # streamed: 190 and 188 ms; after the prefill: 270 and 266 ms; one decode step: 150 ms in every run
    raw = {8192: [[_run(190, 150), _run(188, 150)], [_run(270, 150), _run(266, 150)]]}
    row = summarize(raw)[8192]
    assert row["streamed_second_ms"] == 189 and row["after_second_ms"] == 268 and row["decode_step_ms"] == 150
    assert row["ratio"] == pytest.approx(189 / 268)
    assert row["floor_ratio"] == pytest.approx(150 / 268)           # what no hand-off can beat at this step
    assert row["handoff_wait_ratio"] == pytest.approx(39 / 118)     # (189 - 150) / (268 - 150)


def test_kv_channel_bounds_are_the_slowest_stage_and_the_stages_in_series():
    copy = {"memcpy": 6.0, "gather": 4.0, "scatter": 2.0}
    largest = {"raw_gbps": 1.0, "channel_gbps": 0.5}
    lim = host_limits(copy, largest)
    assert lim["overlapped_gbps"] == 1.0                            # the wire is the slowest stage
    assert lim["serial_gbps"] == pytest.approx(1 / (1 / 4 + 1 / 1 + 1 / 2))
    assert lim["channel_vs_overlapped"] == 0.5
    assert lim["channel_vs_serial"] == pytest.approx(0.5 / lim["serial_gbps"])
