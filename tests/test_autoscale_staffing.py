"""A scale-down's headroom (router/autoscale/sizing.py `kept_workers`): proportional to a small
pool's load, growing as the square root of a large one's (square-root staffing), on hand-built
observations of an H100 x Llama-3.1-8B prefill pool; with the contrast that fails without the rule."""

from __future__ import annotations

import math

from router.autoscale import sizing
from tests.autoscale_util import interval, planner, pool, profile


def _settled(load_workers: float, size: int) -> int:
    """Prefill's size after 150 s of a steady load of `load_workers` worker-equivalents (at full
    capacity, 1,000-token prompts, no backlog) on `size` warm workers: past the scale-down cooldown."""
    p = planner(prefill_max=32, decode_max=64)
    per_worker = profile().prefill_rate("prefill", 1000)  # prompt tokens/s at full capacity
    arrivals = round(load_workers * per_worker * 10 / 1000)
    for k in range(16):
        d = p.decide(interval(1000.0 + 10 * k, pool("prefill", size), pool("decode", 64), arrivals=arrivals,
                              output=1))
        size = d.desired("prefill")
    return size


def test_a_large_pool_keeps_a_square_root_headroom_a_small_one_the_whole_band(monkeypatch):
    # 9 workers' load: kept at 9 + (1 / 0.64 - 1) x sqrt(9 x 4.5) = 12.6 -> 13 (its peak asks 9 / 0.8 -> 12)
    assert _settled(9.0, 16) == 13
    # 2 workers' load: 2 / 0.64 = 3.1 -> 4, the band whole (bunched arrivals on 2-3 workers need it)
    assert _settled(2.0, 8) == 4
    monkeypatch.setattr(sizing, "SQRT_FROM", math.inf)  # the band proportional at every size
    assert _settled(9.0, 16) == 15  # 9 / 0.64 = 14.1 -> 15
    assert _settled(2.0, 8) == 4
