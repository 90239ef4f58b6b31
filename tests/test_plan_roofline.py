"""`pdserve plan`'s roofline: the seed's arithmetic for llama-3.1-8b (16 GB of weights: >= 16 ms per
decode step at 1 TB/s, about 4.8 ms at 3.35 TB/s; 128 KiB of KV per token), the compute-bound
batch, the prefill ceiling, the KV transfer over a link, rates as people write them, and
`--measure` on a real checkpoint."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from bench import plan as plan_cli
from bench.roofline import DEVICES, Roofline, parse_rate
from protocol.sizes import PlanError
from sizing.memory import BUILTIN_SHAPES

PARAMS = BUILTIN_SHAPES["llama-3.1-8b"].num_params


def _plan(capsys, *argv: str) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser(prog="pdserve")
    plan_cli.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["plan", *argv])
    code = args.func(args)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_the_seeds_decode_arithmetic_on_an_h100(capsys):
    code, out, _ = _plan(capsys, "--model", "llama-3.1-8b", "--device", "h100")
    assert code == 0
    assert "weights        16.06 GB read every decode step: >= 16.06 ms at 1 TB/s, >= 4.79 ms at 3.35 TB/s" in out
    assert "KV per token   128.00 KiB" in out
    code, out, _ = _plan(capsys, "--model", "llama-3.1-8b", "--device", "h100", "--json", "--context", "1")
    plan = json.loads(out)
    rows = {row["batch"]: row for row in plan["roofline"]}
    assert list(rows) == [1, 8, 32, 128]
    # one token of context: the step is the weights (+ a token of KV per request) over 3.35 TB/s
    assert rows[1]["step_ms_floor"] == pytest.approx((2 * PARAMS + 128 * 1024) / 3.35e12 * 1e3)
    assert rows[1]["bound"] == "memory" and rows[1]["tok_s"] == pytest.approx(1e3 / rows[1]["step_ms_floor"])
    assert rows[8]["tok_s_per_user"] == pytest.approx(rows[8]["tok_s"] / 8)
    # 2 bytes per parameter read vs 2 FLOPs per parameter per request: compute-bound past 989/3.35
    assert plan["compute_bound_batch_weights_only"] == 296
    assert plan["prefill_tok_s"] == pytest.approx(989e12 / (2 * PARAMS))
    assert plan["kv_transfer"]["s"] == pytest.approx(128 * 1024 / 50e9)  # one token over 400 Gbit/s


def test_long_contexts_keep_decode_memory_bound_and_big_batches_overflow_the_budget():
    roof = Roofline(2 * PARAMS, PARAMS, 128 * 1024, 8192, 3.35e12, 989e12, 57 * 1024**3)
    assert roof.compute_bound_batch() is None  # each request's 1 GiB of KV outlasts its FLOPs
    assert roof.decode(32).kv_fits and not roof.decode(128).kv_fits
    assert roof.transfer_s(parse_rate("400Gbit", "link")) == pytest.approx(2**30 / 50e9)
    assert roof.decode(128).bound == "memory"
    compute_heavy = Roofline(2 * PARAMS, PARAMS, 128 * 1024, 0, 3.35e12, 1e12, 2**40)
    assert compute_heavy.decode(8).bound == "compute"
    assert compute_heavy.decode(8).step_s == pytest.approx(2 * PARAMS * 8 / 1e12)


@pytest.mark.parametrize(("text", "value"), [
    ("400Gbit", 50e9), ("400Gb/s", 50e9), ("100Gbps", 12.5e9), ("3.35TB/s", 3.35e12), ("25GB/s", 25e9),
    ("989TFLOPs", 989e12), ("1.2e15", 1.2e15), ("10GiB/s", 10 * 2**30),
])
def test_rates_as_people_write_them(text, value):
    assert parse_rate(text, "x") == pytest.approx(value)


def test_device_profiles_set_memory_and_a_half_profile_is_refused(capsys):
    assert set(DEVICES) == {"h100", "h200", "a100", "l40s"}
    code, out, _ = _plan(capsys, "--model", "llama-3.1-8b", "--device", "h200")
    assert code == 0 and "device memory  131.32 GiB" in out and ">= 3.35 ms at 4.80 TB/s" in out
    code, out, err = _plan(capsys, "--model", "llama-3.1-8b", "--bandwidth", "1TB/s")
    assert code == 2 and out == "" and "needs both --bandwidth and --flops" in err
    code, _, err = _plan(capsys, "--model", "llama-3.1-8b", "--device", "a100", "--link", "fast")
    assert code == 2 and "cannot read 'fast'" in err
    with pytest.raises(PlanError):
        parse_rate("0GB/s", "x")


def test_measure_this_host_on_a_checkpoint(llama_dir, capsys):
    code, out, _ = _plan(capsys, "--model", llama_dir, "--measure", "--json", "--context", "64",
                         "--device-memory", "1GiB", "--overhead", "0")
    assert code == 0
    plan = json.loads(out)
    measured = plan["measured"]
    assert measured["bandwidth"] > 1e8 and measured["flops"] > 1e8 and measured["threads"] == 1
    assert measured["weights_bytes"] == plan["weights_bytes"]  # every tensor of the checkpoint was read
    assert measured["floor_ms"] == pytest.approx(plan["weights_bytes"] / measured["bandwidth"] * 1e3)
    assert measured["weight_read_ms"] > 0 and set(measured["engine_decode_ms"]) == {"1", "8"}
    assert all(ms > 0 for ms in measured["engine_decode_ms"].values())
    fit = measured["fit"]  # this host's cost model for the checkpoint, as cluster.yaml's emulate: section
    assert fit["steps"] > 0 and fit["flops"] > 0 and fit["overhead_ms"] >= 0
    assert fit["emulate"] | {"bandwidth": None, "flops": None, "step_overhead_s": None} == {
        "device": "custom", "model": llama_dir, "dtype": "float32", "bandwidth": None, "flops": None,
        "memory": "64GiB", "bandwidth_efficiency": 1.0, "compute_efficiency": 1.0, "step_overhead_s": None}
    assert float(fit["emulate"]["bandwidth"]) == pytest.approx(measured["bandwidth"], rel=1e-5)
    # the roofline is drawn with the measured rates, over bytes known from config.json alone
    bandwidth, peak = measured["bandwidth"], measured["flops"]
    assert (plan["bandwidth_bytes_per_s"], plan["flops_per_s"]) == (bandwidth, peak)
    cfg = json.loads((Path(llama_dir) / "config.json").read_text())
    kv_per_token = (cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"]
                    * (cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]) * 4)  # float32
    assert plan["kv_bytes_per_token"] == kv_per_token
    assert [row["batch"] for row in plan["roofline"]] == [1, 8, 32, 128]
    for row in plan["roofline"]:
        assert row["bytes_read"] == plan["weights_bytes"] + row["batch"] * 64 * kv_per_token, row
        assert row["step_ms_floor"] == pytest.approx(max(row["bytes_read"] / bandwidth, row["flops"] / peak) * 1e3)
    for batch, floor_ms in measured["engine_floor_ms"].items():  # the engine's steps: 16 tokens of context
        memory_ms = (plan["weights_bytes"] + int(batch) * 16 * kv_per_token) / bandwidth * 1e3
        assert floor_ms == pytest.approx(memory_ms) or floor_ms > memory_ms, (batch, floor_ms, memory_ms)
