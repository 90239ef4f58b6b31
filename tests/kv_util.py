"""Toy KV pools and small helpers shared by the kv_transfer tests."""

from __future__ import annotations

import threading
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


class Owner:
    """In-process decode owner: fixed reservations, records every on_complete. A resolve waits
    `resolve_delay_s`, or, while `gate` is set to an event, until that event is set."""

    def __init__(self, reserved: dict[str, list[int]], resolve_delay_s: float = 0.0) -> None:
        self.reserved = reserved
        self.resolve_delay_s = resolve_delay_s
        self.gate: threading.Event | None = None
        self.completed: list[tuple[str, list[int], BaseException | None]] = []
        self.first_blocks: dict[str, int] = {}

    def resolve(self, request_id: str, num_blocks: int, first_block: int = 0) -> list[int] | None:
        if self.gate is not None:
            self.gate.wait(60)
        else:
            time.sleep(self.resolve_delay_s)
        self.first_blocks[request_id] = first_block
        blocks = self.reserved.get(request_id)
        return None if blocks is None else blocks[first_block:first_block + num_blocks]

    def complete(self, request_id: str, blocks: list[int], error: BaseException | None):
        self.completed.append((request_id, blocks, error))
