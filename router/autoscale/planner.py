"""The SLO planner: `decide(observation) -> Decision`, pure (no I/O, no clock but the
observation's), used unchanged by the live router and by `pdserve simulate`.

Per interval: learn the profile from the warmed-up workers' steps (router/autoscale/profile.py),
forecast the next interval (router/autoscale/forecast.py), size each pool on its own signal
(router/autoscale/sizing.py), then apply the rules below, per pool, with `n` the warmed-up ready
workers (capacity) and `t` the pool's current target:

- up: to ceil(rate's load / target_utilization + backlog's load) (`Need.workers`: an absolute size for the forecast and the backlog: no
  cooldown) once the load passes t x target_utilization x (1 + band / 2), at once when the load
  already hurts (`Need.urgent`, router/autoscale/sizing.py: a backlog that will miss the TTFT SLO
  while arrivals outrun the warm workers, waits near a miss, KV waits; then for the rate just
  seen, at the Poisson lower bound of the window's count, where the smoothed forecast lags it), else
  only once it has asked for more for a whole interval (a later evaluation confirms it: a Poisson surge
  of a few seconds is not a trend); or to n + step when its SLO is missed now, where step grows with the
  miss (+1 .. doubling; a first-token miss: what its backlog needs); a miss adds nothing while workers are
  still starting or warming (capacity on its way: counting them twice over-scales, Dynamo #12430), nor
  within `scale_up_cooldown_s` of the pool's last change (the last step's effect has not shown yet), nor
  when workers started now would not shorten the waits (`Need.helps`: prefill whose warm workers clear
  the backlog before a new one is ready, the miss a long prompt's own prefill);
- down: only with the SLO met, to the fewest workers that carry the last `scale_down_cooldown_s`'s
  work (its mean load, weighted by each evaluation's window, backlogs included: a short backlog is
  worker-seconds over the window, not a level) and what the pool holds now (decode: running and KV
  held), both at <= (1 - band) x target_utilization (`kept_workers`: a square-root headroom above
  `SQRT_FROM` workers' load), and that none of the window's arrival rates (the forecast's once it has
  seen an interval, no backlog, nothing held) would scale up from (each within target_utilization): so
  steady load settles instead of flapping 2 <-> 1; not within `scale_down_cooldown_s` of the pool's last change or of the first
  evaluation, unless that change grew it for a backlog now cleared (beyond what its rate asks, or
  an SLO step while a backlog is left when a new worker would be ready): then at once to what the survivors carry without the
  backlog (its rate's mean load in place of the window's work) (`cleared`), once; for a backlog
  back within the cooldown of such a release (recurring: load), only down to what the survivors
  carry;
- a pool whose last scale is still in flight (workers starting, a drain) is held as it is;
- otherwise hold. Then min/max per pool and the budget (both pools' total), never below a needed
  pool's min (>= 1): with no traffic every load is 0 and each pool goes to its min. When the budget
  cuts, a KV-bound decode pool (KV waits, or KV use within the band of `kv_high`) is served first:
  prefill beyond what decode can admit only queues behind it; otherwise the room is shared in
  proportion, and a pool changed within `scale_down_cooldown_s` keeps its size (a worker is not
  traded between the pools back and forth, each trade a drain and a start-up).
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

from router.autoscale.forecast import Holt
from router.autoscale.observation import Decision, Observation, PoolDecision
from router.autoscale.profile import CapacityProfile
from router.autoscale.sizing import Load, Need, Sizer, ceil_workers, kept_workers, warm
from router.config.autoscale import AutoscaleSection

CONFIRM = 1.0  # intervals a load over the target must last before a scale-up that is not urgent
SEEN_Z = 1.0  # a window's arrival count, less this many standard deviations (Poisson: its square root), is its rate seen
RATE_AFTER = 1.0  # intervals of windows the forecast must have seen before its arrival rate is a peak a scale-down fits
LENGTH_GAIN = 0.3  # EWMA weight of a window's mean prompt / output length and of its prefix-cache hit share
# of all arrivals so far, the share that must have finished before the finished requests' output lengths are a
# sample of them: before, they are the short ones, first to finish (the lengths asked stand in for them)
FINISHED_SAMPLE = 0.5


class Sample(NamedTuple):
    """One evaluation's loads, as a scale-down remembers them (worker-equivalents at full capacity)."""

    at: float
    window_s: float  # the evaluation's window: its weight in the mean
    load: float  # backlogs included
    rate: float  # the forecast rate's alone (decode: what it held included)
    arrivals: float  # the forecast's arrivals alone


@dataclass(frozen=True)
class Window:
    """The loads of the last scale_down_cooldown_s (worker-equivalents at full capacity)."""

    mean: float  # weighted by each evaluation's window: the work done in it, backlogs included
    arrivals_peak: float  # the highest of the forecast's arrival rates alone
    rate_mean: float  # the rate's load (no backlog; decode: what it held included), weighted as `mean`


class Planner:
    def __init__(self, cfg: AutoscaleSection, mode: str, profile: CapacityProfile):
        self.cfg = cfg
        self.mode = mode
        self.pools = ("decode",) if mode == "colocated" else ("prefill", "decode")
        self.profile = profile
        self.sizer = Sizer(cfg, profile)
        self._rates = {"requests": Holt(), "prompt_tokens": Holt()}
        self._lengths = {"prompt": 0.0, "output": 0.0}
        self._hit_share = 0.0  # of arriving prompt tokens, the share prefill finds cached (not computed)
        self._history: dict[str, deque[Sample]] = {p: deque() for p in self.pools}  # what a scale-down plans for
        self._changed_at = {p: -math.inf for p in self.pools}
        self._over_since: dict[str, float | None] = dict.fromkeys(self.pools)  # since when its load asks for more
        self._for_backlog = dict.fromkeys(self.pools, False)  # its last change grew it for a backlog
        self._released_at = dict.fromkeys(self.pools, -math.inf)  # its last release of a backlog's workers
        self._recurred = dict.fromkeys(self.pools, False)  # that growth came within scale_down_cooldown_s of a release
        self._target: dict[str, int] = {}  # each pool's target at this evaluation
        self._started_at: float | None = None  # the first evaluation: no scale-down within a cooldown of it
        self._forecast_s = 0.0  # the windows the forecast has seen, seconds
        self._arrived = self._finished = 0  # requests so far: output lengths are a sample once half have finished

    def bounds(self, pool: str) -> tuple[int, int]:
        c = self.cfg
        return (c.prefill_min, c.prefill_max) if pool == "prefill" else (c.decode_min, c.decode_max)

    def decide(self, obs: Observation) -> Decision:
        if self._started_at is None:
            self._started_at = obs.now
        self._target = {p: obs.pools[p].target for p in self.pools}
        for pool in self.pools:
            self.profile.learn(pool, [r for w in warm(obs.pools[pool].workers, self.cfg.warmup_s) for r in w.steps])
        load = self._forecast(obs)
        needs = self._needs(obs, load)
        # what a scale-down plans for: the forecast's rate (no backlog) and its arrivals alone
        steady = {p: (n.rate_load, n.arrivals_load) for p, n in needs.items()}
        seen, arriving = self._seen(obs, load), load  # `arriving`: the load prefill is sized for
        if seen is not None and any(n.urgent for n in needs.values()):
            # a pool the load already hurts sizes for the rate just seen where the smoothed
            # forecast still lags it (the first seconds of a burst), as a panic window does
            now = self._needs(obs, seen)
            needs = {p: now[p] if n.urgent and (now[p].load or 0.0) > (n.load or 0.0) else n for p, n in needs.items()}
            arriving = seen if "prefill" in needs and needs["prefill"] is now["prefill"] else load
        sized = {p: self._size(p, obs, needs[p], steady[p]) for p in self.pools if p == "prefill"}
        if "prefill" in needs and needs["prefill"].urgent and needs["prefill"].figures.get("prefill_excess_tokens"):
            needs["decode"] = self._admitting(needs, sized["prefill"][0], arriving, obs, load.requests_per_s)
        sized["decode"] = self._size("decode", obs, needs["decode"], steady["decode"])
        desired, budget_note = self._within_budget({p: d for p, (d, _, _) in sized.items()}, obs,
                                                   self._kv_need(obs, needs))
        decisions = {}
        for p in self.pools:
            po, (wanted, why, cause) = obs.pools[p], sized[p]
            if desired[p] < wanted:
                why, cause = why + budget_note, "budget"
            decisions[p] = PoolDecision(p, desired[p], len(warm(po.workers, self.cfg.warmup_s)), po.target, why,
                                        cause)
            if desired[p] != po.target:
                self._changed_at[p] = obs.now
        inputs = self._inputs(obs, load, needs)
        changed = any(d.desired != d.target for d in decisions.values())
        return Decision(obs.now, decisions, "; ".join(f"{p}: {d.reason}" for p, d in decisions.items()), changed,
                        inputs)

    # ---- forecast ------------------------------------------------------------------------
    def _forecast(self, obs: Observation) -> Load:
        # the output lengths of the requests that finished, once they are a sample; until half of those
        # that arrived have finished, the ones that did are the short ones, and the lengths asked
        # (max_tokens, an upper bound) stand in: conversation-4x's first evaluation, 3 s in, read a
        # 0.4 s stay on decode (short requests done) where its requests stay ~9.5 s, and sized a
        # colocated pool 4 -> 9 where 12 carry it (its first 17 s of arrivals met 67-79%)
        self._arrived, self._finished = self._arrived + obs.arrivals, self._finished + obs.finished
        early = self._finished < FINISHED_SAMPLE * self._arrived
        output = obs.asked if early and obs.asked.count else obs.output
        window = max(obs.window_s, 1e-9)
        weight = min(1.0, window / self.cfg.interval_s)  # an early evaluation's short window counts for its length
        # an early evaluation's few arrivals / finished move the lengths by its window's share of an interval (as the
        # rates): conversation-4x's 1.1 s of 8 long prompts took the prompt 15k -> 22k, a colocated pool 12 -> 16
        gains = dict.fromkeys(("prompt", "output"), 1 - (1 - LENGTH_GAIN) ** weight)
        for key, lengths in (("prompt", obs.prompt), ("output", output)):
            if lengths.count:
                old = self._lengths[key]
                self._lengths[key] = lengths.mean if not old else old + gains[key] * (lengths.mean - old)
        if obs.prefix_hit_share is not None:
            self._hit_share += LENGTH_GAIN * (min(1.0, max(0.0, obs.prefix_hit_share)) - self._hit_share)
        self._forecast_s += window
        requests = self._rates["requests"].update(obs.arrivals / window, weight)
        tokens = self._rates["prompt_tokens"].update(obs.arrivals * obs.prompt.mean / window, weight)
        return Load(requests, tokens * (1 - self._hit_share), max(1.0, self._lengths["prompt"]),
                    max(1.0, self._lengths["output"]), obs.arrivals * obs.prompt.mean / window * (1 - self._hit_share))

    def _needs(self, obs: Observation, load: Load) -> dict[str, Need]:
        if self.mode == "colocated":
            return {"decode": self.sizer.colocated(obs, load)}
        return {"prefill": self.sizer.prefill(obs, load), "decode": self.sizer.decode(obs, load)}

    def _admitting(self, needs: dict[str, Need], prefill_workers: int, load: Load, obs: Observation,
                   forecast_rps: float) -> Need:
        """Decode's need while prefill clears a backlog: to admit what `prefill_workers` send at full speed
        (requests/s x a stay on decode), or its KV stalls prefill; but no more requests than there are
        within a stay: those without a first token beyond what the forecast rate keeps waiting anyway
        (its rate x the TTFT budget; conversation's bunches of 12-22 took decode 2 -> 3 where 2 carried
        them), and the larger of those held and a stay's arrivals (the held leave as they come)."""
        pf, need = needs["prefill"].figures, needs["decode"]
        slots, stay = need.figures.get("decode_slots_per_worker"), need.figures.get("decode_stay_s")
        if need.load is None or not slots or stay is None:
            return need
        sent = prefill_workers * pf.get("prefill_tokens_per_s_per_worker", 0.0) / load.prompt_len
        budget_s = max(self.cfg.ttft_s - pf.get("prefill_own_s", 0.0), 0.25 * self.cfg.ttft_s)
        waiting = max(0.0, obs.waiting_first - forecast_rps * budget_s)
        there = waiting + max(need.figures.get("decode_held", 0.0), load.requests_per_s * stay)
        admitting = min(sent * stay, there) / slots
        figures = need.figures | {"decode_admitting_load": admitting}
        return dataclasses.replace(need, load=max(need.load, admitting), figures=figures, urgent=True)

    def _seen(self, obs: Observation, load: Load) -> Load | None:
        """The window's own arrival rates where they are above the forecast's (else None), at the
        lower bound of its count (SEEN_Z standard deviations below it): in an early evaluation's
        second or two a dozen coinciding arrivals are partly a bunch, while a burst's dozens or
        hundreds read as a rate within 10-15%. Arrivals sent together (a trace's batch) are one
        event of a compound Poisson process, whose count's variance is the sum of the squared batch
        sizes: a window holding one batch of 12 reads as no rate at all (the conversation trace
        sends its requests in batches every 3 s), 46 arrivals one by one as 39."""
        window = max(obs.window_s, 1e-9)
        deviation = math.sqrt(max(obs.arrivals, obs.arrival_bunch_sq))
        requests = max(0.0, obs.arrivals - SEEN_Z * deviation) / window
        tokens = requests * obs.prompt.mean * (1 - self._hit_share)
        if requests <= load.requests_per_s and tokens <= load.prompt_tokens_per_s:
            return None
        return dataclasses.replace(load, requests_per_s=max(requests, load.requests_per_s),
                                   prompt_tokens_per_s=max(tokens, load.prompt_tokens_per_s))

    # ---- one pool ------------------------------------------------------------------------
    def _size(self, pool: str, obs: Observation, need: Need, steady: tuple[float | None, float | None]) \
            -> tuple[int, str, str]:
        """(desired size before the budget, why, cause). `steady`: the forecast's load without a
        backlog, and of it the arrivals' alone (decode: without what it holds), what a scale-down plans for."""
        c, po = self.cfg, obs.pools[pool]
        lo, hi = self.bounds(pool)
        t, n = po.target, len(warm(po.workers, c.warmup_s))
        pending = po.starting + len(po.workers) - n
        window = self._window(pool, obs, need.load, steady)
        exact = need.workers(c.target_utilization)
        up = math.ceil(exact - 1e-9) if need.load is not None and exact > 0 else 0
        if up > t and exact <= t * (1 + c.band / 2):
            up = t  # hysteresis up as well as down: a forecast within half the band above the target holds
        self._over_since[pool] = (self._over_since[pool] if self._over_since[pool] is not None else obs.now) \
            if up > t else None
        unconfirmed = up > t and not need.urgent and obs.now - self._over_since[pool] < CONFIRM * c.interval_s
        if unconfirmed:
            up = t  # the first interval over, with the waits well inside the SLO: wait for the next to confirm
        missed = need.pressure > 1 and not pending and need.helps
        step = max(1, math.ceil(n * min(1.0, need.pressure - 1)))
        if need.load is not None and (pool == "prefill" or need.figures.get("colocated_first_token_wait_s", 0.0)
                                      >= need.pressure * c.ttft_s):
            # a first-token miss is its backlog's: a step adds what is left of it needs, not a doubling (4x: 10 -> 20)
            step = min(step, max(1, math.ceil(need.backlog_load - 1e-9)))
        slo = n + step if missed else 0
        since = obs.now - self._changed_at[pool]
        cooling = since < c.scale_up_cooldown_s
        wanted = max(up, 0 if cooling else slo)
        size, why, cause = t, self._describe(need, up, n, pending, po.failed_starts), "steady"
        if po.scaling:
            return t, why + "; a scale of this pool is in flight: held", "pending"
        if wanted > t:
            size, cause = wanted, "slo" if wanted > up else "forecast"
            why += "; up: " + ("its SLO is missed now" if cause == "slo" else "forecast + backlog")
            # grown for a backlog: beyond what its arrivals alone ask (decode: what it holds above
            # them, a bunch of long requests' KV, leaves with their stay), or a step for a miss a
            # backlog makes, or on a forecast not yet a rate (`_is_rate`); one back within
            # scale_down_cooldown_s of a release recurs (released to the window's work)
            self._for_backlog[pool] = (up > ceil_workers(need.arrivals_load or 0.0, c.target_utilization)
                                       if cause == "forecast" else need.backlog_load > 0) or not self._is_rate()
            self._recurred[pool] = obs.now - self._released_at[pool] < c.scale_down_cooldown_s
        elif slo > t:
            why, cause = why + f"; up held: {since:.0f} s since its last change (scale_up_cooldown_s)", "cooldown"
        elif unconfirmed:
            why, cause = why + "; up held: one interval over, waits within the SLO (confirming)", "confirming"
        elif need.pressure > 1 and pending:
            why, cause = why + f"; SLO missed, {pending} worker(s) starting or warming up: waiting for them", "pending"
        elif need.pressure > 1 and not need.helps:
            why += "; SLO missed, but the warm workers clear the backlog before a new one would be ready, or it is " \
                "placed on them already: held"
        elif window is not None and need.pressure <= 1:
            size, why, cause = self._down(pool, obs.now, need, window, why)
        if not lo <= size <= hi:
            why, cause = why + f"; held to [{lo}, {hi}] ({pool}_min, {pool}_max)", "bounds"
        return min(hi, max(lo, size)), why, cause

    def _down(self, pool: str, now: float, need: Need, window: Window, why: str) -> tuple[int, str, str]:
        """A scale-down to what the survivors carry, not within scale_down_cooldown_s of the pool's
        last change or of the start; unless that change grew it for a backlog, now cleared (within
        the band of its rate's load): the workers bought to clear it are a surplus the cooldown would
        hold idle, released down to what the survivors carry without it (its rate's mean load, what
        it holds, and the window's arrival peak within the target: the backlog is gone, and a peak of
        the rate planned at (1 - band) held the conversation trace's opening 5 prefill for 120 s on
        one 5 s window's 5.2 requests/s); or, for a backlog back within the cooldown of such a
        release (backlogs that recur are load), to what the survivors carry (the window's work
        counts them)."""
        c, t = self.cfg, self._target[pool]
        quiet = now - max(self._changed_at[pool], self._started_at)
        cleared = self._for_backlog[pool] and need.backlog_load <= c.band * (need.rate_load or 0.0)
        if quiet < c.scale_down_cooldown_s and cleared:
            recurred = self._recurred[pool]
            down = self._survivors(window, need) if recurred else \
                self._survivors(dataclasses.replace(window, mean=window.rate_mean), need)
            if down < t:
                self._for_backlog[pool], self._released_at[pool] = False, now
                carry = f"the window's work {window.mean:.2f} (a recurring backlog)" if recurred else \
                    f"its rate's mean load {window.rate_mean:.2f}"
                return down, why + f"; down: the backlog it grew for is cleared, the survivors carry {carry} at " \
                    f"<= {1 - c.band:.0%} of target, its arrivals' peak {window.arrivals_peak:.2f} within it", "cleared"
        down = self._survivors(window, need)
        if down >= t:
            return t, why, "steady"
        if quiet < c.scale_down_cooldown_s:
            return t, why + f"; down held: {quiet:.0f} s since its last change or the start (scale_down_cooldown_s)", \
                "cooldown"
        self._for_backlog[pool] = False
        return down, why + f"; down: the survivors carry the window's work {window.mean:.2f} and what they hold " \
            f"now {need.held:.2f} at <= {1 - c.band:.0%} of target, its arrivals' peak {window.arrivals_peak:.2f} " \
            "within it", "survivors"

    def _survivors(self, window: Window, need: Need) -> int:
        """The fewest workers that carry the last scale_down_cooldown_s's work (its mean load,
        backlogs included: a backlog is worker-seconds, not a level to hold) and what the pool holds
        now at <= (1 - band) of the target utilization, and that none of the window's arrival
        rates would have scaled up from (each within the target utilization): steady load settles."""
        u, band = self.cfg.target_utilization, self.cfg.band
        return max(kept_workers(window.mean, u * (1 - band)), kept_workers(need.held, u * (1 - band)),
                   ceil_workers(window.arrivals_peak, u))

    def _window(self, pool: str, obs: Observation, load: float | None,
                steady: tuple[float | None, float | None]) -> Window | None:
        """The last scale_down_cooldown_s's loads, this evaluation's included (None: none known)."""
        history = self._history[pool]
        if load is not None:
            rate = steady[0] if steady[0] is not None else load
            arrivals = steady[1] if steady[1] is not None else rate
            if not self._is_rate():
                arrivals = 0.0  # the forecast is still one early window's count at face value: no peak
            history.append(Sample(obs.now, max(obs.window_s, 1e-9), load, rate, arrivals))
        while history and history[0].at < obs.now - self.cfg.scale_down_cooldown_s:
            history.popleft()
        if not history:
            return None
        span = sum(h.window_s for h in history)
        return Window(sum(h.window_s * h.load for h in history) / span, max(h.arrivals for h in history),
                      sum(h.window_s * h.rate for h in history) / span)

    def _is_rate(self) -> bool:
        """Whether the forecast has seen an interval of windows: before, its level is the first window's
        count at face value (not a peak a scale-down fits; a pool grown on it goes as a backlog's does)."""
        return self._forecast_s >= RATE_AFTER * self.cfg.interval_s

    @staticmethod
    def _describe(need: Need, up: int, n: int, pending: int, failed: int) -> str:
        load = "no profile yet" if need.load is None else f"load {need.load:.2f} workers -> {up}"
        text = f"{load}, SLO ratio {need.pressure:.2f}, {n} warm"
        text += f", {pending} starting/warming" if pending else ""
        return text + (f", {failed} failed start(s) in a row" if failed else "")

    # ---- both pools ----------------------------------------------------------------------
    def _within_budget(self, wanted: dict[str, int], obs: Observation, kv_need: int) -> tuple[dict[str, int], str]:
        """Each pool its min, and a KV-bound decode pool its KV need (`kv_need` workers: prefill beyond
        what decode can admit only queues behind it); a pool changed within scale_down_cooldown_s
        keeps its size (the KV-bound decode pool's need aside); the rest of the budget is shared in
        proportion to what each wants above that (largest remainders first; decode first on a tie)."""
        budget = self.cfg.budget_workers
        if budget is None or sum(wanted.values()) <= budget:
            return wanted, ""
        note = f"; cut to the budget of {budget} workers (max_workers / max_cost_per_hour)"
        floor = {p: self.bounds(p)[0] for p in wanted}
        if kv_need and "prefill" in wanted:
            floor["decode"] = max(floor["decode"], min(wanted["decode"], kv_need, budget - floor["prefill"]))
            note += f", decode's KV need ({kv_need}) first"
        kept = self._kept(wanted, obs, floor)
        if kv_need and "prefill" in kept:  # decode's KV need may take from prefill
            kept["prefill"] = max(floor["prefill"], min(kept["prefill"], budget - kept["decode"]))
        if sum(kept.values()) <= budget:
            floor = kept
        extra = {p: wanted[p] - floor[p] for p in wanted}
        room, total = budget - sum(floor.values()), sum(extra.values())
        shares = {p: room * extra[p] / total if total else 0.0 for p in wanted}
        out = {p: floor[p] + int(shares[p]) for p in wanted}
        order = sorted(wanted, key=lambda p: (-(shares[p] - int(shares[p])), p != "decode"))
        for p in order[:budget - sum(out.values())]:
            out[p] += 1
        return out, note

    def _kept(self, wanted: dict[str, int], obs: Observation, floor: dict[str, int]) -> dict[str, int]:
        """A pool changed within scale_down_cooldown_s keeps what it has (up to what it wants)."""
        return {p: max(floor[p], min(wanted[p], obs.pools[p].target))
                if obs.now - self._changed_at[p] < self.cfg.scale_down_cooldown_s else floor[p] for p in wanted}

    def _kv_need(self, obs: Observation, needs: dict[str, Need]) -> int:
        """Decode workers its KV needs now when KV is what limits the cluster (requests wait for KV
        room, or its KV use is within the band of kv_high); else 0."""
        need = needs["decode"]
        if not (obs.kv_waiting > 0 or need.figures.get("kv_use", 0.0) >= self.cfg.kv_high * (1 - self.cfg.band)):
            return 0
        return max(1, ceil_workers(need.figures.get("decode_kv_load", 0.0), self.cfg.target_utilization))

    def _inputs(self, obs: Observation, load: Load, needs: dict[str, Need]) -> dict[str, float]:
        inputs = {"arrivals_per_s": obs.arrivals / max(obs.window_s, 1e-9),
                  "arrival_bunch_sq": float(obs.arrival_bunch_sq), "forecast_requests_per_s": load.requests_per_s,
                  "prompt_len": load.prompt_len, "output_len": load.output_len,
                  "queued": float(obs.queued), "waiting_first": float(obs.waiting_first), "wait_q_s": obs.wait_q_s,
                  "kv_waiting": float(obs.kv_waiting), "prefix_hit_share": self._hit_share}
        if obs.ttft_q_s is not None:
            inputs["ttft_q_s"] = obs.ttft_q_s
        if obs.itl_q_s is not None:
            inputs["itl_q_s"] = obs.itl_q_s
        for pool, need in needs.items():
            inputs |= need.figures
            inputs[f"{pool}_load"] = need.load if need.load is not None else -1.0
            inputs[f"{pool}_correction"] = self.profile.correction[pool]
        return inputs
