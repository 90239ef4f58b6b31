"""The next interval's load from the ones before: Holt's linear smoothing with a damped trend (an
EWMA of the level plus an EWMA of its change, the change damped by PHI each interval), one per
series (requests/s, prompt tokens/s).

Why Holt: the planner looks one interval (seconds) ahead, where a level and a slope capture a
diurnal ramp within a few intervals and react to a step at once, with two fixed gains and no
fitting; the damping keeps the end of a burst from projecting a negative load for the intervals
after it (an undamped trend did: the forecast fell to 0 under steady traffic). ARIMA, Kalman or Prophet (Dynamo's choices) need long histories and buy nothing at this
horizon; what no forecast sees coming (a burst) shows up in the same interval as queued prompt
tokens and waits, which the planner sizes for directly. The forecast never goes below zero, and
after traffic stops it decays geometrically to zero (ALPHA a step), so a quiet cluster reaches
`min` instead of holding its last peak (Dynamo #6985's NaN stall has no counterpart: an empty
window is a rate of 0, not a missing value).
"""

from __future__ import annotations

ALPHA = 0.5  # weight of the newest interval in the level
BETA = 0.3  # weight of the newest change in the trend
PHI = 0.7  # the trend's damping per interval


class Holt:
    def __init__(self) -> None:
        self.level: float | None = None
        self.trend = 0.0

    def update(self, value: float, weight: float = 1.0) -> float:
        """Take the interval's observed value; return the forecast of the next (>= 0). `weight`: the
        window's length in intervals (an early evaluation's shorter window, a noisier rate, moves
        the forecast as much as that share of an interval would: gains 1 - (1 - gain) ** weight)."""
        if self.level is None:
            self.level = value
        else:
            previous, alpha, beta, phi = self.level, 1 - (1 - ALPHA) ** weight, 1 - (1 - BETA) ** weight, PHI ** weight
            self.level = alpha * value + (1 - alpha) * (previous + phi * self.trend)
            self.trend = beta * (self.level - previous) + (1 - beta) * phi * self.trend
        if value == 0.0 and self.level + PHI * self.trend <= 0.0:
            self.level, self.trend = 0.0, 0.0  # quiet: no negative trend left to undo later
        return self.forecast

    @property
    def forecast(self) -> float:
        return max(0.0, (self.level or 0.0) + PHI * self.trend)
