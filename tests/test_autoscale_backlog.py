"""The planner's backlog sizing (router/autoscale/sizing.py, planner.py `_down`), on hand-built
observations of an H100 x Llama-3.1-8B cluster: a backlog is sized for what is left when a new
worker is ready, one long prompt is one busy worker, and the workers bought for a backlog are
released once it is cleared, not held for the scale-down cooldown; decode admits what prefill
sends, but no more requests than there are, nor the prompts the rate keeps waiting anyway. Each
with the contrast that fails without the rule."""

from __future__ import annotations

import dataclasses
import math

from router.autoscale import planner as planner_module
from router.autoscale.observation import PoolObservation, WorkerSample
from tests.autoscale_util import interval, planner, pool, worker


def _in_queue(tokens: int, prompt: int = 8000) -> dict:
    """The observation's fields for `tokens` of `prompt`-token prompts waiting in the router's queue
    for a prefill slot (not yet placed on a worker: the first worker with a slot takes each)."""
    n = max(1, tokens // prompt)
    return {"queued": n, "queued_prompt_tokens": tokens, "waiting_first": n}


def _draining(start_s: float | None):
    """Two warm prefill workers, 1 request/s of 8,000 tokens, and 300k prompt tokens waiting in the
    router's queue (the oldest 2.5 s of a 3 s SLO: urgent). The two clear it in ~5 s; a new worker
    is ready in `start_s`."""
    prefill = dataclasses.replace(pool("prefill", 2), start_s=start_s)
    return planner(ttft_s=3.0, prefill_max=32).decide(interval(
        1000.0, prefill, pool("decode", 2), arrivals=10, prompt=8000, output=200, ttft_q_s=0.4,
        wait_q_s=2.5, **_in_queue(300_000)))


def test_a_backlog_the_workers_clear_before_a_new_one_is_ready_asks_for_none():
    slow_start = _draining(start_s=10.0)
    assert slow_start.inputs["prefill_residual_s"] == 0.0
    assert slow_start.desired("prefill") == 2 and slow_start.pools["prefill"].cause != "forecast", slow_start.reason
    unknown = _draining(start_s=None)  # no start-up measured: the whole backlog within the TTFT budget
    assert unknown.desired("prefill") > 2 and unknown.pools["prefill"].cause == "forecast"
    quick = _draining(start_s=1.0)  # ready in 1 s: what the two have not cleared by then still asks
    assert 2 < quick.desired("prefill") < unknown.desired("prefill")


def _one_long_prompt(waiting: tuple[int, ...]):
    """Two warm prefill workers, 1 request/s of 8,000 tokens, and 120k tokens waiting for a slot."""
    return planner(ttft_s=3.0, prefill_max=32).decide(interval(
        1000.0, pool("prefill", 2), pool("decode", 2), arrivals=10, prompt=8000, output=200, ttft_q_s=0.4,
        queued=len(waiting) or 1, queued_prompt_tokens=120_000, waiting_first=len(waiting) or 1, wait_q_s=1.0,
        waiting_prompts=waiting))


def test_one_long_prompt_is_one_busy_worker_not_a_backlog_more_workers_clear():
    single = _one_long_prompt((120_000,))
    assert single.inputs["prefill_backlog_workers"] <= 1.0
    many = _one_long_prompt((8000,) * 15)  # the same tokens as 15 prompts: several workers clear them sooner
    assert many.inputs["prefill_backlog_workers"] > 1.2
    aggregate = _one_long_prompt(())  # without the per-prompt lengths: all of it at the mean prompt's rate
    assert aggregate.inputs["prefill_backlog_workers"] > 1.2


def _burst_then_quiet(queued_first: int, arrivals_first: int, p=None, at: float = 1000.0, size: int = 2):
    """One evaluation at `at` (`queued_first` 8,000-token prompts queued, the oldest 2.5 s of 3 s;
    `arrivals_first` in its 10 s), then 1 request/s and no backlog, every 10 s for 60 s."""
    p = p or planner(ttft_s=3.0, prefill_max=32)
    first = p.decide(interval(at, pool("prefill", size), pool("decode", 4), arrivals=arrivals_first, prompt=8000,
                              output=200, ttft_q_s=0.4, queued=queued_first,
                              queued_prompt_tokens=8000 * queued_first, waiting_first=queued_first + 1, wait_q_s=2.5))
    size, after = first.desired("prefill"), []
    for k in range(1, 7):
        d = p.decide(interval(at + 10 * k, pool("prefill", size), pool("decode", 4), arrivals=10, prompt=8000,
                              output=200, ttft_q_s=0.4))
        size = d.desired("prefill")
        after.append(d)
    return first, after


def test_workers_grown_for_a_backlog_go_once_it_is_cleared_not_after_the_cooldown():
    first, after = _burst_then_quiet(queued_first=150, arrivals_first=10)
    assert first.desired("prefill") > 10 and first.pools["prefill"].cause == "forecast"
    assert after[0].pools["prefill"].cause == "cleared" and after[0].desired("prefill") < first.desired("prefill")
    assert after[0].desired("prefill") >= 1 and not any(d.changed for d in after[1:])  # once, then held
    # the contrast: a pool grown for its arrival rate keeps its size (the peak of the last
    # scale_down_cooldown_s, and the cooldown)
    grown, quiet = _burst_then_quiet(queued_first=0, arrivals_first=400)
    assert grown.desired("prefill") > 10 and grown.pools["prefill"].cause == "forecast"
    assert all(d.desired("prefill") == grown.desired("prefill") for d in quiet)


def test_a_backlog_that_comes_back_soon_after_a_release_is_released_to_the_windows_work():
    """Backlogs that recur are load, not a one-off: the second, 70 s after the first's workers
    were released (to its rate's peak: 1), grows the pool again; once it is cleared its workers
    go down to what the window's work needs, both backlogs counted (not to 1 again, and not held
    at 14 for the cooldown), and that size is held."""
    p = planner(ttft_s=3.0, prefill_max=32)
    _, after = _burst_then_quiet(150, 10, p)
    assert after[0].pools["prefill"].cause == "cleared" and after[0].desired("prefill") == 1
    again, later = _burst_then_quiet(150, 10, p, at=1080.0, size=after[-1].desired("prefill"))
    assert again.desired("prefill") > 10
    released = later[0].desired("prefill")
    assert later[0].pools["prefill"].cause == "cleared" and 1 < released < again.desired("prefill"), later[0].reason
    assert "a recurring backlog" in later[0].pools["prefill"].reason
    assert all(d.desired("prefill") == released for d in later[1:]), [d.reason for d in later]


def _missed(tokens: int, placed: bool = False):
    """Two warm prefill workers, the window's TTFT 10 s of a 3 s SLO, and `tokens` of 8,000-token
    prompts waiting: in the router's queue, or `placed` on the two workers already."""
    waiting = {"waiting_first": max(1, tokens // 8000)} if placed else _in_queue(tokens)
    prefill = dataclasses.replace(pool("prefill", 2, queued_tokens=tokens if placed else 0), start_s=3.2)
    return planner(ttft_s=3.0, prefill_max=32).decide(interval(
        1000.0, prefill, pool("decode", 2), arrivals=10, prompt=8000, output=200, ttft_q_s=10.0, wait_q_s=0.5,
        **waiting))


def test_a_miss_new_workers_cannot_shorten_adds_none():
    """The window's TTFT is 10 s of a 3 s SLO (a 120k-token prompt's own prefill), but the two
    warm workers clear what waits before a worker started now would be ready: no step up. The same
    miss with a backlog left by then steps up."""
    held = _missed(24_000)
    assert held.desired("prefill") == 2 and "before a new one would be ready" in held.pools["prefill"].reason
    stepped = _missed(600_000)
    assert stepped.desired("prefill") > 2 and stepped.pools["prefill"].cause in ("slo", "forecast")


def test_prompts_placed_on_the_workers_are_not_a_backlog_a_new_worker_takes():
    """The same 600k tokens and miss, placed on the two workers already (the router places a prompt
    as it arrives, up to `max_prefill_inflight` a worker, and each is computed where it was placed):
    a new worker would take none of them, so none is started (the conversation trace's bunches of
    8-20 prompts, all placed, grew prefill 3 -> 4-6 without shortening their waits). Counted as work
    any worker can take, they step the pool up (the test above)."""
    placed = _missed(600_000, placed=True)
    assert placed.inputs["prefill_backlog_tokens"] == 600_000 and placed.inputs["prefill_residual_s"] == 0.0
    assert placed.desired("prefill") == 2 and "before a new one would be ready" in placed.pools["prefill"].reason


def _finite_backlog(running: int = 5):
    """2 warm prefill and 2 warm decode workers (H100 KV) running `running` requests each, 3
    requests/s of 15,000 tokens, and 8 prompts of 36,000 tokens waiting for prefill, the oldest
    4.2 s of a 5 s SLO (urgent): the conversation trace's bunches."""
    decode = [WorkerSample(f"d{i}", 1000.0, 6000, 30_000, 16, running, 0) for i in range(2)]
    return planner(ttft_s=5.0, prefill_max=15, decode_max=15).decide(interval(
        1000.0, pool("prefill", 2), pool("decode", decode), arrivals=30, prompt=15000, output=330, ttft_q_s=1.6,
        queued=8, queued_prompt_tokens=8 * 36000, waiting_first=8, wait_q_s=4.2, waiting_prompts=(36000,) * 8,
        decoding=2 * running))


def test_decode_admits_what_prefill_sends_but_no_more_requests_than_there_are():
    """Prefill grows 2 -> 5 for the backlog; at full speed 5 workers would send decode ~10
    requests/s, 3.2 workers' worth over a request's stay, but there are only the 8 waiting (within
    the ~13 the rate keeps waiting: none beyond) and the larger of 10 held and a stay's arrivals:
    decode keeps 2 (without the cap, 4)."""
    d = _finite_backlog()
    assert d.desired("prefill") == 5 and d.desired("decode") == 2, d.reason
    f = d.inputs
    full_speed = 5 * f["prefill_tokens_per_s_per_worker"] / 15000 * f["decode_stay_s"] / f["decode_slots_per_worker"]
    beyond = max(0.0, 8 - 3.0 * (5.0 - f["prefill_own_s"]))  # waiting beyond what the rate keeps waiting
    there = (beyond + max(10, 3.0 * f["decode_stay_s"])) / f["decode_slots_per_worker"]  # held or a stay's arrivals
    assert full_speed > 3 and math.isclose(f["decode_admitting_load"], there)


def test_what_decode_holds_leaves_as_a_stays_arrivals_come(monkeypatch):
    """2 warm decode workers hold 20 requests, 8 wait for prefill (urgent), 3 requests/s stay
    ~9.2 s each: at once there are at most the larger of the 20 held and a stay's ~27.5 arrivals
    (the held leave within the stay as they come; the 8 are within what the rate keeps waiting):
    1.1 workers' slots, decode keeps 2.
    Counting the held and the stay's arrivals both (55.5 requests, 2 workers' slots at 99%) it grew
    to 3, as the conversation trace's decode did at its bunches (2 workers carried them)."""
    assert _finite_backlog(running=10).desired("decode") == 2
    f = _finite_backlog(running=10).inputs
    assert math.isclose(f["decode_admitting_load"], 3.0 * f["decode_stay_s"] / f["decode_slots_per_worker"])

    def summed(needs, prefill_workers, load, obs, rps):  # the rule before: the held and a stay's arrivals added
        need = needs["decode"]
        there = need.figures["decode_held"] + obs.waiting_first + load.requests_per_s * need.figures["decode_stay_s"]
        sent = prefill_workers * needs["prefill"].figures["prefill_tokens_per_s_per_worker"] / load.prompt_len
        admitting = min(sent * need.figures["decode_stay_s"], there) / need.figures["decode_slots_per_worker"]
        return dataclasses.replace(need, load=max(need.load, admitting), urgent=True)
    monkeypatch.setattr(planner_module.Planner, "_admitting", staticmethod(summed))
    assert _finite_backlog(running=10).desired("decode") == 3


def _conversation_bunch():
    """The conversation trace's bunch (its decision at 90 s): 3 warm prefill and 2 warm decode
    workers holding 17 requests, 4 requests/s of 15,000 tokens, and 16 prompts placed on prefill
    waiting their first token, the oldest 6 s of a 5 s SLO (prefill urgent). At 4 requests/s the
    rate keeps ~18 prompts waiting within the TTFT budget anyway."""
    decode = [WorkerSample(f"d{i}", 1000.0, 9000, 30_000, 16, n, 0) for i, n in enumerate((9, 8))]
    prefill = dataclasses.replace(pool("prefill", 3, queued_tokens=16 * 15000), start_s=3.2)
    return planner(ttft_s=5.0, prefill_max=15, decode_max=15).decide(interval(
        1000.0, prefill, pool("decode", decode), arrivals=40, prompt=15000, output=350, ttft_q_s=2.0,
        waiting_first=16, wait_q_s=6.0, waiting_prompts=(15000,) * 16, decoding=17))


def test_prompts_the_rate_keeps_waiting_are_not_more_for_decode_to_admit(monkeypatch):
    """Decode admits what prefill sends: at most those without a first token beyond the rate's
    ~18 (none here) and a stay's arrivals (~39): 1.4 workers' slots, decode keeps 2. Counting the
    16 waiting on top (55 requests), 2 workers' slots: 2 -> 3, as the conversation trace's decode
    went four times at its bunches (3P2D, which never grows, met 94.3%)."""
    d = _conversation_bunch()
    f = d.inputs
    assert math.isclose(f["decode_admitting_load"], 4.0 * f["decode_stay_s"] / f["decode_slots_per_worker"])
    assert d.desired("decode") == 2, d.reason

    def before(self, needs, prefill_workers, load, obs, rps):  # every prompt waiting counted on top
        need = needs["decode"]
        stay, slots = need.figures["decode_stay_s"], need.figures["decode_slots_per_worker"]
        there = obs.waiting_first + max(need.figures["decode_held"], load.requests_per_s * stay)
        sent = prefill_workers * needs["prefill"].figures["prefill_tokens_per_s_per_worker"] / load.prompt_len
        return dataclasses.replace(need, load=max(need.load, min(sent * stay, there) / slots), urgent=True)
    monkeypatch.setattr(planner_module.Planner, "_admitting", before)
    assert _conversation_bunch().desired("decode") == 3


def test_a_step_for_a_miss_a_backlog_makes_goes_once_the_backlog_is_cleared():
    """Five warm prefill workers, 700k prompt tokens waiting and the window's TTFT 3.3 s of 3 s:
    the forecast asks for no more than 5, the miss steps up to 6 (cause `slo`), and what is left
    when a new worker is ready is a backlog (`prefill_residual_s` > 0). Once it is cleared the pool
    goes down at once (`cleared`), not after the cooldown."""
    p = planner(ttft_s=3.0, prefill_max=32)

    def observe(at: float, size: int, **kw):
        prefill = dataclasses.replace(pool("prefill", size), start_s=3.2)
        return p.decide(interval(at, prefill, pool("decode", 2), arrivals=10, prompt=8000, output=200, **kw))
    stepped = observe(1000.0, 5, ttft_q_s=3.3, wait_q_s=0.5, **_in_queue(700_000))
    assert stepped.desired("prefill") == 6 and stepped.pools["prefill"].cause == "slo"
    assert stepped.inputs["prefill_residual_s"] > 0
    after = observe(1010.0, 6, ttft_q_s=0.4)
    assert after.pools["prefill"].cause == "cleared" and after.desired("prefill") < 6, after.reason


def test_a_prefill_miss_steps_up_by_what_its_backlog_needs_not_a_doubling():
    """Ten warm prefill workers, the window's TTFT 6 s of 3 s (a ratio of 2, which steps a pool
    twice its size) and 1M prompt tokens waiting: what is left of them when a new worker is ready
    asks for ~1.9 workers over the clearing horizon, so the step is 10 -> 12, not 10 -> 20
    (conversation-4x's step at a bunch's miss)."""
    prefill = dataclasses.replace(pool("prefill", 10), start_s=3.2)
    d = planner(ttft_s=3.0, prefill_max=32).decide(interval(
        1000.0, prefill, pool("decode", 2), arrivals=100, prompt=8000, output=200, ttft_q_s=6.0, wait_q_s=0.5,
        **_in_queue(1_000_000)))
    assert d.pools["prefill"].cause == "slo", d.reason
    assert 1 < d.inputs["prefill_backlog_workers"] <= 2 and d.desired("prefill") == 12


def test_prompts_the_rate_keeps_waiting_are_not_a_backlog_for_decode():
    """12 requests/s of 15,000 tokens on 10 warm prefill workers, a 5 s TTFT SLO. 20 prompts
    waiting for prefill are what that rate keeps waiting within the TTFT budget (12 x ~4.5 s = 54):
    decode is sized on the arrivals alone (12/s x a stay over the slots a worker keeps), where
    counting them as a backlog on top added 20 requests (2.2 workers here). 100 waiting are 46
    beyond the rate's, each overlapping a stay on decode."""
    def decide(waiting: int):
        return planner(ttft_s=5.0, prefill_max=32, decode_max=32).decide(interval(
            1000.0, pool("prefill", 10, queued_tokens=15000 * waiting), pool("decode", 6), arrivals=120, prompt=15000,
            output=330, ttft_q_s=1.5, waiting_first=waiting, wait_q_s=1.0)).inputs
    steady = decide(20)
    budget = 5.0 - steady["prefill_own_s"]
    assert steady["decode_from_backlog"] == 0.0
    assert math.isclose(steady["decode_load"], 12 * steady["decode_stay_s"] / steady["decode_slots_per_worker"])
    backlog = decide(100)
    overlap = min(1.0, backlog["decode_stay_s"] / budget)
    assert math.isclose(backlog["decode_from_backlog"], (100 - 12 * budget) * overlap)


def test_the_release_after_an_opening_backlog_plans_for_the_rates_mean_not_one_windows_peak():
    """An opening like the conversation trace's: the first window (a whole interval here; a shorter
    one's count is not yet a rate, tests/test_autoscale_window.py) holds 5.2 requests/s of
    15,000 tokens against the trace's 3, and 12 wait while both prefill workers are still warming
    up: prefill grows 2 -> 6 for the backlog. At the next evaluation, with 3
    requests/s and the backlog cleared, it goes to what the survivors carry without the backlog
    (the rate's mean load at (1 - band) of the target, the first window's arrivals within the
    target): 4. Planned at (1 - band) for the peak of the rate's load (that first window's
    forecast) it held 5."""
    p = planner(ttft_s=5.0, prefill_max=15, decode_max=15)

    def prefill(n: int, age_s: float) -> PoolObservation:
        return dataclasses.replace(pool("prefill", [worker(f"p{i}", age_s=age_s) for i in range(n)]), start_s=3.2)
    grown = p.decide(interval(10.0, prefill(2, 10.0), pool("decode", 2), arrivals=52, prompt=15000, output=330,
                              waiting_first=12, queued=12, queued_prompt_tokens=180_000, wait_q_s=2.0))
    assert grown.desired("prefill") == 6 and grown.pools["prefill"].cause == "forecast", grown.reason
    peak = grown.inputs["prompt_tokens_per_s"] / grown.inputs["prefill_tokens_per_s_per_worker"]
    released = p.decide(interval(20.0, prefill(6, 100.0), pool("decode", 2), arrivals=30, prompt=15000, output=330,
                                 ttft_q_s=1.0))
    assert released.pools["prefill"].cause == "cleared" and released.desired("prefill") == 4, released.reason
    assert math.ceil(peak / (0.8 * (1 - 0.2))) == 5


def test_decode_grown_for_the_kv_a_bunch_holds_goes_once_it_has_left():
    """Two warm decode workers at 85% KV (a bunch of long requests held) and 1 request/s arriving:
    decode grows 2 -> 3 for what it holds, beyond what its arrivals ask. Ten seconds later the
    bunch has left (KV 10%): the pool goes back at once (`cleared`), not after the 120 s cooldown
    (the conversation trace held decode 3 from 146 s to 266 s on 62-79% KV)."""
    p = planner(ttft_s=5.0, prefill_max=15, decode_max=15)

    def observe(at: float, n: int, kv_used: int, running: int):
        decode = [worker(f"d{i}", kv_used=kv_used, running=running) for i in range(n)]
        return p.decide(interval(at, pool("prefill", 2), pool("decode", decode), arrivals=10, prompt=8000,
                                 output=200, ttft_q_s=0.5, decoding=n * running))
    grown = observe(1000.0, 2, 8500, 4)
    assert grown.desired("decode") == 3 and grown.pools["decode"].cause == "forecast", grown.reason
    after = observe(1010.0, 3, 1000, 1)
    assert after.pools["decode"].cause == "cleared" and after.desired("decode") == 2, after.reason
