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



def _chunk_step(seq: int, chunk: int, wall_s: float) -> StepRecord:
    """A colocated step of 20 decode rows at 4,000 tokens and a `chunk`-token prompt chunk 8,000 tokens in
    (`chunk` 0: decode only); `wall_s` what the H100 cost model gives it, so the profile's correction stays ~1."""
    context = 20 * 4000 + (chunk + 8000 if chunk else 0)
    return StepRecord(seq, float(seq), wall_s, 20, 1 if chunk else 0, chunk, 0, 0, 0, 0, context,
                      20 * 4000 + chunk * 8000 + chunk * chunk // 2)


def _gap_window(p, now: float, window_s: float, chunk: int, wall_s: float, steps: int, arrivals: int):
    """Four warm colocated workers, each `steps` steps of `_chunk_step(chunk, wall_s)` in a `window_s` window."""
    workers = [worker(f"decode-{i}", kv_used=1000, running=20,
                      steps=tuple(_chunk_step(k, chunk, wall_s) for k in range(steps))) for i in range(4)]
    return p.decide(interval(now, None, pool("decode", workers), arrivals=arrivals, prompt=4000, output=300,
                             window_s=window_s))


def test_a_colocated_pools_token_gap_is_its_mean_over_the_last_stay_not_an_early_windows():
    """A 10 s window of decode steps (11 ms), then an early evaluation's 1.3 s while a bunch of prompts
    passes through (every step carries a 4,096-token chunk: 149 ms; conversation's colocated-4 read 176 ms
    so at 147 s and doubled to 8). A request's TPOT is its mean gap over its stay (~4 s here), so the pool
    reads the mean over the evaluations within the last stay, 20 ms: held at 4. Read over the 1.3 s alone,
    3x the SLO: 4 -> 8. A miss that lasts a whole stay still steps (a full window of 2,048-token
    chunks, 73 ms, 1.47x: 4 -> 6)."""
    p = planner(mode="colocated", itl_s=0.05, ttft_s=5.0)
    first = _gap_window(p, 1000.0, 10.0, 0, 0.011, 100, 40)
    assert first.desired("decode") == 4 and first.inputs["decode_stay_s"] > 1.3, first.reason
    bunch = _gap_window(p, 1001.3, 1.3, 4096, 0.149, 7, 5)
    assert bunch.inputs["decode_step_itl_s"] == pytest.approx((100 * 0.011 + 7 * 0.149) / 107)
    assert bunch.desired("decode") == 4, bunch.reason
    lasting = _gap_window(p, 1011.3, 10.0, 2048, 0.073, 100, 40)
    assert lasting.inputs["decode_step_itl_s"] == pytest.approx(0.073)
    assert lasting.pools["decode"].cause == "slo" and lasting.desired("decode") == 6, lasting.reason
    alone = _gap_window(planner(mode="colocated", itl_s=0.05, ttft_s=5.0), 1001.3, 1.3, 4096, 0.149, 7, 5)
    assert alone.inputs["decode_step_itl_s"] == pytest.approx(0.149) and alone.desired("decode") == 8, alone.reason
