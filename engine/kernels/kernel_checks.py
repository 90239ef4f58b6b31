"""Checks at the CPU kernels' Python boundary (engine/kernels/cpu_kernel.py, cpu_ops.py, cpu_gemm.py and the
step of engine/forward/kernel_layer.py).

C indexes with what it is handed, so a block id outside the pool, a length past its table, a head
count that does not divide, or a dtype, shape or stride a kernel does not take is a
`KernelArgumentError` naming the value, raised before any C runs: never an `assert` (`python -O`
drops those), never a read of another request's blocks. The block tables' values are checked with a
few reductions over small tensors; the decode kernel checks a step's tables once, not once a layer
(`Memo`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # what the attention and layer kernels take, and their C code for it


class KernelArgumentError(ValueError):
    """A value a CPU kernel cannot take; the message names it."""


def require(ok: bool, message: Callable[[], str]) -> None:
    """KernelArgumentError(message()) unless ok; the message is built only then (checks run per call)."""
    if not ok:
        raise KernelArgumentError(message())


def rows_of(name: str, x: torch.Tensor, dtypes: tuple[torch.dtype, ...]) -> None:
    """x is a CPU matrix of one of `dtypes` whose rows are contiguous."""
    require(x.device.type == "cpu", lambda: f"{name}: the CPU kernels take CPU tensors, not {x.device}")
    require(x.dtype in dtypes, lambda: f"{name}: dtype {x.dtype}, not one of {', '.join(map(str, dtypes))}")
    require(x.dim() == 2 and x.stride(1) == 1, lambda: f"{name}: a matrix with contiguous rows, not shape "
                                               f"{tuple(x.shape)} strides {x.stride()}")


def at_least(name: str, t: torch.Tensor, numel: int) -> None:
    require(t.is_contiguous() and t.numel() >= numel, lambda: f"{name}: {t.numel()} elements"
            f"{'' if t.is_contiguous() else ' (not contiguous)'}, needs {numel} contiguous")


def attention(name: str, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              out: torch.Tensor) -> None:
    """query and out `[n, H, D]`, k/v_cache `[blocks, block_size, KVH, D]`: one dtype the kernels take,
    on the CPU, H a multiple of KVH, the last dim of each contiguous and the two caches alike. One
    expression where all is well (once a layer); the messages only where it is not."""
    if (query.dim() == 3 and out.shape == query.shape and k_cache.dim() == 4 and k_cache.shape == v_cache.shape
            and k_cache.stride() == v_cache.stride() and query.dtype in DTYPES
            and query.dtype == k_cache.dtype == v_cache.dtype == out.dtype
            and query.is_cpu and k_cache.is_cpu and v_cache.is_cpu and out.is_cpu
            and k_cache.shape[3] == query.shape[2] and k_cache.shape[2] > 0 and query.shape[1] % k_cache.shape[2] == 0
            and query.stride(2) == k_cache.stride(3) == out.stride(2) == 1):
        return
    _attention_error(name, query, k_cache, v_cache, out)


def _attention_error(name: str, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     out: torch.Tensor) -> None:
    require(query.dim() == 3 and out.shape == query.shape,
            lambda: f"{name}: query {tuple(query.shape)} and out {tuple(out.shape)} must be one [tokens, heads, dim]")
    require(k_cache.dim() == 4 and k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride(),
            lambda: f"{name}: k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must be [blocks, "
            "block_size, kv_heads, dim] views alike")
    dtypes = {query.dtype, k_cache.dtype, v_cache.dtype, out.dtype}
    require(len(dtypes) == 1 and query.dtype in DTYPES,
            lambda: f"{name}: query, caches and out of one dtype, float32 or bfloat16, not {sorted(map(str, dtypes))}")
    require(all(t.is_cpu for t in (query, k_cache, v_cache, out)), lambda: f"{name}: CPU tensors only")
    heads, dim = query.shape[1:]
    kv_heads = k_cache.shape[2]
    require(k_cache.shape[3] == dim, lambda: f"{name}: head dim {dim} of the query, {k_cache.shape[3]} of the cache")
    require(kv_heads > 0 and heads % kv_heads == 0,
            lambda: f"{name}: {heads} query heads are no multiple of {kv_heads} KV heads")
    raise KernelArgumentError(f"{name}: the head dim of query, caches and out must be contiguous")


def decode_tables(tables: torch.Tensor, lens: torch.Tensor, num_blocks: int, block_size: int) -> None:
    """tables `[n, width]` int64 (rows of contiguous block ids), lens `[n]` int64: each row's length in
    1 .. width * block_size and the ids its keys sit in (the first ceil(len / block_size)) in
    0 .. num_blocks - 1; the ids past them are never read."""
    name = "decode kernel"
    require(tables.dtype == lens.dtype == torch.int64,
            lambda: f"{name}: tables and lens must be int64, not {tables.dtype} and {lens.dtype}")
    require(tables.dim() == 2 and lens.shape == tables.shape[:1] and tables.stride(1) == 1 and lens.is_contiguous(),
            lambda: f"{name}: tables [rows, width] with contiguous rows and lens [rows], not {tuple(tables.shape)} and "
            f"{tuple(lens.shape)}")
    if lens.numel() == 0:
        return
    width = tables.shape[1]
    shortest, longest = (int(v) for v in torch.aminmax(lens))
    require(shortest >= 1, lambda: f"{name}: a row of length {shortest}; every decode row sees at least its own key")
    require(longest <= width * block_size, lambda: f"{name}: a row of length {longest} > its table's {width} blocks "
                                           f"x {block_size} keys")
    read = torch.arange(width) < ((lens + block_size - 1) // block_size)[:, None]  # [n, width]: the ids read
    _block_ids(name, tables[read], num_blocks, tables, read)


def prefill_table(table: torch.Tensor, first_pos: int, n: int, num_blocks: int, block_size: int) -> None:
    """A chunk of n queries at positions first_pos ..: table `[>= ceil((first_pos + n) / block_size)]`
    contiguous int64, the ids its keys sit in within the pool."""
    name = "prefill kernel"
    require(table.dtype == torch.int64 and table.dim() == 1 and table.is_contiguous(),
            lambda: f"{name}: the block table must be one contiguous int64 row, not {table.dtype} {tuple(table.shape)}")
    require(first_pos >= 0 and n >= 0, lambda: f"{name}: a chunk at position {first_pos} of {n} queries")
    need = -(-(first_pos + n) // block_size)
    require(table.shape[0] >= need, lambda: f"{name}: a table of {table.shape[0]} blocks for keys up to position "
                                     f"{first_pos + n - 1}, which need {need} blocks of {block_size}")
    if need:
        _block_ids(name, table[:need], num_blocks)


def slots(slot_blocks: torch.Tensor, slot_offsets: torch.Tensor, num_blocks: int, block_size: int) -> None:
    """The new tokens' KV slots, written by C: blocks within the pool, offsets within a block."""
    require(slot_blocks.dtype == slot_offsets.dtype == torch.int64 and slot_blocks.shape == slot_offsets.shape,
            lambda: f"KV write: slot blocks and offsets of one shape, int64, not {slot_blocks.dtype} {tuple(slot_blocks.shape)}"
            f" and {slot_offsets.dtype} {tuple(slot_offsets.shape)}")
    if slot_blocks.numel():
        _block_ids("KV write", slot_blocks, num_blocks)
        low, high = (int(v) for v in torch.aminmax(slot_offsets))
        require(0 <= low and high < block_size, lambda: f"KV write: slot offset {low if low < 0 else high} outside "
                                                f"a block of {block_size}")


def _block_ids(name: str, ids: torch.Tensor, num_blocks: int, tables: torch.Tensor | None = None,
               read: torch.Tensor | None = None) -> None:
    low, high = (int(v) for v in torch.aminmax(ids))
    if 0 <= low and high < num_blocks:
        return
    bad = low if low < 0 else high
    where = ""
    if tables is not None:  # the error path only: which row
        row = int(((tables == bad) & read).any(1).nonzero()[0])
        where = f" in row {row}"
    short = " (a table shorter than its row's length, padded)" if bad == -1 else ""
    raise KernelArgumentError(f"{name}: block id {bad}{where} outside the pool's {num_blocks} blocks{short}")


class Memo:
    """The last tensors a check passed, with their in-place version counts (inference tensors, which
    have none: the same tensor): the layers of one step hand the kernel the same tables, checked once
    (the engine builds a step's tables anew and never writes them). Holding them keeps their ids from
    being reused."""

    def __init__(self) -> None:
        self._last: tuple = ()

    @staticmethod
    def _key(*values) -> tuple:
        return tuple((v, _version(v)) if isinstance(v, torch.Tensor) else (v, None) for v in values)

    def seen(self, *values) -> bool:
        key = self._key(*values)
        return len(key) == len(self._last) and all(
            (a is b if isinstance(a, torch.Tensor) else a == b) and va == vb
            for (a, va), (b, vb) in zip(key, self._last, strict=True))

    def remember(self, *values) -> None:
        self._last = self._key(*values)


def _version(t: torch.Tensor) -> int | None:
    return None if t.is_inference() else t._version
