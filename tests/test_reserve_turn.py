"""router.decode_reservation: before_prefill, pick-then-reserve (router/lifecycle/reserve_turn.py):
the decode reservation is sent in the queue's turn and awaited outside it.

Checked in the simulator (the real router, decode worker and hand-off code over a simulated
engine): a burst's reservations are sent in arrival order and several are in flight at once (the
queue did not wait for each answer); reservations refused (before and after the pair's prefill
started early) place the request again, and at the end every request has its tokens, no worker
holds a block and no reservation is left on any decode worker.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from bench.workload import RequestSpec, make_workload
from decode_worker.worker import DecodeWorker
from router.config.loader import load_config
from router.lifecycle import reserve_turn
from simulate.cli import emulated
from simulate.run import simulate

ROOT = Path(__file__).resolve().parent.parent
N = 6


@pytest.fixture(scope="module")
def h100_1p2d():
    base = load_config(str(ROOT / "cluster.yaml"))
    cfg, em = emulated(base, dataclasses.replace(base.emulate, device="h100", model="llama-3.1-8b"), "test")
    cfg = dataclasses.replace(cfg, mode="disaggregated", prefill=dataclasses.replace(cfg.prefill, replicas=1),
                              decode=dataclasses.replace(cfg.decode, replicas=2),
                              router=dataclasses.replace(cfg.router, decode_reservation="before_prefill"))
    return cfg, em


def _burst(first_token: int = 1000):
    """N requests 0.1 ms apart (less than a reservation's round trip), request i's prompt starting with token first_token + i."""
    specs = [RequestSpec(f"r{i}", 1e-4 * i, tuple(range(first_token + i, first_token + i + 100)), 4) for i in range(N)]
    return make_workload("burst", specs, None, {})


def _watch_reserve(monkeypatch, refuse: set[int] = frozenset(), first_token: int = 1000) -> dict:
    """DecodeWorker.reserve wrapped: the order reservations arrive in (request index, from the
    prompt's first token), a first reservation of each request in `refuse` answered "no room";
    and the router's awaits of their answers: the most awaited at once."""
    seen = {"order": [], "refused": [], "awaited": 0, "most": 0}
    reserve, call = DecodeWorker.reserve, reserve_turn.call

    async def watched(self, r):
        i = r.token_ids[0] - first_token
        seen["order"].append(i)
        if i in refuse and i not in seen["refused"]:
            seen["refused"].append(i)
            return None
        return await reserve(self, r)

    async def awaited(w, ref, timeout_s, what):
        if what != "reserve":
            return await call(w, ref, timeout_s, what)
        seen["awaited"] += 1
        seen["most"] = max(seen["most"], seen["awaited"])
        try:
            return await call(w, ref, timeout_s, what)
        finally:
            seen["awaited"] -= 1
    monkeypatch.setattr(DecodeWorker, "reserve", watched)
    monkeypatch.setattr(reserve_turn, "call", awaited)
    return seen


def _all_clean(run) -> None:
    assert all(r.ok and r.output_tokens == 4 for r in run.records), [(r.request_id, r.error) for r in run.records]
    assert all(c["used"] == 0 and c["free"] == c["total"] for c in run.checks.values()), run.checks


def test_reservations_are_sent_in_arrival_order_and_overlap(h100_1p2d, monkeypatch):
    cfg, em = h100_1p2d
    seen = _watch_reserve(monkeypatch)
    run = simulate(cfg, em, _burst(), "pipelined", rpc_s=0.001)
    _all_clean(run)
    assert seen["order"] == list(range(N))  # picked in the queue's order, one reservation each
    assert seen["most"] > 1  # the router awaited answers of several at once: the queue moved on


def test_a_refused_reservation_places_the_request_again_and_leaks_nothing(h100_1p2d, monkeypatch):
    cfg, em = h100_1p2d
    seen = _watch_reserve(monkeypatch, refuse={0, 4})
    run = simulate(cfg, em, _burst(), "refused", rpc_s=0.001)
    _all_clean(run)
    assert seen["refused"] == [0, 4] and sorted(seen["order"]) == sorted([*range(N), 0, 4])
    assert seen["order"].index(0) < seen["order"].index(1)  # its first try in turn; its second after
    assert [r.usage["migrations"] for r in run.records] == [0] * N  # placed again, not failed over
