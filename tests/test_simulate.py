"""`pdserve simulate`: the router's and the engine's own code on a virtual clock.

Reference checks: an idle cluster's TTFT and ITL are exactly the cost model's step times; two
runs with one seed give identical records, with the host slowed on purpose too; a placement rule
changed in the router's `Placer` changes where the simulator places; blocks are all free at the end.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.presets import WorkloadOptions, build_workload
from bench.workload import RequestSpec, make_workload
from cli.main import main as pdserve
from router.config.loader import load_config
from router.pools.placement import Placer
from simulate.cli import emulated
from simulate.run import simulate
from sizing.cost_model import CostModel, StepItem

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def h100():
    base = load_config(str(ROOT / "cluster.yaml"))
    return emulated(base, dataclasses.replace(base.emulate, device="h100", model="llama-3.1-8b"), "test")


def _workload(n: int = 40, rate: float = 20.0, input_len: int = 512, preset: str = "shared-prefix"):
    return build_workload(WorkloadOptions(preset=preset, num_requests=n, rate=rate, input_len=input_len,
                                          output_len=32, max_context=8192, vocab=(1000, 32000), seed=3))


def _disaggregated(cfg, prefill: int, decode: int):
    return dataclasses.replace(cfg, mode="disaggregated", prefill=dataclasses.replace(cfg.prefill, replicas=prefill),
                               decode=dataclasses.replace(cfg.decode, replicas=decode))


def test_an_idle_cluster_takes_exactly_the_cost_models_step_times(h100):
    cfg, em = h100
    cfg = _disaggregated(cfg, 1, 1)
    prompt = tuple(range(1000, 1200))  # 200 tokens: one chunk
    workload = make_workload("one", [RequestSpec("r0", 0.0, prompt, 5)], None, {})
    run = simulate(cfg, em, workload, "disaggregated", rpc_s=0.0)
    (record,) = run.records
    assert record.ok and record.output_tokens == 5 and record.finish_reason == "length"
    cost: CostModel = em.cost
    prefill = cost.step_s((StepItem(200, 200),))
    # no link on the path of the first token; each decode step reads one more token of context
    assert record.message_times_s[0] - record.send_s == pytest.approx(prefill, abs=1e-8)
    gaps = [b - a for a, b in zip(record.message_times_s, record.message_times_s[1:], strict=False)]
    # the first decode step waits for the KV's last piece (the link model's time), then runs
    last_piece = em.link.transfer_s(cfg.kv_cache.block_size * cost.kv_bytes_per_token)
    assert gaps[0] >= cost.step_s((StepItem(1, 201),)) + last_piece
    assert gaps[1:] == pytest.approx([cost.step_s((StepItem(1, 201 + i),)) for i in range(1, 4)], abs=1e-8)
    assert all(c["used"] == 0 for c in run.checks.values()), run.checks


def test_one_seed_gives_identical_records_with_the_host_slowed_on_purpose(h100, monkeypatch):
    cfg, em = h100
    cfg = _disaggregated(cfg, 2, 2)
    workload = _workload()
    first = simulate(cfg, em, workload, "d", seed=7)
    original = CostModel.step_s

    def slow(self, step):  # host compute that must not enter the virtual clock
        time.sleep(0.0005)
        return original(self, step)
    monkeypatch.setattr(CostModel, "step_s", slow)
    second = simulate(cfg, em, workload, "d", seed=7)
    assert second.host_s > first.host_s * 0.5  # it really ran
    assert first.records == second.records and first.steps == second.steps
    assert sum(r.ok for r in first.records) == len(workload.requests)
    assert all(c["used"] == 0 and c["reserved"] == 0 for c in first.checks.values()), first.checks


@pytest.mark.usefixtures("ray_instance")
def test_a_placement_rule_changed_in_the_router_changes_the_live_router_and_the_simulation(h100, served_2x2,
                                                                                           monkeypatch):
    """No policy is written twice: one rule, changed in the router's `Placer`, moves both."""
    from tests.cluster_util import Client

    cfg, em = h100
    cfg = _disaggregated(cfg, 3, 1)
    workload = _workload(n=24, preset="steady", input_len=256)
    spread = {r.usage["prefill_worker"] for r in simulate(cfg, em, workload, "d").records}
    assert len(spread) > 1  # the router's own policy spreads prompts over the pool

    def last_worker(self, workers, hashes, num_tokens, limit=None):
        return max(workers, key=lambda w: int(w.name.split("-")[1]))
    monkeypatch.setattr(Placer, "pick_prefill", last_worker)
    pinned = {r.usage["prefill_worker"] for r in simulate(cfg, em, workload, "d").records}
    assert pinned == {"prefill-2"}
    live = max((w.name for w in served_2x2.router.pools.ready("prefill")), key=lambda n: int(n.split("-")[1]))
    client = Client(served_2x2.address)
    used = {client.tokens([11 + i, 12, 13, 14 + i], max_tokens=2, ignore_eos=True)[1].usage.prefill_worker
            for i in range(4)}
    assert used == {live}


def test_the_cli_prints_benchs_schema_the_same_for_a_seed(tmp_path, capsys):
    args = [sys.executable, "-m", "cli", "simulate", "--config", str(ROOT / "cluster.yaml"), "--emulate",
            "h100:llama-3.1-8b", "--preset", "steady", "--rate", "20", "--duration", "3", "--arrangements",
            "colocated-chunked,disaggregated", "--workers", "4", "--json", "--slo", "ttft=0.2"]
    runs = [subprocess.Popen(args + ["--out", str(tmp_path / str(i))], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, cwd=ROOT, env={"PATH": "/usr/bin:/bin", "PYTHONHASHSEED": str(i)})
            for i in (1, 2)]  # side by side: each is a whole CLI start and run
    try:
        outs = [run.communicate(timeout=300) for run in runs]
    finally:
        for run in runs:  # a run past its deadline (or a failed one's twin) is ended, not left behind
            if run.poll() is None:
                run.kill()
                run.wait()
    assert runs[0].returncode == 0, outs[0][1]
    assert outs[0][0] == outs[1][0]
    summary = json.loads(outs[0][0])
    assert set(summary["arrangements"]) == {"colocated-chunked", "disaggregated"}
    for name in summary["arrangements"]:
        assert summary["arrangements"][name]["num_errors"] == 0 and summary["arrangements"][name]["num_requests"] == 60
    assert summary["decision"]["recommendation"]
    capsys.readouterr()
    assert pdserve([*args[3:7], "tpu:llama-3.1-8b"]) == 2  # the `main` the console script calls
    assert "--emulate 'tpu:llama-3.1-8b'" in capsys.readouterr().err


def test_the_knee_is_where_attainment_crosses_the_target():
    from simulate.sweep import knee

    assert knee([(1, 1.0), (2, 0.95), (4, 0.5)], 0.9) == pytest.approx(2 + 2 * 0.05 / 0.45)
    assert knee([(1, 0.5), (2, 0.4)], 0.9) == 0.0
    assert knee([(1, 1.0), (2, 0.99)], 0.9) == 2


def test_the_sweep_covers_every_split_and_scores_by_the_slo(h100):
    from bench.metrics import Slo
    from simulate.sweep import arrangements, sweep

    cfg, em = h100
    assert list(arrangements(cfg, 4, "all")) == ["colocated-4", "1P3D", "2P2D", "3P1D"]
    assert list(arrangements(cfg, 16, "eighths"))[1:3] == ["2P14D", "4P12D"]
    result = sweep(cfg, em, _workload(n=30, preset="steady", input_len=256), [3], [1.0, 50.0], Slo(ttft_s=0.05),
                   processes=1)
    size = result["sizes"]["3"]
    assert set(size["arrangements"]) == {"colocated-3", "1P2D", "2P1D"}
    for a in size["arrangements"].values():
        low, high = a["rates"]["1"], a["rates"]["50"]
        assert low["errors"] == high["errors"] == 0
        assert low["slo_attainment"] >= high["slo_attainment"]
    assert size["recommended"] == size["ranking"][0]


def test_a_host_profile_keeps_the_configs_own_kv_pool(h100):
    """`--emulate host` / `config` (a custom device: this host) simulate the config's own pool, so a
    simulation compares with the real cluster it stands for; an emulated GPU gets the GPU's pool."""
    from simulate.cli import _emulate_section

    cfg, _ = h100
    base = load_config(str(ROOT / "cluster.yaml"))
    host = dataclasses.replace(base.emulate, device="custom", model="llama-3.2-1b", bandwidth="20GB/s",
                               flops="200GFLOPs", memory="64GiB")
    sim, em = emulated(dataclasses.replace(base, emulate=host), _emulate_section(
        dataclasses.replace(base, emulate=host), "config"), "test")
    block_bytes = base.kv_cache.block_size * em.cost.kv_bytes_per_token
    assert sim.kv_cache.num_blocks == (256 << 20) // block_bytes and sim.emulate.time_scale == 1.0
    assert cfg.kv_cache.num_blocks is None and cfg.engine_config(cfg.decode).num_blocks > 20_000  # 80 GB of H100


def test_a_model_with_windowed_layers_reads_only_their_windows():
    """Gemma 2: every other layer attends to its last 4,096 tokens. An idle simulated cluster's
    decode steps past the window take the cost model's windowed time, shorter than the same model
    with every layer full, and the attention pairs a chunk computes are what a per-query count gives."""
    from sizing.cost_model import _attended_pairs

    for context, n, window in ((10, 3, None), (10, 3, 4), (5000, 1, 4096), (5000, 2048, 4096), (3000, 2048, 4096)):
        by_query = sum(min(p, window or p) for p in range(context - n + 1, context + 1))
        assert _attended_pairs(StepItem(n, context), window) == by_query
    base = load_config(str(ROOT / "cluster.yaml"))
    cfg, em = emulated(base, dataclasses.replace(base.emulate, device="h100", model="gemma-2-9b"), "test")
    windows = em.cost.shape.sliding_windows
    assert windows[:2] == (4096, None) and sum(w is not None for w in windows) == 21
    full = dataclasses.replace(em.cost, shape=dataclasses.replace(em.cost.shape, sliding_windows=()))
    prompt = tuple(range(1000, 7000))  # 6,000 tokens: past the window
    run = simulate(_disaggregated(cfg, 1, 1), em, make_workload("w", [RequestSpec("r0", 0.0, prompt, 5)], None, {}),
                   "disaggregated", rpc_s=0.0)
    (record,) = run.records
    assert record.ok and record.output_tokens == 5
    gaps = [b - a for a, b in zip(record.message_times_s, record.message_times_s[1:], strict=False)]
    decode = [em.cost.step_s((StepItem(1, 6001 + i),)) for i in range(1, 4)]
    assert gaps[1:] == pytest.approx(decode, abs=1e-8)
    assert all(d < full.step_s((StepItem(1, 6001 + i),)) for i, d in enumerate(decode, 1))
    short = (StepItem(1, 4000),)  # inside the window every layer reads the same
    assert em.cost.step_s(short) == full.step_s(short)
