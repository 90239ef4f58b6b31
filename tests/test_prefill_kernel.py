"""The prefill attention kernel (engine/kernels/csrc/paged_prefill.c, and its AMX path in prefill_amx.c):
each query of a chunk attends as the decode row of its own position would, its bits depend on its
position only, never on how the prompt was chunked, and nothing the pool holds past the chunk
reaches an output. Each on float32, bfloat16 on AMX tiles (where this host has them) and bfloat16
on vectors."""

from __future__ import annotations

import pytest
import torch

from tests.kernel_util import KERNELS, WHY, attention_on
from tests.kernel_util import attention_reference as _reference

needs_kernel = pytest.mark.skipif(KERNELS is None or KERNELS.decode is None, reason=f"no CPU kernels here: {WHY}")


PREFILL_PATHS = pytest.mark.parametrize("dtype, amx", [(torch.float32, False), (torch.bfloat16, True),
                                                       (torch.bfloat16, False)],
                                        ids=["float32", "bfloat16-amx", "bfloat16-vectors"])


@pytest.fixture
def prefill_path(dtype, amx):
    """The prefill kernel with bfloat16 scores and values on AMX tiles (where this host has them), or
    on vectors; float32 chunks always take the vectors."""
    yield from attention_on(amx)


@needs_kernel
@PREFILL_PATHS
@pytest.mark.parametrize("first_pos, queries, heads, kv_heads, dim", [
    (0, 1, 6, 2, 64), (0, 7, 4, 4, 20), (0, 45, 9, 3, 64), (13, 1, 8, 1, 72), (30, 50, 6, 2, 64),
    (53, 11, 9, 3, 16), (5, 40, 8, 1, 72), (40, 70, 12, 4, 32), (3, 33, 4, 2, 128)])
@pytest.mark.parametrize("window, softcap", [(0, 0.0), (9, 0.0), (0, 5.0)])
def test_the_prefill_kernel_attends_each_query_over_the_keys_up_to_its_own(dtype, amx, first_pos, queries, heads,
                                                                           kv_heads, dim, window, softcap,
                                                                           prefill_path):
    """A chunk of `queries` queries at positions first_pos.. (a fresh prompt at 0, or after a cached
    prefix), keys scattered over the pool: each query attends as the decode row of its own
    position would. Tiles of 48 rows across several queries and heads, steps of 24 keys (32 where
    AMX takes bfloat16 chunks: head dims of a multiple of 32), partial tiles, windows, soft-caps,
    head dims off the vector width, one to eight heads per KV head."""
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # online softmax: rescaled sums
    torch.manual_seed(first_pos + queries + dim)
    layers, blocks, block_size = 2, 48, 4
    pool = torch.randn(blocks, layers, 2, block_size, kv_heads, dim).to(dtype)
    k_cache, v_cache = pool[:, 1, 0], pool[:, 1, 1]
    table = torch.randperm(blocks)[:-(-(first_pos + queries) // block_size)]
    query = torch.randn(1, heads, queries, dim).to(dtype)[0].transpose(0, 1)  # [q, H, D], strided like the op's
    out = torch.full((queries, heads, dim), float("nan"), dtype=dtype)
    KERNELS.prefill(query, k_cache, v_cache, table, first_pos, out, 0.3, window, softcap)
    lens = torch.arange(first_pos + 1, first_pos + queries + 1)
    expected = _reference(query, k_cache, v_cache, table.expand(queries, -1), lens, 0.3, window, softcap)
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol)


@needs_kernel
@PREFILL_PATHS
@pytest.mark.parametrize("window", [0, 21])
def test_a_prefill_querys_bits_depend_on_its_position_only_never_on_its_chunk(dtype, amx, window, prefill_path):
    """Chunked prefill, a prefix-cache hit and a re-prefill after migration cut a prompt at
    different places: each query's output is the same bits in any chunk (here one of 150 queries,
    and cuts of 1, 37, 48 and 64), on either path."""
    torch.manual_seed(11)
    heads, kv_heads, dim, block_size, n = 9, 3, 64, 16, 150
    pool = torch.randn(16, 2, block_size, kv_heads, dim).to(dtype)
    k_cache, v_cache = pool[:, 0], pool[:, 1]
    table = torch.randperm(16)[:-(-n // block_size)]
    query = torch.randn(n, heads, dim).to(dtype)
    whole = torch.empty(n, heads, dim, dtype=dtype)
    KERNELS.prefill(query, k_cache, v_cache, table, 0, whole, 0.125, window, 0.0)
    for cut in (1, 37, 48, 64):
        pieces = torch.empty_like(whole)
        for start in range(0, n, cut):
            stop = min(n, start + cut)
            KERNELS.prefill(query[start:stop], k_cache, v_cache, table, start, pieces[start:stop], 0.125, window, 0.0)
        assert torch.equal(pieces, whole), f"chunks of {cut}"


@needs_kernel
@PREFILL_PATHS
@pytest.mark.parametrize("block_size", [4, 16])  # 16: on AMX the keys' tiles load straight from the pool
def test_what_the_pool_holds_past_a_chunk_never_reaches_its_outputs(dtype, amx, block_size, prefill_path):
    """The slots past a chunk's last position (the rest of its last block: a finished request's
    stale keys, or none written yet) are never summed: NaN there gives every output the bits that
    zeros there give, for a fresh prompt and for a chunk after a cached prefix."""
    torch.manual_seed(5)
    heads, kv_heads, dim, n, blocks = 9, 3, 64, 41, 12
    pool = torch.randn(blocks, 2, block_size, kv_heads, dim).to(dtype)
    table = torch.randperm(blocks)[:-(-n // block_size)]
    query = torch.randn(n, heads, dim).to(dtype)
    outs = []
    for past in (0.0, float("nan")):
        filled = torch.full_like(pool, past)
        for p in range(n):
            filled[table[p // block_size], :, p % block_size] = pool[table[p // block_size], :, p % block_size]
        out = torch.empty(n, heads, dim, dtype=dtype)
        for start, stop in ((0, 17), (17, n)):  # the second chunk after a cached prefix of 17
            KERNELS.prefill(query[start:stop], filled[:, 0], filled[:, 1], table, start, out[start:stop], 0.125, 0, 0.0)
        outs.append(out)
    assert not outs[0].isnan().any()
    assert torch.equal(outs[1], outs[0])
