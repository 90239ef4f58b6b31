"""A worker's capacity, per pool: what one prefill worker computes per second and how many
requests one decode worker keeps within the ITL SLO and its KV.

Both come from a step-time model (seconds for a step of a given shape, sizing/cost_model.py's
`StepTotals`): the emulated device's cost model (`cost_model`), this host's fit from `pdserve plan
--measure` (`measured`), or a least-squares fit to the workers' own step records (`online`: wall =
a + b x tokens + c x context tokens + d x attended pairs, the cost model's terms; the cost model is
its prior until MIN_FIT_STEPS steps are seen). Whatever the source, it corrects itself: each
interval the warmed-up workers' steps are timed against the model, and the pool's `correction`
moves halfway towards measured / modelled (bounded to [CORRECTION_MIN, CORRECTION_MAX]), so a
profile that is 30% optimistic costs a few intervals of under-sizing, not a standing error.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from protocol.telemetry import StepRecord
from sizing.cost_model import CostModel, StepTotals

MIN_FIT_STEPS = 32  # steps before an online fit replaces the prior
FIT_RING = 4096  # steps an online fit keeps per pool
MIN_CORRECTION_STEPS = 8  # steps in a window before it moves the correction
CORRECTION_GAIN = 0.5
CORRECTION_MIN, CORRECTION_MAX = 0.2, 5.0


def totals(r: StepRecord) -> StepTotals:
    return StepTotals(r.decode_rows + r.prefill_tokens, r.context_tokens, r.attended_pairs)


@dataclass(frozen=True)
class CostStepModel:
    """The roofline of sizing/cost_model.py applied to a step's totals."""

    cost: CostModel

    def step_s(self, t: StepTotals) -> float:
        c = self.cost
        memory = c.step_bytes(t) / (c.device.bandwidth * c.bandwidth_efficiency)
        compute = c.step_flops(t) / (c.device.flops * c.compute_efficiency)
        return max(memory, compute) + c.step_overhead_s


@dataclass(frozen=True)
class LinearStepModel:
    """wall = overhead + per_token x tokens + per_context x context tokens + per_pair x pairs (all >= 0)."""

    overhead: float
    per_token: float
    per_context: float
    per_pair: float

    def step_s(self, t: StepTotals) -> float:
        return self.overhead + self.per_token * t.num_tokens + self.per_context * t.context_tokens \
            + self.per_pair * t.attended_pairs

    @classmethod
    def fit(cls, samples: Iterable[tuple[StepTotals, float]]) -> LinearStepModel | None:
        """Least squares with every coefficient kept >= 0 (a negative one is dropped and the rest refit);
        None without samples."""
        rows = [(1.0, t.num_tokens, t.context_tokens, t.attended_pairs, wall) for t, wall in samples]
        if not rows:
            return None
        data = np.array(rows, dtype=np.float64)
        x, y = data[:, :4], data[:, 4]
        scale = np.maximum(x.max(axis=0), 1.0)  # columns of very different size: solve on unit scale
        keep = [0, 1, 2, 3]
        coef = np.zeros(4)
        while keep:
            sol, *_ = np.linalg.lstsq(x[:, keep] / scale[keep], y, rcond=None)
            if (sol >= 0).all():
                coef[keep] = sol / scale[keep]
                break
            keep.pop(int(np.argmin(sol)))
        return cls(*(float(c) for c in coef))


class CapacityProfile:
    """Per pool: the base step model (may be None until an online fit has data) and its correction."""

    def __init__(self, source: str, prior: CostStepModel | None, budget_tokens: int, chunk: int | None,
                 max_seqs: int):
        self.source = source  # cost_model | measured | online
        self.budget_tokens, self.chunk, self.max_seqs = budget_tokens, chunk or budget_tokens, max_seqs
        self.prior = prior
        self.models: dict[str, CostStepModel | LinearStepModel | None] = {"prefill": prior, "decode": prior}
        self.correction = {"prefill": 1.0, "decode": 1.0}
        self._ring: dict[str, deque[tuple[StepTotals, float]]] = {p: deque(maxlen=FIT_RING) for p in self.models}

    def ready(self, pool: str) -> bool:
        return self.models[pool] is not None

    def step_s(self, pool: str, t: StepTotals) -> float:
        model = self.models[pool]
        assert model is not None, f"no step model for the {pool} pool yet"
        return model.step_s(t) * self.correction[pool]

    def learn(self, pool: str, steps: list[StepRecord]) -> None:
        """A window's steps of warmed-up workers: refit (online) and move the correction."""
        samples = [(totals(r), r.wall_s) for r in steps if r.decode_rows + r.prefill_tokens > 0]
        if self.source == "online":
            self._ring[pool].extend(samples)
            if len(self._ring[pool]) >= MIN_FIT_STEPS:
                self.models[pool] = LinearStepModel.fit(self._ring[pool])
        model = self.models[pool]
        if model is None or len(samples) < MIN_CORRECTION_STEPS:
            return
        modelled = sum(model.step_s(t) for t, _ in samples)
        if modelled <= 0:
            return
        measured = sum(wall for _, wall in samples) / modelled
        moved = self.correction[pool] + CORRECTION_GAIN * (measured - self.correction[pool])
        self.correction[pool] = min(CORRECTION_MAX, max(CORRECTION_MIN, moved))

    # ---- what a worker carries -------------------------------------------------------------
    def prefill_time_s(self, pool: str, prompt: float) -> float:
        """One prompt of `prompt` tokens alone on a worker: its chunks in turn."""
        n, done, total = max(1, round(prompt)), 0, 0.0
        while done < n:
            c = min(self.chunk, n - done)
            total += self.step_s(pool, StepTotals(c, done + c, c * done + c * (c + 1) // 2))
            done += c
        return total

    def prefill_rate(self, pool: str, prompt: float) -> float:
        """Prompt tokens per second of a busy worker: full steps of the token budget, made of chunks
        of prompts of mean length `prompt` at their mean position."""
        b = self.budget_tokens
        n = max(1.0, prompt)
        context = b if n <= b else b / 2 + n / 2  # several whole prompts, or one chunk mid-prompt
        pairs = b * (n + 1) / 2 if n <= b else b * n / 2
        return b / self.step_s(pool, StepTotals(b, int(context), int(pairs)))

    def decode_step_s(self, pool: str, batch: int, context: float) -> float:
        ctx = int(batch * max(1.0, context))
        return self.step_s(pool, StepTotals(batch, ctx, ctx))

    def decode_slots(self, pool: str, context: float, final_context: float, kv_tokens: int, itl_s: float,
                     kv_high: float) -> int:
        """Requests one decode worker keeps at once: its step within `itl_s` at mean context
        `context`, their final contexts within `kv_high` of its KV, at most max_num_seqs; >= 1."""
        by_kv = int(kv_high * kv_tokens // max(1.0, final_context)) if kv_tokens else self.max_seqs
        lo, hi = 1, max(1, min(self.max_seqs, by_kv))
        while lo < hi:  # the largest batch whose step fits the ITL
            mid = (lo + hi + 1) // 2
            if self.decode_step_s(pool, mid, context) <= itl_s:
                lo = mid
            else:
                hi = mid - 1
        return lo
