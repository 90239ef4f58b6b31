"""The KV pool's layout, and block gather/scatter between the pool and a staging slot.

The pool is ONE tensor `[num_blocks, layers, 2, block_size, kv_heads, head_dim]` (block-major),
so one block is one contiguous run of `bytes_per_block` bytes and a run of consecutive block ids
is one contiguous run too. On the wire a chunk of k blocks is those k blocks' bytes, one after
another. A run of consecutive ids is sent from, or received into, the pool in place; any other
chunk is gathered into (scattered from) a preallocated staging slot: no transfer allocates its
payload.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    block_size: int
    kv_heads: int
    head_dim: int
    dtype: str

    @classmethod
    def of(cls, kv: torch.Tensor) -> KVLayout:
        if kv.dim() != 6 or kv.shape[2] != 2:
            raise ValueError(
                "KV pool must be [num_blocks, layers, 2, block_size, kv_heads, head_dim], "
                f"got shape {tuple(kv.shape)}")
        if not kv.is_contiguous():
            raise ValueError("KV pool must be one contiguous tensor")
        dtype = str(kv.dtype).removeprefix("torch.")
        if dtype not in DTYPES:
            raise ValueError(f"KV pool dtype must be one of {sorted(DTYPES)}, got {dtype}")
        _, layers, _, block_size, kv_heads, head_dim = kv.shape
        return cls(layers, block_size, kv_heads, head_dim, dtype)

    @property
    def block_elems(self) -> int:
        """Elements of one block in one (layer, k|v) slab."""
        return self.block_size * self.kv_heads * self.head_dim

    @property
    def block_row_elems(self) -> int:
        """Elements of one whole block (every layer's K and V)."""
        return 2 * self.num_layers * self.block_elems

    @property
    def bytes_per_block(self) -> int:
        return self.block_row_elems * DTYPES[self.dtype].itemsize

    def to_dict(self) -> dict[str, int | str]:
        return asdict(self)

    def mismatches(self, other: KVLayout, names: tuple[str, str]) -> list[str]:
        """Readable differences, e.g. ['num_layers: receiver 32 != sender 16']."""
        ours, theirs = asdict(self), asdict(other)
        return [f"{key}: {names[0]} {ours[key]} != {names[1]} {theirs[key]}"
                for key in ours if ours[key] != theirs[key]]


class BlockCopier:
    """Gathers pool blocks into a staging slot (sender) and scatters a slot into blocks (receiver).

    `wire_device` is where the staging slots live (the data backend's device). When it differs
    from the pool's device (a CUDA pool sent over gloo) copies bounce through one slot-sized
    buffer on the pool's device.
    """

    def __init__(self, kv: torch.Tensor, wire_device: torch.device, slot_bytes: int) -> None:
        self.layout = KVLayout.of(kv)
        self.num_blocks = kv.shape[0]
        self._pool = kv.view(self.num_blocks, self.layout.block_row_elems)  # one row per block
        self._bytes = kv.view(-1).view(torch.uint8)
        self._bounce = None
        if wire_device != kv.device:
            self._bounce = torch.empty(slot_bytes, dtype=torch.uint8, device=kv.device)

    def in_place(self, block_ids: list[int]) -> torch.Tensor | None:
        """The pool's own bytes of `block_ids` when they are consecutive ids and the wire reads
        the pool's device (nothing to copy); None otherwise."""
        if self._bounce is not None or len(contiguous_runs(block_ids)) != 1:
            return None
        size = self.layout.bytes_per_block
        return self._bytes[block_ids[0] * size:(block_ids[0] + len(block_ids)) * size]

    def chunk_view(self, slot: torch.Tensor, num_blocks: int) -> torch.Tensor:
        """The first `num_blocks` blocks' worth of `slot`, typed: [k, block_row_elems]."""
        nbytes = num_blocks * self.layout.bytes_per_block
        return slot[:nbytes].view(self._pool.dtype).view(num_blocks, -1)

    def gather(self, block_ids: list[int], slot: torch.Tensor) -> torch.Tensor:
        """Copy `block_ids` into `slot`; returns the filled bytes of the slot (flat uint8)."""
        nbytes = len(block_ids) * self.layout.bytes_per_block
        target = slot if self._bounce is None else self._bounce
        index = torch.tensor(block_ids, dtype=torch.long, device=self._pool.device)
        torch.index_select(self._pool, 0, index, out=self.chunk_view(target, len(block_ids)))
        if self._bounce is not None:
            slot[:nbytes].copy_(self._bounce[:nbytes])
        return slot[:nbytes]

    def scatter(self, slot: torch.Tensor, block_ids: list[int]) -> None:
        """Copy the first len(block_ids) blocks of `slot` into the pool at `block_ids`."""
        source = slot
        if self._bounce is not None:
            nbytes = len(block_ids) * self.layout.bytes_per_block
            self._bounce[:nbytes].copy_(slot[:nbytes])
            source = self._bounce
        chunk = self.chunk_view(source, len(block_ids))
        if self._pool.is_cuda:
            index = torch.tensor(block_ids, dtype=torch.long, device=self._pool.device)
            self._pool.index_copy_(0, index, chunk)
            return
        # CPU index_copy_ runs at a third of memcpy speed; copying runs of consecutive ids
        # (what a fresh allocator hands out) as slices is memcpy-bound.
        for dst_start, src_start, length in contiguous_runs(block_ids):
            self._pool[dst_start:dst_start + length].copy_(chunk[src_start:src_start + length])


def contiguous_runs(block_ids: list[int]) -> list[tuple[int, int, int]]:
    """(first id, position in block_ids, length) of each run of consecutive ids."""
    runs: list[tuple[int, int, int]] = []
    for position, block_id in enumerate(block_ids):
        if runs and runs[-1][0] + runs[-1][2] == block_id:
            first, start, length = runs[-1]
            runs[-1] = (first, start, length + 1)
        else:
            runs.append((block_id, position, 1))
    return runs


class Digest:
    """Order-sensitive checksum of a payload, updated chunk by chunk (both ends compute it).

    Folds one int64 sum per block into a polynomial hash, so a block landing in the wrong
    position changes the digest, and so does any flipped word.
    """

    _MODULUS = (1 << 61) - 1

    def __init__(self) -> None:
        self.value = 0

    def update(self, chunk: torch.Tensor, num_blocks: int) -> None:
        # [nbytes] uint8 -> [k, words]; a block is 2 * layers * elems * itemsize bytes, always a
        # multiple of 4
        assert chunk.numel() % 4 == 0, f"chunk of {chunk.numel()} bytes is not word-aligned"
        words = chunk.view(torch.int32).view(num_blocks, -1)
        block_sums = torch.sum(words, dim=1, dtype=torch.int64).tolist()
        for block_sum in block_sums:
            self.value = (self.value * 1_000_003 + block_sum) % self._MODULUS
