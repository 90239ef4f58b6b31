"""The planner on one colocated pool (router/autoscale/sizing.py `Sizer.colocated`), on hand-built
observations of H100 x Llama-3.1-8B workers: the rules that differ from a disaggregated pool's,
each with the contrast that fails without it."""

from __future__ import annotations

import pytest

from protocol.telemetry import StepRecord
from tests.autoscale_util import decode_step, interval, planner, pool, worker


def _mixed_step(seq: int, batch: int, context: int, wall_s: float) -> StepRecord:
    """A colocated step: `batch` decode rows and a 2,048-token prompt chunk riding with them."""
    return StepRecord(seq, float(seq), wall_s, batch, 1, 2048, 0, 0, 0, 0, batch * context + 2048,
                      batch * context + 2048 * 1024)


def _colocated_workers(n: int) -> list:
    """`n` warm workers, each with 12 decode steps of 15 ms and 2 carrying a prompt chunk (150 ms),
    30 requests a step: per token, 14% of gaps are 150 ms; a request's mean gap is 34 ms."""
    steps = tuple(decode_step(i, 30, 4000, 0.015) for i in range(12)) + \
        tuple(_mixed_step(12 + i, 30, 4000, 0.150) for i in range(2))
    return [worker(f"decode-{i}", kv_used=1000, running=30, steps=steps) for i in range(n)]


def test_a_colocated_pools_token_gap_is_its_mean_not_its_long_steps():
    """Four colocated workers whose prompt chunks make one step in seven 150 ms long: the token
    gap at p90 is 150 ms, three times a 50 ms SLO, but each request's mean gap (its TPOT) is 34 ms.
    The colocated pool reads its mean gap and holds 4; a disaggregated decode pool with the
    same steps reads the step gap (its steps carry no prompt chunks: a long one is its tokens' gap)."""
    load = {"arrivals": 40, "prompt": 4000, "output": 300}
    d = planner(mode="colocated", itl_s=0.05, ttft_s=5.0).decide(
        interval(1000.0, None, pool("decode", _colocated_workers(4)), **load))
    assert d.inputs["decode_step_itl_s"] == pytest.approx((12 * 0.015 + 2 * 0.150) / 14)
    assert d.desired("decode") == 4, d.reason
    dis = planner(itl_s=0.05, ttft_s=5.0).decide(
        interval(1000.0, pool("prefill", 2), pool("decode", _colocated_workers(4)), **load))
    assert dis.inputs["decode_step_itl_s"] == pytest.approx(0.150)
    assert dis.desired("decode") == 8 and dis.pools["decode"].cause == "slo", dis.reason
