"""The paged KV pool and its block allocator.

Pool layout: one tensor `[layers, 2, num_blocks, block_size, kv_heads, head_dim]` (2 = K, V).
A block id is the unit of allocation and of transfer. The allocator hands out the lowest
free ids first in FIFO order of freeing, returns `None` when a request does not fit, and
`check()` verifies `free + used == total` with no block owned twice.
"""

from __future__ import annotations

from collections import deque

import torch


class BlockAllocator:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._owner: dict[int, str] = {}  # block id -> owning request id

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._owner)

    def allocate(self, n: int, owner: str) -> list[int] | None:
        """`n` blocks for `owner`, or None (and nothing taken) if fewer than `n` are free."""
        assert n >= 0, f"cannot allocate {n} blocks"
        if n > len(self._free):
            return None
        ids = [self._free.popleft() for _ in range(n)]
        for block_id in ids:
            self._owner[block_id] = owner
        return ids

    def free(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            assert block_id in self._owner, f"block {block_id} freed twice or never allocated"
            del self._owner[block_id]
            self._free.append(block_id)

    def owned_by(self, owner: str) -> list[int]:
        return [b for b, o in self._owner.items() if o == owner]

    def check(self) -> None:
        """Integrity: every block is either free or owned, never both, never twice."""
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        assert not free & self._owner.keys(), "a block is both free and owned"
        total = len(free) + len(self._owner)
        assert total == self.num_blocks, f"free {len(free)} + used {len(self._owner)} != total {self.num_blocks}"


def allocate_kv_pool(
    num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
    dtype: torch.dtype, device: str | torch.device,
) -> torch.Tensor:
    # [layers, 2, num_blocks, block_size, kv_heads, head_dim]
    return torch.zeros(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
