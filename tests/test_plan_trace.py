"""`pdserve plan --trace`: the static arrangement the planner's sizing picks for a trace.

Reference checks: the busiest window is found exactly on a hand-made workload; more load of the
same shape never asks for fewer workers; prompt-heavy load gets more prefill than decode; bad
input exits 2 with one line; the colocated replay's steps against the cost model's by hand, and its
answer against `pdserve simulate`'s runs.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from bench.metrics import Slo
from bench.plan_trace import _profile, colocated_met, peak_load, recommend
from bench.workload import RequestSpec, make_workload
from cli.main import main as pdserve
from router.config.loader import load_config
from simulate.cli import emulated
from sizing.cost_model import StepItem

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def h100():
    base = load_config(str(ROOT / "simulate" / "gpu_cluster.yaml"))
    return emulated(base, dataclasses.replace(base.emulate, device="h100", model="llama-3.1-8b"), "test")


def _workload(rate: float, prompt: int, output: int, seconds: float = 120.0):
    n = int(rate * seconds)  # distinct prompts: one repeated would be all prefix-cache hits, colocated
    specs = [RequestSpec(f"r{i}", i / rate, tuple(range(1000 + i, 1000 + i + prompt)), output) for i in range(n)]
    return make_workload("hand", specs, None, {})


def test_the_busiest_window_is_the_load():
    quiet = [RequestSpec(f"q{i}", float(i), (1,) * 100, 10) for i in range(60)]  # 1 req/s for 60 s
    burst = [RequestSpec(f"b{i}", 60 + i / 10, (1,) * 100, 10) for i in range(300)]  # 10 req/s for 30 s
    load = peak_load(make_workload("w", quiet + burst, None, {}), 30.0)
    assert load.requests_per_s == pytest.approx(10.0) and load.prompt_tokens_per_s == pytest.approx(1000.0)
    assert load.prompt_len == 100 and load.output_len == 10


def test_more_load_never_asks_for_fewer_workers_and_prompts_go_to_prefill(h100):
    cfg, em = h100
    slo = Slo(ttft_s=2.0, tpot_s=0.05)
    found = [recommend(cfg, em, _workload(rate, 8000, 64), slo) for rate in (1, 4, 16, 32)]
    sizes = [f["workers"] for f in found]
    assert sizes == sorted(sizes) and sizes[-1] > sizes[0]
    p, d = (int(x) for x in found[-1]["disaggregated"].rstrip("D").split("P"))
    assert p > d


def test_bad_input_exits_2_with_one_line(tmp_path, capsys):
    """Run by the `main` the console script calls (a fresh interpreter costs 10 s here; the real
    process's exit code is tests/test_cli.py's test_the_real_process_exits_2_with_one_line)."""
    bad = tmp_path / "t.jsonl"
    bad.write_text("{not json\n")
    for args, words in ((["--trace", str(bad)], "not valid JSON"), ([], "--model is required")):
        capsys.readouterr()
        code = pdserve(["plan", *args])
        err = capsys.readouterr().err
        assert code == 2 and words in err and err.count("\n") == 1, err


def test_the_cli_says_how_each_answer_was_sized_and_its_json_is_the_same_answer(tmp_path, capsys):
    """The operator's command on a small Mooncake-format trace: the text names the recommendation and
    how each arrangement was sized (the colocated replay at the SLO's percentile, the disaggregated
    replay and busiest window); --json carries the same answer and the percentile."""
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": 250 * i, "input_length": 4000, "output_length": 64,
                                         "hash_ids": list(range(8 * i, 8 * i + 8))}) + "\n" for i in range(40)))
    args = ["plan", "--trace", str(trace), "--slo", "ttft=2,tpot=50ms", "--emulate", "h100:llama-3.1-8b",
            "--config", str(ROOT / "simulate" / "gpu_cluster.yaml")]
    capsys.readouterr()
    assert pdserve(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert pdserve([*args, "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert found["percentile"] == 90 and lines[0].startswith(f"recommended: {found['recommended']} (")
    assert lines[1].startswith("colocated: the fewest workers whose replay") and "90% of requests" in lines[1]
    assert lines[2].startswith("disaggregated: prefill by a replay") and "busiest 30 s" in lines[2]


def _clumped(rate: float, clump: int, prompt: int, seconds: float = 120.0):
    """`rate` requests/s on average, arriving `clump` at once (every clump / rate seconds)."""
    specs = [RequestSpec(f"r{i}", (i // clump) * clump / rate, tuple(range(1000 + i, 1000 + i + prompt)), 16)
             for i in range(int(rate * seconds))]
    return make_workload("clumped", specs, None, {})


def test_arrivals_that_bunch_within_seconds_get_more_prefill_than_the_busiest_mean(h100):
    """The same 30 s mean, once spread evenly, once in clumps of 40 prompts every 10 s: each clump
    must be computed within the TTFT SLO, so the replay asks for more prefill workers than
    the busiest window's mean does (the earlier answer, one worker short on both traces)."""
    cfg, em = h100
    slo = Slo(ttft_s=2.0, tpot_s=0.05)
    even, clumped = recommend(cfg, em, _workload(4, 8000, 16), slo), recommend(cfg, em, _clumped(4, 40, 8000), slo)
    assert even["by_peak_window"] == clumped["by_peak_window"]  # the same busiest 30 s
    prefill = [int(r["disaggregated"].split("P")[0]) for r in (even, clumped)]
    assert prefill[1] > prefill[0] and prefill[1] > int(clumped["by_peak_window"][0].split("P")[0])


def test_prefill_is_sized_by_replaying_the_trace_at_full_speed_not_the_window_with_headroom(h100):
    """16 prompts/s of 8,000 tokens arriving evenly: four prefill workers at the profile's full
    speed meet every TTFT in the replay (no prompt ever waits), so the static answer has 4; the
    busiest window at the target utilization (80%) asks for 5, a worker the trace never needs."""
    cfg, em = h100
    found = recommend(cfg, em, _workload(16, 8000, 16), Slo(ttft_s=2.0, tpot_s=0.05))
    assert found["disaggregated"].startswith("4P") and found["by_peak_window"][0].startswith("5P")


def test_a_tighter_itl_slo_leaves_a_colocated_worker_less_time_for_prefill(h100):
    """Colocated, a step that carries prefill chunks takes several decode steps' time: the tighter
    the ITL SLO, the less prefill may land on a worker during one request's decode, the more
    workers (the decode load alone would not ask for more)."""
    cfg, em = h100
    wl = _workload(8, 8000, 256)
    loose, tight = (int(recommend(cfg, em, wl, Slo(ttft_s=2.0, tpot_s=itl))["colocated"].split("-")[1])
                    for itl in (0.2, 0.03))
    assert tight > loose


def test_the_colocated_replay_steps_as_the_engine_and_places_where_the_prefill_finishes_first(h100):
    """A hand-computed reference on the cost model's own step shapes (StepItem): a 6,000-token
    prompt at 0 s goes to worker 0 (both idle) in chunks of 2,048; a 1,000-token one at 10 ms goes
    to idle worker 1, where its prefill finishes first (1,000 tokens against 7,000 queued on 0),
    and takes one step there. On one worker it rides in the long prompt's second step instead."""
    cfg, em = h100
    cost, profile = em.cost, _profile(cfg, em, colocated=True)
    long, short = tuple(range(1000, 7000)), tuple(range(20_000, 21_000))
    wl = make_workload("two", [RequestSpec("a", 0.0, long, 2), RequestSpec("b", 0.01, short, 3)], None, {})
    first = [cost.step_s((StepItem(2048, 2048),)), cost.step_s((StepItem(2048, 4096),)),
             cost.step_s((StepItem(1904, 6000),))]
    seen: dict[int, list] = {}
    assert colocated_met(wl, 2, profile, 10.0, 1.0, seen=seen) == 1.0
    assert seen[0] == pytest.approx([sum(first), cost.step_s((StepItem(1, 6001),)), 0], rel=1e-9)
    tpot = (cost.step_s((StepItem(1, 1001),)) + cost.step_s((StepItem(1, 1002),))) / 2
    assert seen[1] == pytest.approx([cost.step_s((StepItem(1000, 1000),)), tpot, 1], rel=1e-9)
    colocated_met(wl, 1, profile, 10.0, 1.0, seen=seen)
    shared = cost.step_s((StepItem(2048, 4096), StepItem(1000, 1000)))
    assert seen[1][0] == pytest.approx(first[0] + shared - 0.01, rel=1e-9)
    # the SLO's edge: a TTFT just under the long prompt's misses it alone
    assert colocated_met(wl, 2, profile, sum(first) * 0.999, 1.0) == 0.5


def test_a_colocated_pool_is_sized_as_the_simulator_finds_it_with_finish_first_placement(h100):
    """Clumps of six 20,000-token prompts every 3 s, a 2 s TTFT SLO: placed where each prefill
    finishes first, two colocated workers take three prompts each and compute them within the SLO
    (60,000 tokens a worker; 4 + 2 would not), one worker cannot. The static answer is colocated-2,
    and `pdserve simulate` agrees: colocated-2 meets 90%, colocated-1 does not. The earlier sizing
    (a fluid queue at 80% with the decode share set aside, and an ITL check assuming random
    placement) asked for colocated-4 and answered 2P1D."""
    from bench.metrics import summarize_run
    from simulate.autoscale import static_configs
    from simulate.run import simulate

    cfg, em = h100
    specs = [RequestSpec(f"r{i}", (i // 6) * 3.0 + (i % 6) * 0.05, tuple(range(1000 + 7 * i, 21_000 + 7 * i)), 64)
             for i in range(60)]
    wl, slo = make_workload("clumps", specs, None, {}), Slo(ttft_s=2.0, tpot_s=0.05)
    assert recommend(cfg, em, wl, slo)["recommended"] == "colocated-2"
    configs = static_configs(cfg, "colocated-1,colocated-2", [], "all")
    met = {name: summarize_run(simulate(c, em, wl, name, check=False).records, slo)["slo_attainment"]
           for name, c in configs.items()}
    assert met["colocated-2"] >= 0.9 > met["colocated-1"], met
