"""Toy KV pools and small helpers shared by the kv_transfer tests."""

from __future__ import annotations

import time

import torch

from kv_transfer import KVTransferConfig

SHAPE = dict(layers=3, block_size=4, kv_heads=2, head_dim=16)
CONFIG = KVTransferConfig(timeout_s=5.0, heartbeat_s=0.5, staging_bytes=64 << 10)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def make_pool(num_blocks: int, dtype: torch.dtype, seed: int | None = None,
              layers: int = SHAPE["layers"]) -> torch.Tensor:
    shape = (num_blocks, layers, 2, SHAPE["block_size"], SHAPE["kv_heads"], SHAPE["head_dim"])
    if seed is None:
        return torch.zeros(shape, dtype=dtype)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def as_bits(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.contiguous().view(torch.uint8)


def wait_until(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")
