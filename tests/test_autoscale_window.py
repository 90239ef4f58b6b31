"""The planner's windows, on hand-built observations of an H100 x Llama-3.1-8B cluster: a
scale-down (router/autoscale/planner.py `_survivors`) leaves survivors that carry the window's
work, a short backlog amortized over it (worker-seconds, not a level to hold), and that none of
the window's arrival rates would scale up again; an early evaluation's short window reads its
arrivals at their Poisson lower bound (`_seen`). Each with the contrast that fails without the rule."""

from __future__ import annotations

import dataclasses
import math

import pytest

from router.autoscale import planner as planner_module
from router.observability.recent import RecentLoad
from tests.autoscale_util import interval, planner, pool, worker

U, BAND = 0.8, 0.2  # the planner's defaults: target_utilization, band


def _window(p, rates: list[int], backlog_at: int | None = None, size: int = 6):
    """Evaluations every 10 s from t=1000 (the last at 1120: the first a scale-down may take) with `rates[k]` 8,000-token prompts arriving in each
    10 s window, on `size` warm prefill workers; at `backlog_at` 60 of them (480k tokens) also wait
    for a prefill slot, the oldest 0.5 s of a 5 s SLO (the workers clear it in ~3 s: no scale-up)."""
    out = []
    for k, arrivals in enumerate(rates):
        queued = 60 if k == backlog_at else 0
        out.append(p.decide(interval(1000.0 + 10 * k, pool("prefill", size), pool("decode", 2), arrivals=arrivals,
                                     prompt=8000, output=200, ttft_q_s=0.4, queued=queued,
                                     queued_prompt_tokens=8000 * queued, waiting_first=queued,
                                     wait_q_s=0.5 if queued else 0.0)))
    return out


def _arrivals_load(d) -> float:
    return d.inputs["prompt_tokens_per_s"] / d.inputs["prefill_tokens_per_s_per_worker"]


def test_a_short_backlog_is_the_windows_work_not_a_level_the_survivors_hold(monkeypatch):
    """Six prefill workers, a flat 5 requests/s (about 1.3 workers), and once a 480k-token backlog
    that asks for ~3 workers more for one evaluation. After the cooldown the pool goes to what the
    window's work needs (3); planning for its peak load, backlog included, holds 6."""
    decisions = _window(planner(ttft_s=5.0), [50] * 13, backlog_at=4)
    spike = decisions[4].inputs["prefill_load"]
    assert spike > 6 * U * (1 - BAND) and all(d.desired("prefill") == 6 for d in decisions[:-1])
    last = decisions[-1]
    assert last.desired("prefill") == 3 and last.pools["prefill"].cause == "survivors", last.reason
    loads = [d.inputs["prefill_load"] for d in decisions[1:]]
    assert math.ceil(sum(loads) / len(loads) / (U * (1 - BAND))) <= 3 < math.ceil(spike / (U * (1 - BAND)))

    def peak(self, window, need):  # the rule before: the window's peak load, backlog included
        return math.ceil(max(h[2] for h in self._history["prefill"]) / (U * (1 - BAND)) - 1e-9)
    monkeypatch.setattr(planner_module.Planner, "_survivors", peak)
    assert _window(planner(ttft_s=5.0), [50] * 13, backlog_at=4)[-1].desired("prefill") == 6


def test_the_survivors_are_a_size_no_arrival_rate_of_the_window_scales_up_from(monkeypatch):
    """A flat 3 requests/s with one interval of 9: the window's mean fits 2 workers at (1 - band)
    of the target, but at 2 that interval's rate would ask for more again (a flap). The pool
    goes to the size that rate fits within the target utilization."""
    rates = [30] * 13
    rates[3] = 90
    decisions = _window(planner(ttft_s=5.0), rates)
    peak = max(_arrivals_load(d) for d in decisions[1:])
    last = decisions[-1]
    assert last.pools["prefill"].cause == "survivors", last.reason
    assert last.desired("prefill") == math.ceil(peak / U) == 3

    def unguarded(self, window, need):  # the window's work and what it holds, without the peak's guard
        return max(planner_module.ceil_workers(window.mean, U * (1 - BAND)),
                   planner_module.ceil_workers(need.held, U * (1 - BAND)))
    monkeypatch.setattr(planner_module.Planner, "_survivors", unguarded)
    assert _window(planner(ttft_s=5.0), rates)[-1].desired("prefill") == 2


def _bunch(p, bunch_sq: int = 0):
    """Three prefill workers at 3 requests/s of 15,000 tokens; then an early evaluation whose 1.3 s
    window saw 12 arrivals (9 requests/s by its count) and 350k tokens waiting, the oldest 4.1 s
    of a 5 s SLO (urgent): the conversation trace's bunches. `bunch_sq`: the sum of the squares of
    the window's arrival batches (0: not known, one by one)."""
    for k in range(6):
        p.decide(interval(10.0 * k, pool("prefill", 3), pool("decode", 2), arrivals=30, prompt=15000, output=330,
                          ttft_q_s=1.5))
    return p.decide(interval(51.3, pool("prefill", 3), pool("decode", 2), arrivals=12, prompt=15000, output=330,
                             window_s=1.3, ttft_q_s=2.0, queued=20, queued_prompt_tokens=350_000, waiting_first=20,
                             wait_q_s=4.1, arrival_bunch_sq=bunch_sq))


def test_a_bunch_in_an_early_evaluations_second_is_not_yet_a_rate(monkeypatch):
    """The window's 12 arrivals, one standard deviation below their count (8.5), read as 6.6
    requests/s: the pool grows for the backlog, 3 -> 7 prefill, 2 -> 5 decode. Read at face value
    (9.2 requests/s) it asks 8 prefill and 6 decode."""
    d = _bunch(planner(ttft_s=5.0, prefill_max=15, decode_max=15))
    assert (d.desired("prefill"), d.desired("decode")) == (7, 5), d.reason
    monkeypatch.setattr(planner_module, "SEEN_Z", 0.0)
    face = _bunch(planner(ttft_s=5.0, prefill_max=15, decode_max=15))
    assert (face.desired("prefill"), face.desired("decode")) == (8, 6), face.reason


def test_a_batch_sent_together_is_one_arrival_event_not_a_rate():
    """The same 12 arrivals sent as one batch (the conversation trace sends its requests in batches
    every 3 s): one event of a compound Poisson process, its count's deviation sqrt(12^2) = 12, so
    the window shows no rate above the forecast (3.6 requests/s): the pools grow for the backlog
    at the forecast's rate, 3 -> 5 prefill, 2 -> 3 decode, where the same count one by one asks 7
    + 5 (the test above)."""
    one_by_one = _bunch(planner(ttft_s=5.0, prefill_max=15, decode_max=15), bunch_sq=12)
    assert (one_by_one.desired("prefill"), one_by_one.desired("decode")) == (7, 5), one_by_one.reason
    batch = _bunch(planner(ttft_s=5.0, prefill_max=15, decode_max=15), bunch_sq=144)
    assert (batch.desired("prefill"), batch.desired("decode")) == (5, 3), batch.reason
    assert batch.inputs["arrival_bunch_sq"] == 144


def test_the_window_counts_arrivals_sent_together_as_one_batch():
    """Arrivals within 1 ms of the one before join its batch: 3 at 0 s, 1 at 0.5 s, 2 at 1 s are
    batches of 3, 1 and 2 (squares summing to 14); the next window starts afresh, even within 1 ms."""
    recent = RecentLoad()
    for at in (0.0, 0.0, 0.0004, 0.5, 1.0, 1.0):
        recent.arrived(1000, 100, at)
    window = recent.take()
    assert (window.arrivals, window.bunch_sq) == (6, 3 * 3 + 1 + 2 * 2)
    recent.arrived(1000, 100, 1.0)
    assert recent.take().bunch_sq == 1


def test_the_first_windows_count_is_not_a_rate_a_scale_down_must_fit(monkeypatch):
    """The conversation trace's opening: the first evaluation, 5 s in, sees two batches of 10 and
    16 prompts of 15,000 tokens (5.2 requests/s by their count) and Holt's level starts at that
    count; then 3 requests/s for two minutes, on 4 prefill workers. Once the cooldown after the
    start has passed, the pool goes to 3, what the rate carries. Counted as a rate of the window
    (one no later window can make again), that first count held 4."""
    def run() -> list:
        p = planner(ttft_s=5.0, prefill_max=15, decode_max=15)
        out = [p.decide(interval(5.0, pool("prefill", 4), pool("decode", 2), arrivals=26, prompt=15000, output=330,
                                 window_s=5.0, arrival_bunch_sq=10 ** 2 + 16 ** 2, ttft_q_s=1.0))]
        out += [p.decide(interval(5.0 + 10 * k, pool("prefill", 4), pool("decode", 2), arrivals=30, prompt=15000,
                                  output=330, ttft_q_s=1.0)) for k in range(1, 13)]
        return out
    decisions = run()
    assert all(d.desired("prefill") == 4 for d in decisions[:-1])
    last, first = decisions[-1], decisions[0]
    assert last.pools["prefill"].cause == "survivors" and last.desired("prefill") == 3, last.reason
    assert math.ceil(_arrivals_load(first) / U) == 4 and max(math.ceil(_arrivals_load(d) / U) for d in decisions[1:]) == 3
    monkeypatch.setattr(planner_module, "RATE_AFTER", 0.0)
    assert run()[-1].desired("prefill") == 4


def test_a_pool_grown_on_the_first_windows_count_goes_once_the_rate_carries_less(monkeypatch):
    """The same opening on 2 prefill workers still warming up, 172k prompt tokens placed on them:
    prefill grows 2 -> 4 for the first window's 5.2 requests/s (no worker is capacity yet). That
    count is not a rate, so the growth goes as a backlog's does: to 3 (`cleared`) once the rate's
    mean load fits 3, within the cooldown. With that count a rate, the cooldown held 4 for 120 s
    (the conversation trace's prefill, from 5 s to 130 s)."""
    def run() -> list:
        p = planner(ttft_s=5.0, prefill_max=15, decode_max=15)

        def prefill(n: int, age_s: float, placed: int = 0):
            workers = [worker(f"p{i}", age_s=age_s) for i in range(n)]
            return dataclasses.replace(pool("prefill", workers, queued_tokens=placed), start_s=3.2)
        out = [p.decide(interval(5.0, prefill(2, 5.0, 172_000), pool("decode", 2), arrivals=26, prompt=15000,
                                 output=330, window_s=5.0, arrival_bunch_sq=10 ** 2 + 16 ** 2, waiting_first=12,
                                 wait_q_s=2.0))]
        for k in range(1, 5):
            out.append(p.decide(interval(5.0 + 10 * k, prefill(out[-1].desired("prefill"), 100.0), pool("decode", 2),
                                         arrivals=30, prompt=15000, output=330, ttft_q_s=1.0)))
        return out
    decisions = run()
    assert decisions[0].desired("prefill") == 4 and decisions[0].pools["prefill"].cause == "forecast"
    released = [d for d in decisions if d.pools["prefill"].cause == "cleared"]
    assert len(released) == 1 and released[0].desired("prefill") == 3 and released[0].at < 125.0, \
        [d.reason for d in decisions]
    monkeypatch.setattr(planner_module, "RATE_AFTER", 0.0)
    assert all(d.desired("prefill") == 4 for d in run())


def test_the_first_requests_to_finish_are_not_a_sample_of_output_lengths(monkeypatch):
    """The opening: 38 requests asking for 350 tokens each arrived in 3 s and the 4 that finished
    are the short ones (20 tokens). Until half of those that arrived have finished, the output
    length is the one asked (a request's stay on decode ~350 steps, not 20), then the finished
    ones' (moving from it by LENGTH_GAIN for a window's share of an interval). With every
    finished length a sample at once: 20, and a colocated pool's load half of it."""
    from router.autoscale.observation import Lengths

    def first(p, finished: int, output: int, arrivals: int = 38, now: float = 3.0):
        return p.decide(interval(now, None, pool("decode", 4), arrivals=arrivals, prompt=14000, window_s=3.0,
                                 finished=finished, output=output, asked=Lengths(arrivals, 350.0, 350.0)))
    p = planner(mode="colocated", ttft_s=5.0)
    opening = first(p, 4, 20)
    assert opening.inputs["output_len"] == 350.0
    later = first(p, 60, 300, arrivals=40, now=6.0)  # 64 of 78 finished: a sample now
    gain = 1 - (1 - planner_module.LENGTH_GAIN) ** 0.3  # a 3 s window of a 10 s interval
    assert later.inputs["output_len"] == pytest.approx(350.0 + gain * (300 - 350))
    monkeypatch.setattr(planner_module, "FINISHED_SAMPLE", 0.0)
    sampled = first(planner(mode="colocated", ttft_s=5.0), 4, 20)
    assert sampled.inputs["output_len"] == 20.0
    assert opening.inputs["decode_stay_s"] > 10 * sampled.inputs["decode_stay_s"]
    assert opening.inputs["decode_load"] > 1.5 * sampled.inputs["decode_load"]  # 12.1 workers' load, not 6.3


def test_an_early_evaluations_few_finished_move_the_output_length_by_its_windows_share():
    """A full 10 s window of requests that answered 300 tokens, then an early evaluation 1.2 s
    later whose 3 finished answered 900: the output length moves by 1 - 0.7 ^ 0.12 (4%) of the
    difference, 325 tokens, not by LENGTH_GAIN (0.3) as a full interval would, 480."""
    from router.autoscale.observation import Lengths

    p = planner(ttft_s=5.0)

    def ev(now: float, window_s: float, finished: int, output: int):
        return p.decide(interval(now, pool("prefill", 2), pool("decode", 2), arrivals=30, prompt=8000,
                                 window_s=window_s, finished=finished, output=output,
                                 asked=Lengths(30, 300.0, 300.0)))
    assert ev(1000.0, 10.0, 30, 300).inputs["output_len"] == 300.0
    gain = 1 - (1 - planner_module.LENGTH_GAIN) ** 0.12
    assert ev(1001.2, 1.2, 3, 900).inputs["output_len"] == pytest.approx(300 + gain * 600)
    assert 300 + gain * 600 < 330 < 300 + planner_module.LENGTH_GAIN * 600



def test_an_early_evaluations_few_prompts_move_the_prompt_length_by_its_windows_share():
    """conversation-4x's colocated pool: a 10 s window of 14k-token prompts on 12 workers, then an early
    evaluation 1.1 s later whose 8 prompts average 37k tokens. The prompt length moves by 1 - 0.7 ^ 0.11
    (4%) of the difference, as the output length and the rates do: ~14.9k, and the pool holds 12.
    Moved by LENGTH_GAIN (0.3) as a whole interval's prompts would, 20.9k: decode's slots shrink
    for every request held and the pool asks 27 (in the run 12 -> 16, held to 140 s where 11 meet 94.6%)."""
    p = planner(mode="colocated", itl_s=0.05, ttft_s=5.0, decode_max=64)

    def ev(now: float, window_s: float, arrivals: int, prompt: int):
        return p.decide(interval(now, None, pool("decode", 12), arrivals=arrivals, prompt=prompt, output=360,
                                 window_s=window_s, finished=arrivals, decoding=90))
    assert ev(1000.0, 10.0, 120, 14000).inputs["prompt_len"] == 14000.0
    early = ev(1001.1, 1.1, 8, 37000)
    gain = 1 - (1 - planner_module.LENGTH_GAIN) ** 0.11
    assert early.inputs["prompt_len"] == pytest.approx(14000 + gain * 23000)
    assert early.desired("decode") == 12, early.reason
