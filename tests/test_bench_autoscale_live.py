"""`pdserve bench --autoscale` (bench/autoscale_live.py): its flags, each misuse one line and exit 2
before anything starts; and, exhaustive (two live clusters of the tiny model, ~2 minutes here),
the whole command: the planner's run grows the prefill pool under a burst, the static run does
not, and `--json` prints exactly `pdserve simulate --autoscale`'s schema. The ledger it scores
with is checked against the pool manager's own starts and kills in tests/test_autoscale_live.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from cli.main import main as pdserve

ROOT = Path(__file__).resolve().parent.parent
KEYS = {"slo_attainment", "goodput_req_per_s", "mean_workers", "peak_workers", "worker_hours", "scaling_actions",
        "failed"}


@pytest.mark.parametrize("flags, message", [
    (["--autoscale", "--slo", "ttft=1"], "--autoscale needs --statics, e.g. 1P1D,2P1D"),
    (["--statics", "1P1D"], "--statics names the static arrangements of --autoscale: give --autoscale too"),
    (["--autoscale", "--statics", "1P1D,2Q", "--slo", "ttft=1"], "--statics '2Q': expected colocated-N or a split"),
    (["--autoscale", "--statics", "0P2D", "--slo", "ttft=1"], "--statics 0P2D: a split needs at least 1 prefill"),
    (["--autoscale", "--statics", "1P1D"], "--autoscale scores every run by its SLO: give --slo"),
    (["--autoscale", "--statics", "1P1D", "--slo", "ttft=1", "--arrangements", "colocated"],
     "--autoscale compares the planner with --statics; --arrangements does not apply"),
    (["--autoscale", "--statics", "1P1D", "--slo", "ttft=1", "--attainment", "0"], "--attainment 0: must be in (0, 1]"),
])
def test_a_misused_flag_is_one_line_and_exit_2(capsys, flags, message):
    capsys.readouterr()
    code = pdserve(["bench", "--config", str(ROOT / "bench" / "data" / "autoscale_live.yaml"), *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("pdserve bench: ") and message in err[0], err


def test_autoscale_needs_a_cluster_to_start(capsys):
    capsys.readouterr()
    code = pdserve(["bench", "--router", "127.0.0.1:1", "--autoscale", "--statics", "1P1D", "--slo", "ttft=1"])
    assert code == 2 and "--autoscale needs --config" in capsys.readouterr().err


@pytest.mark.exhaustive
def test_the_planner_and_a_static_cluster_side_by_side_live(tmp_path, llama_dir):
    """1 + 1 tiny workers; prompts of 1,500 tokens arrive at 30/s for a few seconds: their prefills
    queue past the 0.3 s TTFT SLO, so the planner grows prefill to 2 (3 workers), the static 1P1D
    stays at 2; every request of both runs finishes."""
    config = tmp_path / "cluster.yaml"
    config.write_text(yaml.safe_dump({
        "model": {"path": llama_dir, "dtype": "float32"},
        "prefill": {"replicas": 1, "num_cpus": 0.5, "torch_threads": 1},
        "decode": {"replicas": 1, "num_cpus": 0.5, "torch_threads": 1},
        "kv_cache": {"block_size": 16, "num_blocks": 1024},
        "router": {"metrics_port": None, "http_port": None, "drain_timeout_s": 5, "autoscale": {
            "ttft_s": 0.3, "interval_s": 0.5, "prefill_max": 2, "decode_max": 1, "scale_up_cooldown_s": 1,
            "scale_down_cooldown_s": 3, "warmup_s": 0, "profile": "online"}}}))
    args = [sys.executable, "-m", "cli", "bench", "--config", str(config), "--autoscale", "--statics", "1P1D",
            "--preset", "steady", "--rate", "30", "--num-requests", "150", "--input-len", "1500", "--output-len", "4",
            "--slo", "ttft=0.3", "--json", "--no-progress", "--out", str(tmp_path / "out")]
    done = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert list(result) == ["autoscaled", "static", "cheapest_static_meeting_attainment", "worker_hours_ratio"]
    assert set(result["static"]) == {"1P1D"}
    planner, static = result["autoscaled"], result["static"]["1P1D"]
    assert KEYS <= set(planner) and KEYS <= set(static)
    assert planner["failed"] == static["failed"] == 0 and planner["requests"] == static["requests"] == 150
    assert planner["peak_workers"] == 3 and planner["scaling_actions"] >= 1
    assert static["peak_workers"] == 2 and static["scaling_actions"] == 0
    record = json.loads((tmp_path / "out" / "autoscale.json").read_text())
    assert [p for t, p in record["timeline"]["actual"]["prefill"]][:2] == [1, 2]
    assert any(d["changed"] and d["pools"]["prefill"]["desired"] == 2 for d in record["timeline"]["decisions"])
