"""The arithmetic of the hand-off and KV-channel benchmarks' reports (no cluster: fixed inputs)."""

from __future__ import annotations

import pytest
import torch

from bench.cluster_overhead import ttft_breakdown
from bench.handoff import summarize
from microbench.kv_transfer import host_limits


def _run(second_ms: float, step_ms: float) -> dict:
    return {"ttft_ms": 1000.0, "second_ms": second_ms, "third_ms": step_ms, "kv_transfer_ms": 5.0}


def test_handoff_rows_split_the_second_token_wait_into_the_decode_step_and_the_hand_off():
    # streamed: 190 and 188 ms; after the prefill: 270 and 266 ms; one decode step: 150 ms in every run
    raw = {8192: [[_run(190, 150), _run(188, 150)], [_run(270, 150), _run(266, 150)]]}
    row = summarize(raw)[8192]
    assert row["streamed_second_ms"] == 189 and row["after_second_ms"] == 268 and row["decode_step_ms"] == 150
    assert row["ratio"] == pytest.approx(189 / 268)
    assert row["floor_ratio"] == pytest.approx(150 / 268)           # what no hand-off can beat at this step
    assert row["handoff_wait_ratio"] == pytest.approx(39 / 118)     # (189 - 150) / (268 - 150)


def test_kv_channel_bounds_are_the_slowest_stage_and_the_stages_in_series():
    copy = {"memcpy": 6.0, "gather": 4.0, "scatter": 2.0}
    largest = {"raw_gbps": 1.0, "channel_gbps": 0.5}
    lim = host_limits(copy, largest)
    assert lim["overlapped_gbps"] == 1.0                            # the wire is the slowest stage
    assert lim["serial_gbps"] == pytest.approx(1 / (1 / 4 + 1 / 1 + 1 / 2))
    assert lim["channel_vs_overlapped"] == 0.5
    assert lim["channel_vs_serial"] == pytest.approx(0.5 / lim["serial_gbps"])


def test_idle_ttft_rows_come_with_the_twin_engines_spread_and_the_time_outside_the_forward():
    def sample(client: float, twin: float, compute: float) -> dict:
        return {"client_ttft_ms": client, "twin_prefill_ms": twin, "in_process_prefill_ms": 0.0,
                "router_ttft_ms": client - 4, "queue_ms": 0.0, "kv_transfer_ms": 1.0, "prefill_ms": compute + 2,
                "prefill_queue_ms": 0.5, "prefill_compute_ms": compute}
    engine = [100.0, 200.0, 300.0]
    cluster = [sample(130, 90, 110), sample(225, 215, 205), sample(318, 300, 296)]
    t = ttft_breakdown(engine, cluster, colocated=False)
    assert t["overhead_ms"] == 25                                   # 30, 25, 18
    assert t["twin_difference_ms"] == 0 and t["twin_abs_difference_ms"] == 10   # -10, 15, 0
    assert t["outside_forward_ms"] == 20                            # 20, 20, 22: no compute noise in it
    assert t["router_and_ray_ms"] == 14 and t["grpc_and_client_ms"] == 4   # (client - 4) - (compute + 2)


def test_the_step_profile_splits_a_whole_decode_step_and_leaves_the_engine_unwrapped(llama_dir):
    import engine.llm_engine as llm_engine_module
    from microbench.profile_step import ROWS, decode_case

    sampler = llm_engine_module.sample_isolated
    case = decode_case(llama_dir, batch=2, context=20, steps=2, threads=1, dtype="float32")
    assert set(case) == {*ROWS, "step"} and all(case[row] >= 0 for row in ROWS)
    # a real forward ran; decode attention is the CPU kernel where it builds, else SDPA
    assert case["dense matmul"] > 0 and case["attention (kernel)"] + case["SDPA"] > 0 and case["KV write"] > 0
    # bookkeeping is what the other rows leave of the step: together they are the step, never more
    # unless the measured parts overran it (then bookkeeping is 0)
    assert sum(case[row] for row in ROWS) == pytest.approx(case["step"]) or case["bookkeeping"] == 0
    assert llm_engine_module.sample_isolated is sampler  # the timing wrappers were taken off again


def test_the_linears_bench_times_both_paths_at_every_row_count(llama_dir, monkeypatch, capsys):
    import json
    import sys

    from engine.kernels import cpu_kernel
    from microbench import linears as bench_linears

    if cpu_kernel.load()[0] is None:
        pytest.skip(f"no CPU kernels here: {cpu_kernel.load()[1]}")
    monkeypatch.setattr(sys, "argv", ["bench_linears", "--model", llama_dir, "--rows", "1,17", "--rounds", "1",
                                      "--threads", "1", "--json"])
    bench_linears.main()
    report = json.loads(capsys.readouterr().out)
    assert report["small_rows"] == cpu_kernel.SMALL_ROWS
    assert set(report["seconds"]) == {"1", "17"}
    assert all(0 < t < 60 for row in report["seconds"].values() for t in row.values())


def test_bench_linears_compares_the_bfloat16_gemm_in_bfloat16(llama_dir, capsys, monkeypatch):
    """`--dtype bfloat16`: oneDNN's bfloat16 linears against the bfloat16 GEMM where it runs (at any
    row count it takes, past the engine's cut too), or torch's where oneDNN has no bfloat16 (AVX2
    alone); a host with no bfloat16 GEMM says so."""
    import json
    import sys

    from engine.kernels import cpu_kernel
    from microbench import linears as bench_linears

    kernels = cpu_kernel.load()[0]
    argv = ["bench_linears", "--model", llama_dir, "--rounds", "1", "--threads", "1", "--dtype", "bfloat16", "--json"]
    gemm = kernels.gemm_for(torch.bfloat16) if kernels is not None else None
    if gemm is None:
        monkeypatch.setattr(sys, "argv", [*argv, "--rows", "1"])
        with pytest.raises(SystemExit, match="no bfloat16 GEMM here"):
            bench_linears.main()
        return
    rows = "1,65"  # past 64 too: the bfloat16 GEMM takes any row count on every path
    monkeypatch.setattr(sys, "argv", [*argv, "--rows", rows])
    bench_linears.main()
    report = json.loads(capsys.readouterr().out)
    assert report["dtype"] == "bfloat16" and report["small_rows"] == gemm.max_rows
    from engine.forward import dense

    # oneDNN where it has bfloat16 here; else (AVX2 alone) torch's F.linear
    assert report["baseline"] == ("onednn" if dense.packable(torch.bfloat16) else "torch")
    assert set(report["seconds"]) == set(rows.split(","))
    assert all(0 < t < 60 for row in report["seconds"].values() for t in row.values())


def test_bench_steps_paired_ratio_is_each_rounds_best_over_its_own_floor():
    """`--paired`: round r's best variant over the floor from the host measured at round r's start, the
    median of those; the report adds the column."""
    from microbench.step import _paired, floor_s, format_report
    from sizing.memory import ModelShape
    params = 1_000_000
    shape = ModelShape(name="m", num_layers=2, num_kv_heads=2, head_dim=16, num_params=params)
    case = {"batch": 16, "tokens": 16, "context": 256}
    hosts = [{"bandwidth": 30e9, "flops": 180e9}, {"bandwidth": 15e9, "flops": 90e9}, {"bandwidth": 20e9, "flops": 100e9}]
    rounds = [{"modules": 0.05, "packed": 0.004}, {"modules": 0.03, "packed": 0.006}, {"modules": 0.02, "packed": 0.01}]
    _paired(case, rounds, hosts, shape, params)
    want = [best / floor_s(shape, params, 4, 16, 256, 16, h["bandwidth"], h["flops"])
            for best, h in zip((0.004, 0.006, 0.01), hosts, strict=True)]
    assert [r["ratio"] for r in case["paired_rounds"]] == want
    assert case["paired"] == sorted(want)[1]
    report = {"model": "m", "threads": 2, "malloc": "tcmalloc", "torch": "2.13", "recompilations": 0,
              "host": {"bandwidth": 30e9, "flops": 180e9}, "host_samples": [{"bandwidth": 30e9, "flops": 180e9}],
              "variants": ["modules", "packed"],
              "cases": {"decode b=16": {"modules": 0.050, "packed": 0.040, "floor": 0.024, "paired": 1.41}}}
    lines = format_report(report).splitlines()
    assert lines[1].split()[-1] == "paired" and lines[2].split()[-1] == "1.41"
    assert lines[-2].startswith("paired: the median over rounds")


def test_bench_steps_report_rates_each_variant_against_the_first_and_the_floor():
    from microbench.step import format_report
    report = {"model": "m", "threads": 2, "malloc": "tcmalloc", "torch": "2.13", "recompilations": 0,
              "host": {"bandwidth": 30e9, "flops": 180e9},
              "host_samples": [{"bandwidth": 30e9, "flops": 170e9}, {"bandwidth": 25e9, "flops": 180e9}],
              "variants": ["modules", "packed"],
              "cases": {"decode b=16": {"modules": 0.050, "packed": 0.040, "floor": 0.024}}}
    lines = format_report(report).splitlines()
    assert lines[1].split() == ["ms", "per", "step", "modules", "packed", "packed/modules", "floor", "best/floor"]
    assert lines[2].split() == ["decode", "b=16", "50.0", "40.0", "0.80", "24.0", "1.67"]
    assert lines[3] == ("host: 30.0 GB/s read, 180.0 GFLOP/s float32 matmul (the best of 30.0 GB/s read, 170.0 "
                        "GFLOP/s float32 matmul; 25.0 GB/s read, 180.0 GFLOP/s float32 matmul)")


def test_bench_steps_bfloat16_variant_is_held_to_bfloat16s_floor():
    """The bfloat16 variant against 2-byte weights and KV and bfloat16 matmul FLOP/s; the float32
    variants' best against float32's floor, each round paired with its own host."""
    from microbench.step import _paired, floor_s, format_report
    from sizing.memory import ModelShape
    params = 1_000_000
    shape = ModelShape(name="m", num_layers=2, num_kv_heads=2, head_dim=16, num_params=params)
    case = {"batch": 16, "tokens": 16, "context": 256}
    hosts = [{"bandwidth": 30e9, "flops": 180e9, "flops_bfloat16": 900e9},
             {"bandwidth": 10e9, "flops": 90e9, "flops_bfloat16": 400e9}]
    rounds = [{"packed": 0.004, "bfloat16": 0.003}, {"packed": 0.006, "bfloat16": 0.001}]
    _paired(case, rounds, hosts, shape, params)
    f32 = [best / floor_s(shape, params, 4, 16, 256, 16, h["bandwidth"], h["flops"])
           for best, h in zip((0.004, 0.006), hosts, strict=True)]
    bf16 = [best / floor_s(shape, params, 2, 16, 256, 16, h["bandwidth"], h["flops_bfloat16"])
            for best, h in zip((0.003, 0.001), hosts, strict=True)]
    assert [r["ratio"] for r in case["paired_rounds"]] == f32  # the bfloat16 step is not float32's best
    assert [r["ratio"] for r in case["paired_rounds_bfloat16"]] == bf16
    assert case["paired_bfloat16"] == (bf16[0] + bf16[1]) / 2
    host = {"bandwidth": 20e9, "flops": 100e9, "flops_bfloat16": 500e9}
    report = {"model": "m", "threads": 2, "malloc": "tcmalloc", "torch": "2.13", "recompilations": 0,
              "host": host, "host_samples": [host], "variants": ["packed", "bfloat16"],
              "cases": {"decode b=16": {"packed": 0.040, "bfloat16": 0.030, "floor": 0.020, "floor_bfloat16": 0.012}}}
    lines = format_report(report).splitlines()
    assert lines[1].split()[-4:] == ["floor", "bf16", "best/floor", "bf16"]
    assert lines[2].split() == ["decode", "b=16", "40.0", "30.0", "0.75", "20.0", "2.00", "12.0", "2.50"]
    assert lines[3].startswith("host: 20.0 GB/s read, 100.0 GFLOP/s float32 matmul, 500.0 GFLOP/s bfloat16 matmul")
