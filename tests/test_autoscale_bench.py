"""What a simulated cluster cost (bench/accounting.py), the autoscaling comparison's verdict and
schema (bench/autoscale_compare.py, simulate/autoscale.py), and the presets it replays (bench/swings.py).

Reference checks: a pool manager scaled at chosen virtual times gives exactly the worker-seconds
those times imply; a static cluster's mean workers are its size and its worker-hours its size x
the run; the verdict picks the arrangement with the fewest worker-hours among those meeting the
attainment target; the bursty preset's arrivals follow its square wave.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.accounting import Life, RecordingActors, WorkerLedger, figures, usage
from bench.autoscale_compare import verdict
from bench.errors import BenchError
from bench.metrics import Slo
from bench.presets import WorkloadOptions, build_workload
from protocol import clock
from router.config.loader import load_config
from router.pools.manager import PoolManager
from simulate.actors import SimActors
from simulate.autoscale import static_configs
from simulate.cli import emulated
from simulate.run import run_virtual, simulate

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def h100():
    base = load_config(str(ROOT / "simulate" / "gpu_cluster.yaml"))
    return emulated(base, dataclasses.replace(base.emulate, device="h100", model="llama-3.1-8b"), "test")


def _sized(cfg, prefill: int, decode: int):
    return dataclasses.replace(cfg, mode="disaggregated", prefill=dataclasses.replace(cfg.prefill, replicas=prefill),
                               decode=dataclasses.replace(cfg.decode, replicas=decode))


def test_the_ledger_integrates_each_life_over_the_window():
    ledger = WorkerLedger()
    ledger.started("prefill-0", "prefill", 0.0)
    ledger.started("decode-1", "decode", 5.0)
    ledger.started("decode-2", "decode", 20.0)
    ledger.stopped("decode-2", 30.0)
    ledger.stopped("decode-2", 35.0)  # a second kill changes nothing
    used = usage(ledger, 10.0, 40.0)  # the window clips prefill-0 and decode-1 to 30 s each
    assert used["worker_hours"] == pytest.approx((30 + 30 + 10) / 3600)
    assert used["mean_workers"] == pytest.approx(70 / 30)
    assert used["peak_workers"] == 3
    assert used["pools"]["decode"] == {"mean_workers": pytest.approx(40 / 30), "peak_workers": 2,
                                       "worker_hours": pytest.approx(40 / 3600)}
    assert ledger.changes(10.0, 40.0, "decode") == [(10.0, 1), (20.0, 2), (30.0, 1)]
    assert Life("x", "decode", 50.0).within(10.0, 40.0) == 0.0


def test_a_pool_scaled_at_chosen_times_costs_exactly_those_worker_seconds(h100):
    """The real pool manager on simulated workers: decode grows 1 -> 3 at t=10 and drains to 1 at
    t=40; the ledger reads the lives those calls imply, to the nanosecond."""
    cfg, em = h100
    cfg = _sized(cfg, 1, 1)
    actors = RecordingActors(SimActors(em, em.cost.shape, cfg.kv_cache.block_size, rpc_s=0.0))

    async def scenario() -> None:
        pools = PoolManager(cfg, actors)
        await pools.start()
        await asyncio.sleep(10.0 - clock.now())
        await pools.scale("decode", 3)
        await asyncio.sleep(40.0 - clock.now())
        assert await pools.scale("decode", 1) == ([], ["decode-3", "decode-2"])  # the newest idle ones go
        await asyncio.sleep(60.0 - clock.now())

    run_virtual(scenario)
    used = usage(actors.ledger, 0.0, 60.0)
    assert used["pools"]["prefill"]["worker_hours"] == pytest.approx(60 / 3600)
    assert used["pools"]["decode"]["worker_hours"] == pytest.approx((60 + 2 * 30) / 3600)
    assert used["peak_workers"] == 4 and used["mean_workers"] == pytest.approx(3.0)
    assert actors.ledger.batches_after(0.0) == 1


def test_a_static_run_costs_its_size_for_the_whole_run(h100):
    cfg, em = h100
    workload = build_workload(WorkloadOptions(preset="steady", num_requests=30, rate=20.0, input_len=512,
                                              output_len=16, max_context=8192, vocab=(1000, 32000), seed=1))
    run = simulate(_sized(cfg, 2, 2), em, workload, "2P2D", seed=1, check=False)
    row = figures(run.records, Slo(ttft_s=2.0), run.ledger, run.t0, run.end, run.decisions, 2.99)
    assert run.decisions is None and run.t0 > 0  # no planner; the workers loaded before the first arrival
    assert row["failed"] == 0 and row["requests"] == 30 and row["scaling_actions"] == 0
    assert row["mean_workers"] == pytest.approx(4.0) and row["peak_workers"] == 4
    assert row["worker_hours"] == pytest.approx(4 * run.simulated_s / 3600)
    assert row["usd"] == pytest.approx(row["worker_hours"] * 2.99)
    assert row["usd_per_million_good_tokens"] == pytest.approx(row["usd"] / row["good_output_tokens"] * 1e6)


def _row(attainment: float, worker_hours: float) -> dict:
    return {"slo_attainment": attainment, "worker_hours": worker_hours}


def test_the_verdict_is_the_cheapest_static_meeting_the_target():
    static = {"colocated-16": _row(0.95, 4.0), "8P8D": _row(0.91, 3.0), "2P6D": _row(0.60, 1.0)}
    result = verdict(_row(0.93, 1.5), static, 0.9)
    assert list(result) == ["autoscaled", "static", "cheapest_static_meeting_attainment", "worker_hours_ratio"]
    assert result["cheapest_static_meeting_attainment"] == "8P8D"
    assert result["worker_hours_ratio"] == pytest.approx(0.5)
    nobody = verdict(_row(0.93, 1.5), {"2P6D": _row(0.6, 1.0)}, 0.9)
    assert nobody["cheapest_static_meeting_attainment"] is None and nobody["worker_hours_ratio"] is None


def test_the_static_search_finds_the_cheapest_size_between_ladder_rungs():
    """A fake cluster that meets 90% with at least 7 prefill and 2 decode workers: the cheapest is
    7P2D, 9 workers, between the ladder's rungs 8 and 12. The binary search brackets it (8 fails,
    12 meets), then tries 8's other splits and 9 before 12's answer: 9, found by walking from the
    first split tried (4P5D) towards more prefill. The ladder alone would answer 12."""
    from simulate.bench_autoscale import Case, meets_at, static_search

    ran: list[str] = []

    def attainment(name: str) -> float:
        if name.startswith("colocated"):
            return 0.5
        p, d = (int(x) for x in name[:-1].split("P"))
        return 0.95 * min(p / 7, d / 2, 1.0)

    def run(names: list[str]) -> dict[str, float]:
        ran.extend(names)
        return {name: attainment(name) for name in names}
    case = Case("fake", (), {}, "ttft=2", ladder=(8, 12, 16), shares=(0.5,))
    assert static_search(case, run) == 9
    assert "7P2D" in ran and "8P1D" not in ran  # 9's walk stopped where it met
    assert {int(x) + int(y) for x, y in (n[:-1].split("P") for n in ran if "P" in n)} == {8, 9, 12}
    assert not meets_at(8, (0.5,), run)  # every 8-worker split short of it: 6P2D the best, 81%


def test_a_ladder_whose_lowest_rung_meets_is_searched_below_it():
    """The same fake cluster (7P2D the cheapest) on a ladder starting at 12, which meets: sizes
    below are halved until one fails (6), then 7, 8 and 9 are tried in turn: 9. Without the
    descent the search answers 12, and a cheaper static meeting the target was never run
    (conversation-4x's ladder once started at 16, so 8P6D's 14 was never compared with less)."""
    from simulate.bench_autoscale import Case, static_search

    def run(names: list[str]) -> dict[str, float]:
        out = {}
        for name in names:
            p, d = (int(x) for x in name[:-1].split("P")) if "P" in name else (0, 0)
            out[name] = 0.95 * min(p / 7, d / 2, 1.0)
        return out
    assert static_search(Case("fake", (), {}, "ttft=2", ladder=(12, 16), shares=(0.5,)), run) == 9


def test_static_arrangements_by_name_or_by_size(h100):
    cfg, _ = h100
    named = static_configs(cfg, "colocated-16,10P6D", [], "all")
    assert named["colocated-16"].mode == "colocated" and named["colocated-16"].decode.replicas == 16
    assert (named["10P6D"].prefill.replicas, named["10P6D"].decode.replicas) == (10, 6)
    assert list(static_configs(cfg, None, [16], "eighths"))[:3] == ["colocated-16", "2P14D", "4P12D"]
    with pytest.raises(BenchError, match="expected colocated-N or a split"):
        static_configs(cfg, "16 GPUs", [], "all")
    with pytest.raises(BenchError, match="at least 1 prefill"):
        static_configs(cfg, "0P8D", [], "all")


def test_the_planner_runs_colocated_and_each_mode_is_reported_against_the_same_cheapest_static(h100):
    """bench_autoscale's planner in either mode: colocated is one pool of chunked-prefill workers
    (as the colocated-N statics) whose max is the whole budget; the case's own mode keeps the
    issue's JSON shape, every mode run sits under `planners` with its own ratio."""
    from bench.metrics import parse_slo
    from simulate.bench_autoscale import CASES
    from simulate.bench_planner import compare_modes, planner_config

    cfg, _ = h100
    slo = parse_slo("ttft=5,tpot=50ms")
    col = planner_config("conversation-4x", cfg, slo, 2.99, "colocated")
    static = static_configs(cfg, "colocated-4", [], "all")["colocated-4"]
    assert (col.mode, col.decode.replicas, col.prefill.replicas) == ("colocated", 4, 0)
    assert col.scheduler == static.scheduler and col.router.autoscale.enabled
    assert (col.router.autoscale.decode_max, col.router.autoscale.max_workers) == (64, 64)
    dis = planner_config("conversation-4x", cfg, slo, 2.99)
    assert (dis.mode, dis.prefill.replicas, dis.decode.replicas, dis.router.autoscale.decode_max) == \
        ("disaggregated", 2, 2, 63)
    with pytest.raises(ValueError, match="planner mode"):
        planner_config("conversation-4x", cfg, slo, 2.99, "both")
    runs = {"disaggregated": (_row(0.95, 0.72), {"plot": "d.png", "host_s": 1.0, "mode": "disaggregated"}),
            "colocated": (_row(0.91, 0.50), {"plot": "c.png", "host_s": 1.0, "mode": "colocated"})}
    statics = {"colocated-12": _row(0.902, 0.558), "colocated-11": _row(0.885, 0.518)}
    result = compare_modes(CASES["conversation-4x"], runs, statics)
    assert result["autoscaled"] == runs[CASES["conversation-4x"].planner][0]
    assert result["cheapest_static_meeting_attainment"] == "colocated-12"
    assert {m: round(r["worker_hours_ratio"], 3) for m, r in result["planners"].items()} == \
        {"disaggregated": round(0.72 / 0.558, 3), "colocated": round(0.50 / 0.558, 3)}
    assert "mode='colocated'" in result["planners"]["colocated"]["command"]


def test_the_bursty_preset_swings_between_a_24th_of_its_rate_and_its_rate():
    w = build_workload(WorkloadOptions(preset="bursty", max_context=131072, seed=0))
    arrivals = [r.arrival_s for r in w.requests]
    low = sum(a < 60 for a in arrivals) / 60
    high = sum(60 <= a < 90 for a in arrivals) / 30
    assert 0.5 < low < 1.6 and 20 < high < 28  # Poisson around 1 and 24 req/s
    assert all(7600 <= r.num_prompt_tokens <= 8400 for r in w.requests)
    assert w.describe()["bursts"][0] == {"start_s": 60.0, "end_s": 90.0}
    plateau = build_workload(WorkloadOptions(preset="plateau", rate=2.0, max_context=8192, seed=0))
    assert len(plateau.requests) == 3600 and 1700 < plateau.requests[-1].arrival_s < 1900


def test_a_planner_run_counts_its_changes_and_the_pools_follow_them(h100):
    """The planner's own decisions are the scaling actions, and after each change the ledger shows
    the pool reaching the size it asked for (event order, not timing)."""
    from bench.autoscale_compare import autoscaled_config

    cfg, em = h100
    cfg = autoscaled_config(_sized(cfg, 1, 1), prefill_max=6, decode_max=3, max_workers=8)
    wl = build_workload(WorkloadOptions(preset="bursty", rate=24.0, num_requests=160, max_context=131072, seed=2))
    run = simulate(cfg, em, wl, "planner", seed=2, check=False)
    row = figures(run.records, Slo(ttft_s=3.0), run.ledger, run.t0, run.end, run.decisions, 2.99)
    changes = [d for d in run.decisions if d["changed"]]
    assert changes and row["scaling_actions"] == len(changes)
    assert row["failed"] == 0
    for d in changes:
        for pool, p in d["pools"].items():
            if p["desired"] != p["target"]:
                later = [n for t, n in run.ledger.changes(d["at"], run.end + 3600, pool)]
                assert p["desired"] in later, (pool, p, later)
    assert row["peak_workers"] <= 8 and row["peak_workers"] > 2  # it grew for the burst, within the budget


def test_the_cli_prints_the_issues_json(tmp_path, capsys):
    args = [sys.executable, "-m", "cli", "simulate", "--config", str(ROOT / "simulate" / "gpu_cluster.yaml"),
            "--emulate", "h100:llama-3.1-8b", "--preset", "steady", "--rate", "20", "--duration", "3",
            "--slo", "ttft=0.5", "--autoscale", "--statics", "1P1D,colocated-2", "--processes", "1", "--json",
            "--out", str(tmp_path)]
    done = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert list(result) == ["autoscaled", "static", "cheapest_static_meeting_attainment", "worker_hours_ratio"]
    assert set(result["static"]) == {"1P1D", "colocated-2"}
    for s in [result["autoscaled"], *result["static"].values()]:
        assert {"slo_attainment", "goodput_req_per_s", "mean_workers", "peak_workers", "worker_hours",
                "scaling_actions", "failed", "usd_per_million_good_tokens"} <= set(s)
        assert s["failed"] == 0
    cheapest = result["cheapest_static_meeting_attainment"]
    assert cheapest in result["static"]
    assert result["worker_hours_ratio"] == pytest.approx(result["autoscaled"]["worker_hours"]
                                                         / result["static"][cheapest]["worker_hours"])
    assert (tmp_path / "autoscale.png").exists() and "timeline" in json.loads((tmp_path / "autoscale.json").read_text())
    # the refusal in this process (a second interpreter only to be refused cost ~3 s of imports)
    from cli.main import main as pdserve

    assert pdserve(args[3:10] + ["--autoscale"]) == 2
    assert "--autoscale scores every run by its SLO" in capsys.readouterr().err


def test_misused_flags_exit_2_naming_them(capsys):
    """Checked before any simulation: an unknown case, --arrangements with --planner-only, and
    --arrangements on a planner-only case without --statics-only (it would be ignored)."""
    from simulate import bench_autoscale

    for argv, words in ((["--only", "nope"], "no case nope"),
                        (["--arrangements", "colocated-4", "--planner-only"], "--planner-only runs none"),
                        (["--only", "steady", "--arrangements", "colocated-2"], "needs --statics-only")):
        with pytest.raises(SystemExit) as exited:
            bench_autoscale.main(argv)
        assert exited.value.code == 2 and words in capsys.readouterr().err, argv
