"""One rule sizes a worker's KV pool (sizing/kv_pool.py): the engine's pool, bench's capacity check
and the router's host-memory check agree on `dtype: auto` and on the block count, and `auto`
follows the device, never the checkpoint's `torch_dtype`."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from bench.capacity import worker_capacity
from engine.llm_engine import LLMEngine
from router.config import checks
from router.config.loader import parse_config
from sizing import kv_pool
from sizing.memory import ModelShape, kv_bytes_per_token


def test_an_explicit_dtype_wins_and_auto_follows_the_device(monkeypatch):
    assert kv_pool.resolve_dtype("float32", "cpu") == "float32"
    assert kv_pool.resolve_dtype("bfloat16", "cpu") == "bfloat16"
    monkeypatch.setattr(kv_pool, "computes_bf16", lambda device_type: device_type == "cpu")
    assert kv_pool.resolve_dtype("auto", "cpu") == "bfloat16"
    monkeypatch.setattr(kv_pool, "computes_bf16", lambda device_type: False)
    assert kv_pool.resolve_dtype("auto", "cpu") == "float32"


def test_num_blocks_wins_then_memory_then_the_device():
    shape = ModelShape("toy", num_layers=2, num_kv_heads=2, head_dim=16, num_params=0)
    per_block = 16 * kv_bytes_per_token(shape, 2)  # 2 x 2 layers x 2 heads x 16 dims x 2 bytes x 16 tokens
    assert per_block == 4096
    assert kv_pool.kv_pool_blocks(shape, "bfloat16", 16, 7, 1 << 20) == 7
    assert kv_pool.kv_pool_blocks(shape, "bfloat16", 16, None, 1 << 20) == (1 << 20) // 4096 == 256
    assert kv_pool.kv_pool_blocks(shape, "float32", 16, None, 1 << 20) == 128
    assert kv_pool.kv_pool_blocks(shape, "bfloat16", 16, None, None) is None


@pytest.mark.parametrize("host_bf16", [True, False], ids=["bf16-host", "no-bf16-host"])
def test_bench_the_router_and_the_engine_size_the_same_pool(llama_dir, tmp_path, monkeypatch, host_bf16):
    """A checkpoint saved in the dtype `auto` does NOT pick here: bench used to read its
    `torch_dtype`; the engine never did. Now all three agree with the pool the engine allocates."""
    if host_bf16 and not kv_pool.computes_bf16("cpu"):
        pytest.skip("this CPU does not compute bfloat16 natively")
    monkeypatch.setattr(kv_pool, "computes_bf16", lambda device_type: host_bf16 and device_type == "cpu")
    model = tmp_path / "model"
    shutil.copytree(llama_dir, model)
    config = json.loads((model / "config.json").read_text())
    config["torch_dtype"] = "float32" if host_bf16 else "bfloat16"  # the opposite of what auto picks
    config.pop("dtype", None)
    (model / "config.json").write_text(json.dumps(config))
    cfg = parse_config({"model": {"path": str(model)}, "kv_cache": {"memory": "1MiB"}})
    expected = "bfloat16" if host_bf16 else "float32"
    engine = LLMEngine(cfg.engine_config(cfg.decode, device=cfg.device_of(cfg.decode)))
    assert engine.runner.dtype == getattr(torch, expected)
    capacity = worker_capacity(cfg)
    assert capacity.blocks == engine.runner.num_blocks and capacity.source == f"kv_cache.memory 1MiB in {expected}"
    per_token = kv_bytes_per_token(engine.runner.shape, engine.runner.dtype.itemsize)
    assert checks._real_kv_bytes_per_token(cfg) == per_token
    assert capacity.blocks == (1 << 20) // (16 * per_token)
