"""This host's serving path, fitted to a real `pdserve bench` run, so that a simulation can stand
for the real CPU cluster (`pdserve simulate --emulate run:DIR[@ARRANGEMENT]`).

The engine's steps fit the cost model (simulate/host.py); this module fits what the real cluster
adds around them, from the same run's records (bench's requests.jsonl and steps.jsonl):

- `door_s`: client -> gRPC door -> router, and the first token back: the client's TTFT less the
  router's (`usage.ttft_ms`), median over requests;
- `rpc_s`: one way, router <-> worker: half the router's TTFT spent outside the worker (the
  placement, the call, its reply; the worker's own share is `prefill_ms`, or queue + compute of a
  colocated first step), median;
- `step_ratio`: each step's time on the host (its wall time, plus the idle gap after the step
  before it while both decoded) over the fitted model's time for its shape, by kind: `decode`
  (decodes only) and `prefill` (a prompt chunk in it). This is the spread the host's contention
  gives a step (two engines, the router and the client share the cores);
- `delivery_s`: how much later than the fastest token of its request each token reached the
  client. A request's tokens after its first come from consecutive decoding steps of its
  worker (a prompt-only step between them decodes nothing); aligning them (the alignment with
  the least spread) gives each token's delay past its step, whatever the offset between the
  client's and the worker's clocks (it cancels);
- `handoff_s`: how much longer a disaggregated request's first decode gap (its token after the KV
  hand-off: `K` in `usage.token_steps`) took than its own median decode gap. The start call, the KV
  over gloo and the decode worker's first step of it each take the host's contention once more, so
  this gap has a tail of its own (up to 300+ ms on a loaded host where a decode gap's p99 is ~90).

The spreads are kept as quantiles; a simulation draws from them by a hash of (seed, worker, step)
or (seed, request, token): no random state, so one seed gives one run.
"""

from __future__ import annotations

import hashlib
import json
import statistics
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sizing.cost_model import CostModel, StepTotals

QUANTILES = 1001  # 0, 0.1, ..., 100 %: fine enough that a draw lands past the p99.9 as often as a step did
CLOCKS_S = 0.05  # the client's and a worker's clocks on one host agree within this (bench stamps both)


@dataclass(frozen=True)
class ServingFit:
    door_s: float
    rpc_s: float
    step_ratio: dict[str, tuple[float, ...]]  # "decode" | "prefill" -> QUANTILES quantiles of host / model
    delivery_s: tuple[float, ...]  # QUANTILES quantiles of a token's delay past its request's fastest
    handoff_s: tuple[float, ...]  # QUANTILES quantiles of a hand-off gap's excess over its request's median gap
    requests: int
    steps: int

    def describe(self) -> str:
        ratio = {k: f"{_at(v, 0.5):.2f}x (p99 {_at(v, 0.99):.2f}x)" for k, v in self.step_ratio.items()}
        return (f"serving path fitted to {self.requests} requests and {self.steps} steps: door {self.door_s * 1e3:.2f} ms, "
                f"call {self.rpc_s * 1e3:.2f} ms each way, step time x model: decode {ratio['decode']}, "
                f"prefill {ratio['prefill']}, token delivery +{_at(self.delivery_s, 0.5) * 1e3:.2f} ms "
                f"(p99 +{_at(self.delivery_s, 0.99) * 1e3:.2f} ms), hand-off gap past its median "
                f"p99 +{(_at(self.handoff_s, 0.99) - _at(self.handoff_s, 0.5)) * 1e3:.2f} ms")

    def step_factor(self, seed: int, worker: str, step: int, prefill: bool) -> float:
        return _draw(self.step_ratio["prefill" if prefill else "decode"], seed, "step", worker, step)

    def delivery(self, seed: int, request_id: str, token: int) -> float:
        return _draw(self.delivery_s, seed, "token", request_id, token)

    def handoff(self, seed: int, request_id: str) -> float:
        """The hand-off's delay past its median for one request (>= 0): the cluster's own calls and
        the link model already give the median hand-off, so only the tail above it is added."""
        return max(0.0, _draw(self.handoff_s, seed, "handoff", request_id) - _at(self.handoff_s, 0.5))

    @property
    def intake_s(self) -> float:
        """Before the router accepts a request: the door less the first token's median delivery
        (which every token, the first included, adds on its way back)."""
        return max(0.0, self.door_s - _at(self.delivery_s, 0.5))


def _at(quantiles: tuple[float, ...], q: float) -> float:
    return quantiles[round(q * (len(quantiles) - 1))]


def _draw(quantiles: tuple[float, ...], *key: object) -> float:
    """The value at a quantile fixed by `key` (uniform over keys), interpolated."""
    digest = hashlib.blake2b("/".join(map(str, key)).encode(), digest_size=8).digest()
    at = int.from_bytes(digest, "big") / 2**64 * (len(quantiles) - 1)
    i = int(at)
    if i + 1 >= len(quantiles):
        return quantiles[-1]
    return quantiles[i] + (quantiles[i + 1] - quantiles[i]) * (at - i)


def fit_serving(run_dir: Path, arrangement: str, cost: CostModel) -> ServingFit:
    """The fit from a bench run's records (its output directory) of one arrangement ("": all);
    `cost`: the host's model fitted to the same run's steps (simulate/host.py)."""
    try:
        requests = [r for r in _rows(run_dir / "requests.jsonl") if arrangement in ("", r.get("arrangement"))
                    and not r.get("error") and r.get("usage") and r.get("message_times_s")]
        steps = [s for s in _rows(run_dir / "steps.jsonl") if arrangement in ("", s.get("arrangement"))
                 and s["decode_rows"] + s["prefill_tokens"]]
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"--emulate run:{run_dir}: {err}") from None
    if len(requests) < 3 or len(steps) < 3:
        raise ValueError(f"--emulate run:{run_dir}@{arrangement}: {len(requests)} requests and {len(steps)} steps; "
                         "a fit needs at least 3 of each")
    workers: dict[str, list[dict]] = defaultdict(list)
    for s in steps:
        workers[s["worker"]].append(s)
    for rows in workers.values():
        rows.sort(key=lambda s: s["t_s"])
    decoding = {w: [k for k, s in enumerate(rows) if s["decode_rows"]] for w, rows in workers.items()}
    delays, back_to_back = [], set()
    for r in requests:
        worker = r["usage"].get("decode_worker")
        steps_of = decoding.get(worker, [])
        found = _align(r, [workers[worker][k]["t_s"] for k in steps_of])
        if found is not None:
            first, d = found
            delays.extend(d)
            back_to_back.update((worker, steps_of[k]) for k in range(first + 1, first + len(d)))
    return ServingFit(
        door_s=statistics.median(r["ttft_ms"] - r["usage"]["ttft_ms"] for r in requests) / 1e3,
        rpc_s=max(0.0, statistics.median(map(_outside_worker_ms, requests)) / 2e3),
        step_ratio=_step_ratios(workers, back_to_back, cost), delivery_s=_quantiles(delays or [0.0]),
        handoff_s=_quantiles(_handoff_excess(requests) or [0.0]),
        requests=len(requests), steps=len(steps))


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _outside_worker_ms(r: dict) -> float:
    """The router's TTFT less the time the request spent queued and in the worker."""
    u = r["usage"]
    worker = u["prefill_ms"] if u.get("prefill_worker") else \
        u["prefill_queue_ms"] + u["prefill_compute_ms"] + u["kv_wait_ms"]
    return u["ttft_ms"] - u["queue_ms"] - worker


def _handoff_excess(requests: list[dict]) -> list[float]:
    """Each disaggregated request's hand-off gap (its `K` token) less its median decode gap."""
    out = []
    for r in requests:
        kinds = r["usage"].get("token_steps", "")
        times = np.repeat(np.asarray(r["message_times_s"], dtype=float), np.asarray(r["message_tokens"], dtype=int))
        gaps = np.diff(times)
        if len(kinds) != len(times) or "K" not in kinds[1:2] or len(gaps) < 3:
            continue
        out.append(float(gaps[0] - np.median(gaps[1:])))
    return out


def _quantiles(values: list[float]) -> tuple[float, ...]:
    return tuple(float(v) for v in np.percentile(np.asarray(values, dtype=float), np.linspace(0, 100, QUANTILES)))


def _step_ratios(workers: dict[str, list[dict]], back_to_back: set[tuple[str, int]],
                 cost: CostModel) -> dict[str, tuple[float, ...]]:
    """host / model per step; a step that ran right after another step of one request's run (it
    had work waiting) counts the idle gap before it too: the engine loop's own time."""
    ratios: dict[str, list[float]] = {"decode": [], "prefill": []}
    for worker, rows in workers.items():
        for k, s in enumerate(rows):
            host = s["wall_s"]
            if (worker, k) in back_to_back:
                host += max(0.0, s["t_s"] - s["wall_s"] - rows[k - 1]["t_s"])
            tokens = s["decode_rows"] + s["prefill_tokens"]
            model = cost.step_s(StepTotals(tokens, s["context_tokens"], s["attended_pairs"]))
            ratios["prefill" if s["prefill_tokens"] else "decode"].append(host / model)
    if not ratios["decode"]:
        raise ValueError("the run's steps hold no decode step: no step spread to fit")
    return {kind: _quantiles(v or ratios["decode"]) for kind, v in ratios.items()}


def _align(r: dict, ends: list[float]) -> tuple[int, list[float]] | None:
    """Among its worker's decoding steps (`ends`), the index of the one that made the request's
    second token (every token after the first comes from consecutive decoding steps there) and
    each of those tokens' delay past the fastest of them: the alignment with the least spread of
    (token time - step end), whose median is within CLOCKS_S and where no token came more than
    CLOCKS_S before its step's end. None when the request has too few tokens or no such steps."""
    times = np.repeat(np.asarray(r["message_times_s"], dtype=float), np.asarray(r["message_tokens"], dtype=int))
    times = times[1:]  # the first token: a prompt's step (on the prefill worker, or one that may decode nothing)
    n = len(times)
    if n < 2 or len(ends) < n:
        return None
    steps = np.asarray(ends)
    lo = max(0, int(np.searchsorted(steps, times[0] - 1.0)))
    hi = min(len(steps) - n, int(np.searchsorted(steps, times[0] + 1.0)))
    best: tuple[float, int, np.ndarray] | None = None
    for j in range(lo, hi + 1):
        d = times - steps[j:j + n]
        if abs(float(np.median(d))) > CLOCKS_S or d.min() < -CLOCKS_S:  # not this request's steps: a token
            continue  # before its step's end, or the worker's record misses some of them
        if best is None or np.ptp(d) < best[0]:
            best = (float(np.ptp(d)), j, d)
    return None if best is None else (best[1], [float(x) for x in best[2] - best[2].min()])
