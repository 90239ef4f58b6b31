"""How many workers each pool needs for the next interval, before hysteresis and bounds.

Each pool on its own signal, in worker-equivalents at 100% of the profile's capacity (`Need.load`),
split into what the forecast rate keeps busy (`Need.steady`) and a backlog to clear (the rest):
- prefill: the forecast prompt tokens/s, plus the backlog (prompts queued in the router for a
  prefill slot and placed on prefill workers but not computed, less what the forecast rate keeps
  in service anyway: rate x a prompt's own prefill time). The backlog is counted per prompt, each at
  most the clearing horizon (one prompt runs on one worker: a 100k-token prompt is one busy worker,
  not a backlog more workers clear). A worker asked for now is ready only after the pool's last
  start-up, so the backlog it is sized for is what is left by then: the warm workers (and, from half
  a start-up on, those starting or warming) clear it meanwhile, net of the arrivals; of what is
  left, a new worker takes none of what is still placed on the workers then (a prompt placed on a
  worker is computed there), only the router's queue and, while there is one (the workers' slots
  are full), the arrivals meanwhile; that is cleared within the TTFT budget after a prompt's own
  prefill, and never faster than a start-up (workers bought to clear a backlog in less time than
  they take to start idle longer than they work);
- decode: the requests it must hold at once, the larger of Little's law on the forecast (arrivals/s
  x output tokens x the step time at the slots a worker keeps), plus the prefill backlog's requests
  that overlap on decode (prefill is sized to clear them within the TTFT budget), and what it holds now (running,
  plus requests waiting for KV room), over the slots one worker keeps within the ITL SLO and its KV;
  and at least the KV held now (plus the KV-waiters') over one worker's KV at `kv_high`;
- colocated: both on the one pool.
`Need.pressure` is the SLO signal measured on live requests: the worst of the waits of requests
still without a first token and the window's TTFT over the TTFT SLO (prefill-bound backlog only),
or of the warmed-up decode workers' step times (their ITL) over the ITL SLO and KV use over
`kv_high` (decode). Above 1 the pool misses its SLO now, whatever the profile says.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from router.autoscale.observation import Observation, WorkerSample
from router.autoscale.profile import CapacityProfile
from router.config.autoscale import AutoscaleSection

SQRT_FROM = 4.5  # worker-equivalents of load up to which a scale-down keeps a headroom proportional to it


@dataclass(frozen=True)
class Load:
    """The forecast for the next interval and the mean lengths it is made of."""

    requests_per_s: float
    prompt_tokens_per_s: float  # to compute: the prefix caches' expected hits left out
    prompt_len: float
    output_len: float
    window_prompt_tokens_per_s: float = 0.0  # the last window's own rate to compute (a burst shows here first)


@dataclass(frozen=True)
class Need:
    load: float | None  # worker-equivalents at full capacity; None: no profile yet and work to do
    pressure: float  # the SLO signal's worst ratio (<= 1: met)
    figures: dict[str, float]
    # the load is already hurting, so a scale-up need not wait for a second interval to confirm it:
    # prefill, first-token waits within the band of a miss, a backlog its warm workers cannot clear
    # within the TTFT budget while the arrivals alone outrun them, or one past twice the SLO; decode,
    # requests waiting for KV room, more held now than its warm workers keep, or its SLO signal
    # within the band of a miss
    urgent: bool = False
    steady: float | None = None  # of `load`, what the forecast rate keeps busy (the rest: a backlog); None: all of it
    # workers started now would shorten the waits (prefill: False when those there clear the backlog
    # before a new one is ready; a miss then is of prompts already on their way, a long one's own prefill)
    helps: bool = True
    # of `steady`, what the forecast's arrivals alone keep busy (decode: without what it holds now);
    # None: all of `steady`
    arrivals: float | None = None
    held: float = 0.0  # what the pool holds now, worker-equivalents (decode: its requests and KV)

    @property
    def rate_load(self) -> float | None:
        return self.load if self.steady is None or self.load is None else min(self.steady, self.load)

    @property
    def arrivals_load(self) -> float | None:
        rate = self.rate_load
        return rate if self.arrivals is None or rate is None else min(self.arrivals, rate)

    @property
    def backlog_load(self) -> float:
        """Worker-equivalents asked for a backlog, to clear once: a size for it needs no headroom."""
        return 0.0 if self.load is None or self.rate_load is None else self.load - self.rate_load

    def workers(self, utilization: float) -> float:
        """The workers it asks for (unrounded): the rate's load at `utilization`, the backlog's at full use."""
        return 0.0 if self.load is None else (self.rate_load or 0.0) / utilization + self.backlog_load


def warm(workers: tuple[WorkerSample, ...], warmup_s: float) -> list[WorkerSample]:
    return [w for w in workers if w.age_s >= warmup_s]


def weighted_quantile(pairs: list[tuple[float, int]], q: float) -> float | None:
    """The q-quantile (0-1) of values each counted `weight` times; None without any."""
    pairs = sorted((v, n) for v, n in pairs if n > 0)
    total = sum(n for _, n in pairs)
    if not total:
        return None
    rank, seen = q * total, 0
    for value, n in pairs:
        seen += n
        if seen >= rank:
            return value
    return pairs[-1][0]


class Sizer:
    def __init__(self, cfg: AutoscaleSection, profile: CapacityProfile):
        self.cfg = cfg
        self.profile = profile
        self._gaps: deque[tuple[float, float, int]] = deque()  # colocated: (at, sum of wall x rows, rows) a window
        self._stay_s = 0.0  # the last evaluation's time of a request on decode: the colocated gap's span

    def prefill(self, obs: Observation, load: Load, pool: str = "prefill") -> Need:
        c, p = self.cfg, obs.pools[pool]
        queued = max(0, obs.queued_prompt_tokens - obs.kv_waiting_tokens)  # in the router's queue, not yet placed
        backlog = queued + p.queued_tokens
        figures = {"prefill_backlog_tokens": float(backlog), "prompt_tokens_per_s": load.prompt_tokens_per_s}
        bound = backlog > 0 or obs.waiting_first > obs.kv_waiting  # someone waits for a prefill, not for KV
        ttft = max(obs.wait_q_s, obs.ttft_q_s or 0.0) if bound else 0.0
        pressure = ttft / c.ttft_s
        figures["first_token_wait_s"] = ttft
        if load.prompt_tokens_per_s == 0 and backlog == 0:
            return Need(0.0, pressure, figures)
        if not self.profile.ready(pool):
            return Need(None, pressure, figures)
        rate = self.profile.prefill_rate(pool, load.prompt_len)
        own = self.profile.prefill_time_s(pool, load.prompt_len)
        drain_s = max(c.ttft_s - own, 0.25 * c.ttft_s)
        start_s = p.start_s or 0.0
        horizon = max(drain_s, start_s)
        # of the backlog, what the forecast rate keeps in service anyway (Little: rate x a prompt's own
        # prefill time) is not a backlog to clear: steady load would otherwise read as a surplus
        work_s = self._backlog_work_s(obs, pool, backlog / rate, horizon)
        excess_s = max(0.0, work_s - load.prompt_tokens_per_s * own / rate)
        warm_n = len(warm(p.workers, c.warmup_s))
        coming_n = p.starting + len(p.workers) - warm_n
        capacity = warm_n * rate
        clear_s = excess_s * rate / capacity if capacity else (math.inf if excess_s else 0.0)  # the last queued prompt's wait
        arriving = max(load.prompt_tokens_per_s, load.window_prompt_tokens_per_s)
        outrun = arriving > capacity * c.target_utilization  # arrivals alone outrun the warm workers
        # what is left when a worker asked for now is ready: the warm workers clear it meanwhile (those
        # starting or warming from half a start-up on), net of the arrivals (negative: it grows)
        net = warm_n + coming_n / 2 - load.prompt_tokens_per_s / rate
        # a prompt placed on a worker is computed there (no work moves between workers): of what is
        # left, a new worker takes none of what is still placed then; only the router's queue and, while
        # there is one (the workers' slots are full), the arrivals meanwhile (else they are placed too)
        placed_left_s = max(0.0, p.queued_tokens / rate - (warm_n + coming_n / 2) * start_s)
        residual_s = max(0.0, excess_s - net * start_s - placed_left_s) if excess_s and queued else 0.0
        steady = load.prompt_tokens_per_s / rate
        figures |= {"prefill_tokens_per_s_per_worker": rate, "prefill_own_s": own, "prefill_excess_tokens":
                    excess_s * rate, "prefill_clear_s": min(clear_s, 1e9), "prefill_start_s": start_s,
                    "prefill_residual_s": residual_s, "prefill_backlog_workers": residual_s / horizon}
        # a backlog that hurts: waits near a miss; one the warm workers cannot clear within the TTFT
        # budget while arrivals outrun them (a burst); or one past twice the SLO (no Poisson bunch)
        urgent = pressure >= 1 - c.band or clear_s > drain_s and outrun or clear_s > 2 * c.ttft_s
        return Need(steady + residual_s / horizon, pressure, figures, urgent, steady, residual_s > 0)

    def _backlog_work_s(self, obs: Observation, pool: str, total_s: float, horizon: float) -> float:
        """The backlog in worker-seconds within `horizon`: each waiting prompt its own prefill, at most
        the horizon (a prompt runs on one worker); `total_s` (all of it at the mean prompt's rate)
        when the observation has no per-prompt lengths (or no backlog: the lengths are of the same prompts)."""
        if not obs.waiting_prompts or not total_s:
            return total_s
        return sum(min(self.profile.prefill_time_s(pool, n), horizon) for n in obs.waiting_prompts)

    def decode(self, obs: Observation, load: Load, pool: str = "decode") -> Need:
        c, workers = self.cfg, obs.pools[pool].workers
        hot = warm(workers, c.warmup_s)
        held = max(obs.decoding, sum(w.running + w.waiting for w in workers)) + obs.kv_waiting
        kv_used = sum(w.kv_used * w.block_size for w in workers) + obs.kv_waiting_tokens
        kv_each = max((w.kv_total * w.block_size for w in workers), default=0)
        itl = self._step_itl(hot) if obs.mode != "colocated" else self._stay_gap(obs.now, hot)
        kv_use = sum(w.kv_use for w in hot) / len(hot) if hot else 0.0
        pressure = max((itl or 0.0) / c.itl_s, kv_use / c.kv_high, 1.0 + 1e-9 if obs.kv_waiting and hot and
                       kv_use > c.kv_high * (1 - c.band) else 0.0)
        figures = {"decode_held": float(held), "kv_use": kv_use, "decode_step_itl_s": itl or 0.0}
        urgent = obs.kv_waiting > 0 or pressure > 1 - c.band
        if load.requests_per_s == 0 and held == 0:
            return Need(0.0, pressure, figures, urgent)
        by_kv = kv_used / (kv_each * c.kv_high) if kv_each else 0.0
        if not self.profile.ready(pool):
            return Need(by_kv or None, pressure, figures, urgent, held=by_kv)
        context = load.prompt_len + load.output_len / 2
        slots = self.profile.decode_slots(pool, context, load.prompt_len + load.output_len, kv_each, c.itl_s,
                                          c.kv_high)
        step = self.profile.decode_step_s(pool, slots, context)
        stay_s = self._stay_s = load.output_len * step  # a request's time on decode
        coming = self._backlog_coming(obs, load, stay_s)
        concurrent = max(load.requests_per_s * stay_s + coming, float(held))
        figures |= {"decode_slots_per_worker": float(slots), "decode_concurrent": concurrent,
                    "decode_from_backlog": coming, "decode_kv_load": by_kv, "decode_stay_s": stay_s}
        holding = max(held / slots, by_kv)
        urgent = urgent or holding > len(hot)  # what it holds now is past its warm workers
        arrivals = load.requests_per_s * stay_s / slots
        steady = max(arrivals, holding)
        return Need(max(concurrent / slots, by_kv), pressure, figures, urgent, steady, arrivals=arrivals,
                    held=holding)

    def _backlog_coming(self, obs: Observation, load: Load, stay_s: float) -> float:
        """Requests the prefill backlog sends decode at once, on top of the forecast (disaggregated):
        the prefill pool is sized to clear it within the TTFT budget, so its requests arrive within
        that budget and overlap for as long as each stays on decode. Those the forecast rate keeps
        waiting anyway (Little: the rate x the TTFT budget) are not a backlog: the rate's term
        (arrivals x a stay) already holds them (conversation-4x's 20-40 prompts always waiting, 12
        requests/s, held decode a worker above the static 6)."""
        prefill = obs.pools.get("prefill")
        if prefill is None or not self.profile.ready("prefill"):
            return 0.0
        waiting = max(0, obs.queued - obs.kv_waiting) + prefill.queued_tokens / load.prompt_len
        own = self.profile.prefill_time_s("prefill", load.prompt_len)
        budget_s = max(self.cfg.ttft_s - own, 0.25 * self.cfg.ttft_s)
        return max(0.0, waiting - load.requests_per_s * budget_s) * min(1.0, stay_s / budget_s)

    def colocated(self, obs: Observation, load: Load) -> Need:
        """One pool does both: its prefill share and its decode share add up."""
        prefill, decode = self.prefill(obs, load, "decode"), self.decode(obs, load, "decode")
        figures = {f"colocated_{k}": v for k, v in prefill.figures.items()} | decode.figures
        both = None if prefill.load is None or decode.load is None else prefill.load + decode.load
        steady = None if both is None else (prefill.rate_load or 0.0) + (decode.rate_load or 0.0)
        arrivals = None if both is None else (prefill.arrivals_load or 0.0) + (decode.arrivals_load or 0.0)
        return Need(both, max(prefill.pressure, decode.pressure), figures, prefill.urgent or decode.urgent, steady,
                    prefill.helps or decode.pressure > 1, arrivals, decode.held)

    def _step_itl(self, hot: list[WorkerSample]) -> float | None:
        """The token gap of the warmed-up workers' decode steps at the SLO percentile (a step's
        time is the gap of every request it decoded): per worker, so a cold worker's slow first
        steps are left out rather than averaged in."""
        pairs = [(r.wall_s, r.decode_rows) for w in hot for r in w.steps if r.decode_rows]
        return weighted_quantile(pairs, self.cfg.percentile / 100)

    def _stay_gap(self, now: float, hot: list[WorkerSample]) -> float | None:
        """A colocated pool's token gap: its mean over the last stay on decode (its warm workers' decode
        steps' time per token, weighted by their tokens, over the evaluations whose windows end within
        one stay, this one's at least). A colocated worker's prompt chunks ride in its decode steps, so
        one step in a few is several times as long, and a request decoding there sees their mean over
        its stay, as its TPOT does (conversation-4x: step gaps at p90 read 74 ms of a 50 ms SLO on 13
        workers and stepped them to 20). Over a shorter window a bunch of prompts passing through reads
        as every request's gap: conversation's 1.3 s early evaluation in a bunch of 500k tokens read
        176 ms and doubled colocated-4 to 8, where the last stay's mean was ~27 ms. Nor the workers'
        means at the percentile: a bunch placed on one or two workers stretches their gaps alone (116 ms
        at p90 of 14 workers' means doubled them to 28), while a pool short of capacity stretches all."""
        if self._gaps and self._gaps[-1][0] == now:
            self._gaps.pop()  # the same evaluation sized again (for the rate just seen)
        steps = [r for w in hot for r in w.steps]
        self._gaps.append((now, sum(r.wall_s * r.decode_rows for r in steps), sum(r.decode_rows for r in steps)))
        while self._gaps[0][0] < now - self._stay_s:
            self._gaps.popleft()
        rows = sum(n for _, _, n in self._gaps)
        return sum(wall for _, wall, _ in self._gaps) / rows if rows else None


def ceil_workers(load: float, utilization: float) -> int:
    return math.ceil(load / utilization - 1e-9) if load > 0 else 0


def kept_workers(load: float, utilization: float) -> int:
    """The workers a scale-down keeps for `load` (worker-equivalents at full capacity) at `utilization`:
    load / utilization up to SQRT_FROM; beyond it, a headroom that grows as the square root of the load
    (square-root staffing: the arrivals' bunching over a window, what the headroom absorbs, varies as the
    square root of the load), equal to the proportional one at SQRT_FROM. Small pools keep the whole
    band (conversation's bunches need ~1.5x on 2-3 workers); large ones less of it (conversation-4x's
    colocated pool held 14 to 140 s where colocated-12 meets 90%)."""
    if load <= SQRT_FROM:
        return ceil_workers(load, utilization)
    return math.ceil(load + (1 / utilization - 1) * math.sqrt(load * SQRT_FROM) - 1e-9)
