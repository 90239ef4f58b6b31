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


def _one_prompt_waits(wait_s: float, gap_s: float):
    """Thirteen warm colocated workers decoding at a `gap_s` token gap (SLO 50 ms), one prompt
    without a first token for `wait_s` (SLO 5 s), none queued for a slot: it is placed already."""
    steps = tuple(decode_step(i, 4, 2000, gap_s) for i in range(14))
    workers = [worker(f"decode-{i}", kv_used=500, running=4, steps=steps) for i in range(13)]
    return planner(mode="colocated", itl_s=0.05, ttft_s=5.0, decode_max=64).decide(
        interval(1000.0, None, pool("decode", workers), arrivals=20, prompt=2000, output=200,
                 waiting_first=1, wait_q_s=wait_s, ttft_q_s=1.0))


def test_a_colocated_first_token_miss_steps_by_its_backlog_not_a_doubling():
    """conversation-4x's colocated pool of 13 read one placed prompt's 14.7 s wait (2.9x its SLO)
    with its token gap at 58 ms, and doubled to 26. A miss whose worst signal is the first token's
    is its backlog's, as a prefill pool's is: one worker; a miss of the token gap steps by its own."""
    first = _one_prompt_waits(14.7, 0.055)
    assert first.pools["decode"].cause == "slo" and first.desired("decode") == 14, first.reason
    gap = _one_prompt_waits(1.0, 0.075)  # the token gap the worst (1.5x): a step by its miss, 13 x 0.5
    assert gap.pools["decode"].cause == "slo" and gap.desired("decode") == 20, gap.reason
