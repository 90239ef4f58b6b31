"""microbench/device_check.py on CPU: the logic a CUDA machine runs (scripts/device_check.sh), here on
the tiny model. Every check must genuinely pass: token-exact against `generate`, KV bit-identical
across two processes, the bench producing every token it was asked for."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIELDS = {"name", "ok", "seconds", "error"}

pytestmark = pytest.mark.ray  # its KV check starts a Ray of its own (conftest: the "own_ray" group)


def _device_check(model: str, out: Path, *extra: str) -> tuple[subprocess.CompletedProcess, dict]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "microbench.device_check", "--device", "cpu", "--quick",
                           "--model", model, "--out", str(out), *extra],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    return proc, json.loads(out.read_text())


def _assert_all_ok(proc: subprocess.CompletedProcess, report: dict, names: list[str]) -> None:
    assert [c["name"] for c in report["checks"]] == names
    for check in report["checks"]:
        assert FIELDS <= set(check), check
        assert check["ok"] and check["error"] is None, check
    assert report["ok"] is True and proc.returncode == 0, proc.stderr[-3000:]
    env = report["environment"]
    assert env["device"] == "cpu" and env["torch"] and env["cuda"] is None


def test_device_check_on_cpu_kv_transfer_eager_and_bench(llama_dir, tmp_path):
    proc, report = _device_check(llama_dir, tmp_path / "dc.json",
                                 "--checks", "kv_transfer,token_exact/float32/eager,bench_engine")
    _assert_all_ok(proc, report, ["kv_transfer", "token_exact/float32/eager", "bench_engine"])
    checks = {c["name"]: c for c in report["checks"]}
    kv = checks["kv_transfer"]
    assert kv["identical"] and kv["transfers"] == 2 and kv["backend"] == "gloo"
    assert kv["pool_devices"] == ["cpu", "cpu"] and kv["best_bytes_per_s"] > 0
    exact = checks["token_exact/float32/eager"]
    assert exact["mismatches"] == [] and exact["recompilations"] == 0
    assert exact["free_blocks"] == exact["total_blocks"]
    bench = checks["bench_engine"]
    assert bench["engine_tok_per_s"] > 0 and bench["generate_tok_per_s"] > 0 and bench["ratio"] > 0


@pytest.mark.slow
@pytest.mark.exhaustive  # the suite's one inductor compile is tests/test_engine_speed_paths.py's
def test_device_check_on_cpu_every_check(llama_dir, tmp_path):
    """All of it, the compiled forward too (minutes of compiling on the 2-core host)."""
    proc, report = _device_check(llama_dir, tmp_path / "dc.json")
    _assert_all_ok(proc, report, ["kv_transfer", "token_exact/float32/eager", "token_exact/bfloat16/eager",
                                  "bench_engine", "token_exact/float32/compiled", "token_exact/bfloat16/compiled"])
    compiled = next(c for c in report["checks"] if c["name"] == "token_exact/float32/compiled")
    assert compiled["compiled"] and compiled["mismatches"] == [] and compiled["recompilations"] == 0


def test_a_failing_check_is_recorded_and_the_others_still_run(tmp_path):
    """A model directory that does not exist: every model check fails with its error, the exit
    code says so, and the JSON holds them all. In this process: `main` is the command's whole run
    (a second interpreter cost ~4 s of imports; the test above runs the command's process)."""
    from microbench.device_check import main

    out = tmp_path / "dc.json"
    code = main(["--device", "cpu", "--quick", "--model", str(tmp_path / "no-such-model"), "--out", str(out),
                 "--checks", "token_exact/float32/eager,bench_engine"])
    report = json.loads(out.read_text())
    assert code == 1 and report["ok"] is False
    assert [c["name"] for c in report["checks"]] == ["token_exact/float32/eager", "bench_engine"]
    assert all(not c["ok"] and "no-such-model" in c["error"] for c in report["checks"])


def test_cuda_asked_for_where_there_is_none_exits_2(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this host has a CUDA device")
    from microbench.device_check import main

    assert main(["--out", str(tmp_path / "x.json")]) == 2
    assert "no CUDA device" in capsys.readouterr().err
