"""The paged KV pool and its reference-counted block allocator with a prefix cache.

Pool layout: one tensor `[num_blocks, layers, 2, block_size, kv_heads, head_dim]` (2 = K, V), block-major.
A block id is the unit of allocation, of sharing and of transfer.

Allocator protocol: `allocate` hands out fresh blocks (refcount 1) or None when they don't fit;
`match` + `acquire` share cached blocks (refcount + 1); `free` decrements. A full block whose KV
is complete is registered under its content hash (`cache`, see protocol/block_hash.py); at
refcount 0 it stays cached but evictable, in LRU order, until `allocate` needs it. Never-cached
blocks are handed out first, lowest ids first, then in the order they were freed. Whoever holds
a reference frees it; a shared block is never written (only its holders' later blocks are).

Cache events for a router: `drain_events` returns the NET change since the last drain, so a
hash stored and evicted within one window appears in neither list; stored and removed are
disjoint and may be applied in any order.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence

import torch

from engine.kernels import hugepages


class BlockAllocator:
    def __init__(self, num_blocks: int, enable_caching: bool = True):
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self._refs = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))  # refcount 0, no hash
        self._evictable: OrderedDict[int, None] = OrderedDict()  # refcount 0, hashed; oldest first
        self._hash_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        self._stored: dict[bytes, None] = {}  # net change since the last drain (dicts keep order)
        self._removed: dict[bytes, None] = {}

    # ---- counts ------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks `allocate` can hand out: never-cached plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        return len(self._hash_of)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def refcount(self, block_id: int) -> int:
        return self._refs[block_id]

    def hash_of(self, block_id: int) -> bytes | None:
        return self._hash_of.get(block_id)

    # ---- allocation ----------------------------------------------------------------
    def fits(self, n: int, acquiring: Sequence[int] = ()) -> bool:
        """Whether `n` fresh blocks can be allocated after acquiring the cached blocks `acquiring`
        (those now evictable stop being available once acquired)."""
        return n <= self.num_free - sum(1 for b in acquiring if b in self._evictable)

    def allocate(self, n: int, owner: str) -> list[int] | None:
        """`n` fresh blocks (refcount 1), or None and nothing taken if fewer than `n` are free.
        `owner` names the caller in errors only: shared blocks are counted, not owned."""
        assert n >= 0, f"{owner}: cannot allocate {n} blocks"
        if n > self.num_free:
            return None
        ids = []
        for _ in range(n):
            if self._free:
                block_id = self._free.popleft()
            else:
                block_id, _ = self._evictable.popitem(last=False)
                self._uncache(block_id)
            self._refs[block_id] = 1
            ids.append(block_id)
        return ids

    def acquire(self, block_ids: Sequence[int]) -> None:
        """One more reference to each of these cached (or in-use) blocks."""
        for block_id in block_ids:
            if self._refs[block_id] == 0:
                assert block_id in self._evictable, f"block {block_id} is free and not cached"
                del self._evictable[block_id]
            self._refs[block_id] += 1

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference each. Pass a block table tail first: blocks freed later are evicted
        later, and a sequence's head blocks are worth more (its later ones are only reachable
        through them)."""
        for block_id in block_ids:
            assert self._refs[block_id] > 0, f"block {block_id} freed twice or never allocated"
            self._refs[block_id] -= 1
            if self._refs[block_id] == 0:
                if block_id in self._hash_of:
                    self._evictable[block_id] = None  # most recently used: evicted last
                else:
                    self._free.append(block_id)

    # ---- the prefix cache ------------------------------------------------------------
    def match(self, hashes: Sequence[bytes]) -> list[int]:
        """Blocks holding the longest cached leading run of `hashes`; refcounts unchanged."""
        ids = []
        for h in hashes:
            block_id = self._block_of.get(h)
            if block_id is None:
                break
            ids.append(block_id)
        return ids

    def cache(self, block_id: int, h: bytes) -> bool:
        """Register an in-use full block whose KV is complete under hash `h`. False (a no-op) when
        caching is off, `h` is cached in another block, or this block has a hash already."""
        if not self.enable_caching or h in self._block_of or block_id in self._hash_of:
            return False
        assert self._refs[block_id] > 0, f"block {block_id} is free: its KV is not complete"
        self._hash_of[block_id] = h
        self._block_of[h] = block_id
        _record(h, self._stored, undo=self._removed)
        return True

    def _uncache(self, block_id: int) -> None:
        h = self._hash_of.pop(block_id)
        del self._block_of[h]
        _record(h, self._removed, undo=self._stored)

    def drain_events(self) -> tuple[list[bytes], list[bytes]]:
        """(stored, removed) hashes: the net change since the last drain (disjoint lists)."""
        stored, removed = list(self._stored), list(self._removed)
        self._stored.clear()
        self._removed.clear()
        return stored, removed

    def cached_hashes(self) -> list[bytes]:
        return list(self._block_of)

    # ---- integrity -----------------------------------------------------------------
    def check(self) -> None:
        """free + used == total; free lists hold no block twice and no used block; refcounts are
        never negative; every evictable block is cached; the hash maps are each other's inverse."""
        free, evictable = set(self._free), set(self._evictable)
        used = {b for b, r in enumerate(self._refs) if r > 0}
        assert len(free) == len(self._free), "a block is on the free list twice"
        assert not free & evictable, "a block is both free and evictable"
        assert not (free | evictable) & used, "a block is both free and in use"
        assert all(r >= 0 for r in self._refs), "a negative refcount"
        total = len(free) + len(evictable) + len(used)
        assert total == self.num_blocks, f"free {len(free) + len(evictable)} + used {len(used)} != total {self.num_blocks}"
        assert evictable <= self._hash_of.keys(), "an evictable block has no hash"
        assert not free & self._hash_of.keys(), "a block on the plain free list has a hash"
        assert {b: h for h, b in self._block_of.items()} == self._hash_of, "hash <-> block maps disagree"
        assert self.enable_caching or not self._hash_of, "caching is off but blocks are cached"


def _record(h: bytes, events: dict[bytes, None], undo: dict[bytes, None]) -> None:
    """Note one event; one that undoes an event of the same window cancels it instead."""
    if h in undo:
        del undo[h]
    else:
        events[h] = None


def allocate_kv_pool(
    num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
    dtype: torch.dtype, device: str | torch.device,
) -> torch.Tensor:
    # [num_blocks, layers, 2, block_size, kv_heads, head_dim]: block-major, so each block is one
    # contiguous run of bytes that a KV channel sends and receives in place
    shape = (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)
    if torch.device(device).type == "cpu":  # a step reads a few KB from blocks all over it: 2 MiB pages
        return hugepages.zeros(*shape, dtype=dtype)
    return torch.zeros(*shape, dtype=dtype, device=device)
