"""Memory budget (sizing/memory.py, protocol/sizes.py) and `pdserve plan`: the seed's figures, byte for byte."""

from __future__ import annotations

import argparse
import json
import struct

import pytest

from bench import plan as plan_cli
from protocol.sizes import PlanError, parse_bytes
from sizing.memory import (
    BUILTIN_SHAPES,
    ModelShape,
    estimate_num_params,
    kv_bytes_for_context,
    kv_bytes_per_token,
    layer_windows,
    num_kv_blocks,
    plan_memory,
)

GIB = 1024**3
LLAMA_8B_CONFIG = {
    "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
    "num_hidden_layers": 32, "vocab_size": 128256, "intermediate_size": 14336,
    "tie_word_embeddings": False, "max_position_embeddings": 131072,
    "torch_dtype": "bfloat16",
}


def _run_plan(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="pdserve")
    plan_cli.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["plan", *argv])
    return args.func(args)


def test_kv_bytes_per_token_is_128_kib_for_llama_8b_in_bf16():
    shape = BUILTIN_SHAPES["llama-3.1-8b"]
    assert kv_bytes_per_token(shape, 2) == 2 * 32 * 8 * 128 * 2 == 128 * 1024


def test_seed_budget_80gib_minus_weights_and_overhead_fits_57_requests_of_8k():
    plan = plan_memory(BUILTIN_SHAPES["llama-3.1-8b"], "bfloat16", 80 * GIB, 8 * GIB, 8192)
    assert plan.weights_bytes == 8_030_261_248 * 2
    assert round(plan.weights_bytes / GIB, 2) == 14.96
    assert plan.bytes_per_request == GIB
    assert plan.block_bytes == 16 * 128 * 1024
    assert plan.num_blocks == (80 * GIB - 8 * GIB - 8_030_261_248 * 2) // (2 * 1024**2) == 29205
    assert plan.capacity_tokens == 29205 * 16
    assert plan.requests_that_fit == 57


def test_partial_block_rounds_a_request_up_and_explicit_weights_win():
    shape = BUILTIN_SHAPES["llama-3.1-8b"]
    plan = plan_memory(shape, 2, 80 * GIB, 8 * GIB, 8193, weights_bytes=16 * GIB)
    assert plan.blocks_per_request == 513
    assert plan.bytes_per_request == 513 * 16 * 128 * 1024
    assert plan.kv_budget_bytes == 56 * GIB
    assert plan.num_blocks == 56 * GIB // (2 * 1024**2)


def test_weights_and_overhead_beyond_memory_is_a_plan_error():
    with pytest.raises(PlanError, match="weights") as info:
        plan_memory(BUILTIN_SHAPES["llama-3.1-70b"], "bfloat16", 80 * GIB, 8 * GIB, 8192)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(("text", "expected"), [
    ("80GiB", 80 * GIB), ("512MiB", 512 * 1024**2), ("1.5GB", 1_500_000_000),
    ("1024", 1024), ("2 KiB", 2048), ("1.5GiB", 3 * GIB // 2),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "80XB", "-1GiB", "1.2.3"])
def test_parse_bytes_rejects_garbage(text):
    with pytest.raises(PlanError, match="size"):
        parse_bytes(text)


def test_from_hf_config_derives_head_dim_and_estimates_llama_8b_params_exactly():
    shape = ModelShape.from_hf_config(LLAMA_8B_CONFIG, name="llama")
    assert (shape.num_layers, shape.num_kv_heads, shape.head_dim) == (32, 8, 128)
    assert shape.num_params == BUILTIN_SHAPES["llama-3.1-8b"].num_params
    no_gqa = {k: v for k, v in LLAMA_8B_CONFIG.items() if k != "num_key_value_heads"}
    assert ModelShape.from_hf_config(no_gqa).num_kv_heads == 32


def test_from_hf_config_accepts_a_transformers_config():
    from transformers import Qwen2Config

    cfg = Qwen2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                      num_hidden_layers=3, intermediate_size=128, vocab_size=100)
    shape = ModelShape.from_hf_config(cfg)
    assert (shape.num_layers, shape.num_kv_heads, shape.head_dim) == (3, 2, 16)
    assert shape.num_params == estimate_num_params(cfg.to_dict())


def test_num_kv_blocks_floors_to_whole_blocks():
    shape = ModelShape("toy", num_layers=2, num_kv_heads=2, head_dim=4, num_params=0)
    per_block = 4 * kv_bytes_per_token(shape, 4)  # 4 tokens x 128 B
    assert num_kv_blocks(shape, "float32", 3 * per_block + per_block - 1, 4) == 3
    assert num_kv_blocks(shape, 4, -5, 4) == 0


def test_cli_prints_the_seed_figures(capsys):
    assert _run_plan("--model", "llama-3.1-8b", "--dtype", "bfloat16", "--device-memory",
                     "80GiB", "--overhead", "8GiB", "--context", "8192") == 0
    out = capsys.readouterr().out
    assert "weights        14.96 GiB" in out
    assert "KV per token   128.00 KiB" in out
    assert "1.00 GiB for 8,192 tokens" in out
    assert "467,280 tokens" in out
    assert "57 concurrent" in out


def test_cli_json_is_one_object(capsys):
    assert _run_plan("--model", "llama-3.1-8b", "--json") == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["kv_bytes_per_token"] == 131072
    assert doc["bytes_per_request"] == GIB
    assert doc["requests_that_fit"] == 57


@pytest.mark.parametrize(("argv", "message"), [
    (["--model", "no-such-model"], "not a built-in shape"),
    (["--model", "llama-3.1-70b"], "leave no room"),
    (["--model", "llama-3.1-8b", "--device-memory", "lots"], "cannot read 'lots'"),
    (["--model", "llama-3.1-8b", "--dtype", "int3"], "unknown dtype"),
    (["--model", "llama-3.1-8b", "--context", "0"], "context"),
])
def test_cli_bad_input_exits_2_with_a_message(capsys, argv, message):
    assert _run_plan(*argv) == 2
    captured = capsys.readouterr()
    assert message in captured.err
    assert captured.out == ""


def _write_safetensors(path, shapes: dict[str, list[int]]) -> None:
    header = {name: {"dtype": "BF16", "shape": shape, "data_offsets": [0, 0]}
              for name, shape in shapes.items()}
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)


def test_cli_reads_a_checkpoint_dir_and_counts_safetensors_params(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_8B_CONFIG))
    _write_safetensors(tmp_path / "model.safetensors", {"a": [1000, 1000], "b": [500]})
    assert _run_plan("--model", str(tmp_path), "--json", "--device-memory", "1GiB",
                     "--overhead", "0") == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["model_shape"]["num_params"] == 1_000_500
    assert doc["weights_bytes"] == 2_001_000
    assert doc["dtype"] == "bfloat16"


def test_cli_estimates_params_without_safetensors(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_8B_CONFIG))
    assert _run_plan("--model", str(tmp_path), "--json") == 0
    assert json.loads(capsys.readouterr().out)["weights_bytes"] == 8_030_261_248 * 2


def test_cli_names_a_broken_safetensors_file(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_8B_CONFIG))
    (tmp_path / "model.safetensors").write_bytes(b"\x05\x00")
    assert _run_plan("--model", str(tmp_path)) == 2
    assert "model.safetensors" in capsys.readouterr().err


# ---- sliding-window layers ---------------------------------------------------------------------
GEMMA2_9B_CONFIG = {  # google/gemma-2-9b's config.json as older releases wrote it: no layer_types
    "model_type": "gemma2", "hidden_size": 3584, "num_attention_heads": 16, "num_key_value_heads": 8,
    "head_dim": 256, "num_hidden_layers": 42, "vocab_size": 256000, "intermediate_size": 14336,
    "sliding_window": 4096, "max_position_embeddings": 8192, "torch_dtype": "bfloat16",
}


@pytest.mark.parametrize(("extra", "expected"), [
    ({"model_type": "mistral", "sliding_window": 3}, (3, 3, 3, 3)),
    ({"model_type": "mistral", "sliding_window": None}, (None,) * 4),
    ({"model_type": "qwen2", "sliding_window": 3, "use_sliding_window": False}, (None,) * 4),
    ({"model_type": "qwen2", "sliding_window": 3, "use_sliding_window": True, "max_window_layers": 1}, (None, 3, 3, 3)),
    ({"model_type": "gemma2", "sliding_window": 3}, (3, None, 3, None)),
    ({"model_type": "gemma3_text", "sliding_window": 3, "sliding_window_pattern": 2}, (3, None, 3, None)),
    ({"model_type": "gemma3_text", "sliding_window": 3, "layer_types": ["full_attention", "sliding_attention"] * 2},
     (None, 3, None, 3)),
    ({"model_type": "smollm3", "sliding_window": 3, "use_sliding_window": False,
      "layer_types": ["sliding_attention"] * 4}, (None,) * 4),
])
def test_layer_windows_follow_each_familys_config_rule(extra, expected):
    cfg = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 4, **extra}
    assert layer_windows(cfg, 4) == expected
    assert ModelShape.from_hf_config(cfg, num_params=0).sliding_windows == (expected if any(expected) else ())


def test_windowed_kv_bounds_sliding_layers_by_their_window():
    shape = ModelShape.from_hf_config(GEMMA2_9B_CONFIG, num_params=0)
    per_layer_token = 2 * 8 * 256 * 2  # K and V, 8 KV heads x 256 dims, bf16
    assert kv_bytes_per_token(shape, 2) == 42 * per_layer_token  # what the pool holds per token
    assert kv_bytes_for_context(shape, 2, 1000) == 42 * 1000 * per_layer_token  # inside the window: all
    assert kv_bytes_for_context(shape, 2, 8192) == per_layer_token * (21 * 8192 + 21 * 4096)
    no_windows = ModelShape.from_hf_config(LLAMA_8B_CONFIG, num_params=0)
    assert kv_bytes_for_context(no_windows, 2, 8192) == 8192 * kv_bytes_per_token(no_windows, 2)


def test_cli_reports_windowed_kv_beside_the_pools(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(GEMMA2_9B_CONFIG))
    argv = ("--model", str(tmp_path), "--device-memory", "80GiB", "--overhead", "8GiB", "--context", "8192")
    assert _run_plan(*argv, "--json") == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["kv_bytes_per_token"] == 42 * 8192
    assert doc["windowed_kv_bytes_per_token"] == 8192 * 21 * 1.5
    assert doc["bytes_per_request"] == 8192 * 42 * 8192  # the pool keeps every token of every layer
    assert _run_plan(*argv) == 0
    assert ("KV windowed    252.00 KiB per token over 8,192 tokens (21 of 42 layers keep a 4,096-token "
            "window); pdserve's pool holds every token") in capsys.readouterr().out
