"""The real host's serving path in a simulation (simulate/serving.py): fitted exactly from known
records, and charged exactly where the real cluster pays it; its spread drawn by the seed."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from bench.workload import RequestSpec, make_workload
from router.config.loader import load_config
from simulate.cli import emulated
from simulate.run import simulate
from simulate.serving import QUANTILES, ServingFit, fit_serving
from sizing.cost_model import StepItem, StepTotals

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def h100():
    base = load_config(str(ROOT / "cluster.yaml"))
    return emulated(base, dataclasses.replace(base.emulate, device="h100", model="llama-3.1-8b"), "test")


def _write_run(path: Path, cost) -> None:
    """Four disaggregated requests of 5 tokens, one after another on decode-0: door 3 ms, 8 ms of
    the router's TTFT outside the worker; each decode step takes 1.5x the model's time, back to
    back; every token reaches the client 1 ms after its step, the third of request 2 6 ms after."""
    steps, requests, t = [], [], 10.0
    for i in range(4):
        times = [t - 0.05]  # the first token: the prefill worker's
        for k in range(4):
            wall = 1.5 * cost.step_s(StepTotals(1, 100 + k, 100 + k))
            t += wall
            steps.append({"arrangement": "d", "worker": "decode-0", "seq": len(steps) + 1, "t_s": t, "wall_s": wall,
                          "decode_rows": 1, "prefill_tokens": 0, "context_tokens": 100 + k, "attended_pairs": 100 + k})
            times.append(t + (0.006 if (i, k) == (2, 2) else 0.001))
        usage = {"ttft_ms": 100.0, "queue_ms": 0.0, "prefill_ms": 92.0, "prefill_worker": "prefill-0",
                 "decode_worker": "decode-0", "prefill_queue_ms": 0.0, "prefill_compute_ms": 92.0, "kv_wait_ms": 0.0}
        requests.append({"arrangement": "d", "request_id": f"r{i}", "error": None, "ttft_ms": 103.0, "usage": usage,
                         "message_times_s": times, "message_tokens": [1] * 5})
        t += 1.0  # idle between requests: that gap is no step's
    (path / "steps.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    (path / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in requests))


def test_the_fit_recovers_a_known_hand_off_gap(h100, tmp_path):
    """Each request's first decode gap (`K`, after the KV hand-off) past its median decode gap:
    every request's first token is 50 ms before its first decode step, 1 ms after it (_write_run): a 51 ms hand-off excess; request 1 91 ms."""
    _, em = h100
    _write_run(tmp_path, em.cost)
    rows = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    for i, r in enumerate(rows):
        r["usage"]["token_steps"] = "FKDDD"
        if i == 1:
            r["message_times_s"][0] -= 0.04  # the first token 40 ms earlier: a 40 ms longer hand-off gap
    (tmp_path / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    fit = fit_serving(tmp_path, "d", em.cost)
    median = fit.handoff_s[QUANTILES // 2]
    assert median == pytest.approx(0.051, abs=1e-6) and fit.handoff_s[-1] - median == pytest.approx(0.04, abs=1e-6)
    assert sorted(fit.handoff(0, f"r{i}") for i in range(50))[-1] > 0  # a draw past the median adds its excess


def test_a_hand_off_spread_delays_the_token_after_the_hand_off_only(h100):
    """A hand-off table whose upper half is 50 ms past its median: each request's token after the
    KV hand-off comes 0 or up to 50 ms later than without it (its draw), every later gap unchanged."""
    cfg, em = h100
    plain = _flat(0.003, 0.004, 1.0)
    spread = dataclasses.replace(plain, handoff_s=tuple(0.0 if q <= QUANTILES // 2 else 0.05 for q in range(QUANTILES)))
    base, late = (_two_requests(cfg, em, fit, seed=1, n=8) for fit in (plain, spread))
    added = []
    for a, b in zip(base, late, strict=True):
        assert b.message_times_s[0] == pytest.approx(a.message_times_s[0], abs=1e-9)
        added.append(round((b.message_times_s[1] - b.message_times_s[0]) - (a.message_times_s[1] - a.message_times_s[0]), 9))
        gaps = [[y - x for x, y in zip(r.message_times_s[1:], r.message_times_s[2:], strict=False)] for r in (a, b)]
        assert gaps[1] == pytest.approx(gaps[0], abs=1e-9)
    assert all(0.0 <= a <= 0.05 for a in added) and 0.0 in added and max(added) > 0.04  # drawn per request


def test_the_fit_recovers_a_known_serving_path(h100, tmp_path):
    _, em = h100
    _write_run(tmp_path, em.cost)
    fit = fit_serving(tmp_path, "d", em.cost)
    assert fit.door_s == pytest.approx(0.003) and fit.rpc_s == pytest.approx(0.004)
    assert fit.requests == 4 and fit.steps == 16
    assert fit.step_ratio["decode"] == pytest.approx((1.5,) * QUANTILES)
    assert fit.delivery_s[0] == pytest.approx(0.0, abs=1e-9) and fit.delivery_s[-1] == pytest.approx(0.005)
    assert fit.delivery_s[QUANTILES // 2] == pytest.approx(0.0, abs=1e-9)  # 1 token of 16 was late
    with pytest.raises(ValueError, match="a fit needs at least 3"):
        fit_serving(tmp_path, "colocated", em.cost)


def _flat(door_s: float, rpc_s: float, ratio: float) -> ServingFit:
    return ServingFit(door_s, rpc_s, {"decode": (ratio,) * QUANTILES, "prefill": (ratio,) * QUANTILES},
                      (0.0,) * QUANTILES, (0.0,) * QUANTILES, 1, 1)


def _two_requests(cfg, em, serving, seed=0, n=2):
    """`n` requests of 200 prompt tokens a second apart on an idle 1P+1D cluster: their records."""
    specs = [RequestSpec(f"r{i}", float(i), tuple(range(1000 + i, 1200 + i)), 5) for i in range(n)]
    disaggregated = dataclasses.replace(cfg, mode="disaggregated")
    return simulate(disaggregated, em, make_workload("two", specs, None, {}), "d", seed=seed, serving=serving).records


def test_the_serving_path_is_charged_where_the_real_cluster_pays_it(h100):
    """An idle cluster: a first token takes the door, a call each way and the prefill step (the
    second request: the first one's prefill waited for its reservation's reply, as a live router's
    does while the pair has no channel yet); each decode step takes the host's factor on the model's time."""
    cfg, em = h100
    first, second = _two_requests(cfg, em, _flat(0.003, 0.004, 2.0))
    prefill = 2.0 * em.cost.step_s((StepItem(200, 200),))
    assert second.message_times_s[0] - second.send_s == pytest.approx(0.003 + 2 * 0.004 + prefill, abs=1e-8)
    assert first.message_times_s[0] - first.send_s == pytest.approx(0.003 + 4 * 0.004 + prefill, abs=1e-8)
    gaps = [b - a for a, b in zip(second.message_times_s, second.message_times_s[1:], strict=False)]
    assert gaps[2:] == pytest.approx([2.0 * em.cost.step_s((StepItem(1, 201 + i),)) for i in range(2, 4)], abs=1e-8)


def test_the_spread_is_drawn_by_the_seed(h100, tmp_path):
    cfg, em = h100
    _write_run(tmp_path, em.cost)
    spread = dataclasses.replace(fit_serving(tmp_path, "d", em.cost),
                                 step_ratio={k: tuple(1.0 + 2 * q / (QUANTILES - 1) for q in range(QUANTILES))
                                             for k in ("decode", "prefill")})
    runs = [_two_requests(cfg, em, spread, seed)[1] for seed in (1, 1, 2)]
    assert runs[0] == runs[1] and runs[0].message_times_s != runs[2].message_times_s
    gaps = [b - a for a, b in zip(runs[0].message_times_s, runs[0].message_times_s[1:], strict=False)]
    plain = [em.cost.step_s((StepItem(1, 201 + i),)) for i in range(4)]
    assert len({round(g / p, 6) for g, p in zip(gaps[1:], plain[1:], strict=True)}) > 1  # not one factor


def test_a_reference_that_lost_workers_is_marked_and_left_out_of_the_printed_error():
    """A real run where Ray's memory monitor killed a worker measures a broken cluster, not the
    simulator's error: compare() marks it and `pdserve simulate`'s error line leaves it out."""
    from simulate.cli import format_error
    from simulate.fidelity import compare

    def figures(ms):
        return {m: {"p50": ms, "p99": 2 * ms} for m in ("ttft_ms", "itl_ms")} | {"num_errors": 0}
    oom = ("decode-0: Refer to the documentation on how to address the out of memory issue: https://docs.ray.io/"
           "en/latest/ray-observability/user-guides/debug-apps/debug-memory.html")
    real = {"arrangements": {"disaggregated": figures(100.0), "colocated": figures(100.0) | {"num_errors": 9}},
            "cluster": {"status": {"colocated": {"pools": [{"pool": "decode", "restarts": "2", "last_failure": oom}]},
                                   "disaggregated": {"pools": [{"pool": "decode", "restarts": "0", "last_failure": ""}]}}}}
    sim = {"arrangements": {"disaggregated": figures(110.0), "colocated": figures(300.0)}}
    rows = compare(real, sim)
    assert "reference_disturbed" not in rows["disaggregated"]
    assert rows["colocated"]["reference_disturbed"] == ("2 worker restart(s), 9 request(s) failed; decode-0: killed by "
                                                        "Ray's memory monitor (the host ran out of memory)")
    lines = format_error({"measured": "now", "vs_real": {"served": rows}})
    assert lines[1] == ("  vs the real CPU cluster, steps and serving path fitted (worst arrangement): "
                        "ttft_p50 +10%, ttft_p99 +10%, itl_p50 +10%, itl_p99 +10%")
    assert lines[2].startswith("  vs the real CPU cluster, steps and serving path fitted, colocated: left out, "
                               "the reference run was disturbed (2 worker restart(s)")
