"""Presets that swing (or pointedly do not) for an autoscaler: `bursty` and `plateau`.

bursty: NVIDIA Dynamo's case ai-dynamo/dynamo#10528 -- traffic that jumps between 1 and 24
requests/s with 8,000-token prompts (TTFT SLA 3 s), where a planner that measures demand by
completions stayed at one replica. A square wave: `BURSTY_LOW_S` seconds at a 24th of --rate,
then `BURSTY_HIGH_S` seconds at --rate, repeated until `num_requests` were sent.
plateau: one constant Poisson rate for `PLATEAU_S` simulated seconds (30 minutes), the load
under which a planner must settle and then change nothing.
Arrivals are a non-homogeneous Poisson process, drawn by thinning, seeded.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

BURSTY_LOW_S, BURSTY_HIGH_S, BURSTY_SWING = 60.0, 30.0, 24.0  # 1 <-> 24 req/s at the default --rate 24
PLATEAU_S = 1800.0


def bursty_rate(t: float, peak: float) -> float:
    """Requests/s at `t`: the low phase first, then the burst, period BURSTY_LOW_S + BURSTY_HIGH_S."""
    return peak / BURSTY_SWING if t % (BURSTY_LOW_S + BURSTY_HIGH_S) < BURSTY_LOW_S else peak


def thinned_arrivals(n: int, rate: Callable[[float], float], top: float, rng: np.random.Generator) -> list[float]:
    """The first `n` arrivals of a Poisson process of rate `rate(t)` <= `top` (Lewis-Shedler thinning)."""
    t, out = 0.0, []
    while len(out) < n:
        t += rng.exponential(1.0 / top)
        if rng.uniform() * top <= rate(t):
            out.append(round(t, 6))
    return out


def bursts(arrivals: list[float]) -> list[dict[str, float]]:
    """The burst windows a bursty run's arrivals cover (for the report and the plot)."""
    period = BURSTY_LOW_S + BURSTY_HIGH_S
    last = arrivals[-1] if arrivals else 0.0
    return [{"start_s": k * period + BURSTY_LOW_S, "end_s": (k + 1) * period}
            for k in range(int(last // period) + 1) if k * period + BURSTY_LOW_S <= last]
