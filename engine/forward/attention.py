"""Paged attention plugged into transformers through its attention-function registry.

The runner flattens every scheduled token of every sequence into one row (`[1, T]`), decode
tokens first. `StepMetadata` is built once per step, shared by all layers, and held for the
step's forward by `step_context`. Each layer calls the custom op `pdserve::paged_attention`,
which reads the metadata from there, writes the new K/V into their slots of the pool, then attends:
- decode tokens with the CPU decode kernel (engine/kernels/cpu_kernel.py: every row straight from its
  blocks, no copy, no padding), or without it in a few padded SDPA calls, grouped by context
  length (little padding);
- each prefill chunk over its own context: by the CPU prefill kernel straight from the pool
  (tiled, the causal half skipped), or by SDPA (fresh prompts straight from K/V, causal; a
  chunk after cached context over its gathered blocks with a mask).
A decode-only step padded to a CUDA-graph bucket (engine/forward/switchboard.py) has more rows than slots:
the rows past the step's tokens write no KV and come out as zeros.

The op is opaque to torch.compile: its inputs and output are plain tensors of fixed rank whose
only changing size is the token count, so a compiled forward traces everything around it
(projections, norms, rotary, MLP) and calls it as one node, and a changing batch never
recompiles. The pool write is a side effect the compiler never sees, which is safe because every
read of the pool happens inside the op too.

Per-layer attention features arrive as the keyword arguments transformers' modules pass and
reach the op as plain scalars (0 = off): `scaling` (Gemma's `query_pre_attn_scalar`, Granite's
multiplier), `sliding_window` (the key positions a query at position t sees are (t - window, t],
as transformers' masks say) and `softcap` (Gemma 2: tanh(scores / cap) * cap before the softmax).
A window picks the step's mask built for that window size (`window_masks`, one per distinct
size, shared by all layers); a softcap, which SDPA lacks, takes an explicit matmul / softmax
path. A model without either builds no extra mask and runs exactly the plain SDPA path, eager
or compiled alike. At load one token runs under an `AttentionProbe` (engine/forward/features.py) to
learn each layer's features.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from engine.forward import features
from engine.kernels import cpu_kernel

ATTN_IMPLEMENTATION = "pdserve_paged"


@dataclass
class PrefillChunk:
    start: int  # query range [start, end) in the flattened row
    end: int
    ctx_blocks: torch.Tensor | None  # [ceil(ctx / bs)] blocks holding all keys; None = fresh prompt (keys == chunk)
    mask: torch.Tensor | None  # [q, ctx_blocks * bs] bool, True = attend; None = plain causal
    window_masks: dict[int, torch.Tensor | None] = field(default_factory=dict)  # window -> [q, keys] bool; None = causal
    # for the CPU prefill kernel instead (no masks, no gather): the sequence's blocks holding keys
    # 0 .. its last query, int64 on the CPU, and the position of the chunk's first query
    table: torch.Tensor | None = None
    first_pos: int = 0


@dataclass
class DecodeGroup:
    """Decode rows [start, end) of similar context length, attended in one padded call."""

    start: int
    end: int
    blocks: torch.Tensor  # [B, max_blocks] each row's block table, padded
    mask: torch.Tensor  # [B, 1, 1, max_blocks * block_size] bool, True = real key
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)  # window -> keys inside it, same shape


@dataclass
class DecodeRows:
    """Every decode row of a step, for the CPU decode kernel: rows [0, n) of the flattened row."""

    kernel: cpu_kernel.DecodeKernel
    tables: torch.Tensor  # [n, max_blocks] int64, each row's block table (padding never read)
    lens: torch.Tensor  # [n] int64, the keys each row sees: its context, its new token included


@dataclass
class StepMetadata:
    kv: torch.Tensor  # [num_blocks, layers, 2, block_size, kv_heads, head_dim]
    slot_blocks: torch.Tensor  # [T] block of each new token
    slot_offsets: torch.Tensor  # [T] its position in that block
    decode_groups: list[DecodeGroup]  # decode tokens come first in the row, by context length
    prefills: list[PrefillChunk]
    decode_rows: DecodeRows | None = None  # instead of decode_groups, where the kernel runs
    prefill_kernel: cpu_kernel.PrefillKernel | None = None  # attends every prefill chunk, where it runs
    kernel_step: Any = None  # engine/forward/kernel_layer.py's arguments for this step, built by its first layer


_current: list[StepMetadata] = []  # the step being computed (a stack of at most one)


@contextlib.contextmanager
def step_context(meta: StepMetadata) -> Iterator[None]:
    """Make `meta` the metadata every layer's attention reads during one forward."""
    _current.append(meta)
    try:
        yield
    finally:
        _current.pop()


def paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                    sliding_window: int | None = None, softcap: float | None = None, **kwargs):
    """transformers' attention-function signature -> the opaque op; returns `[1, T, H, D]`."""
    probe = features.active_probe()
    if probe is not None:
        return probe.record(module, query, key, value, attention_mask, scaling, sliding_window, softcap, kwargs)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    return torch.ops.pdserve.paged_attention(query, key, value, module.layer_idx, float(scaling),
                                             int(sliding_window or 0), float(softcap or 0.0)), None


# cudagraph_unsafe: a CUDA-graph capture (engine.cuda_graphs) partitions the graph around it,
# since its work depends on per-step metadata that lives in Python, not in the graph's tensors
@torch.library.custom_op("pdserve::paged_attention", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def paged_attention_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer_idx: int,
                       scaling: float, sliding_window: int, softcap: float) -> torch.Tensor:
    """query `[1, H, T, D]`, key/value `[1, KVH, T, D]` -> `[1, T, H, D]`; writes K/V to the pool.
    `sliding_window` / `softcap`: 0 = none."""
    assert _current, "paged attention runs only inside attention.step_context(meta)"
    paged = _current[-1]
    _, num_heads, num_tokens, head_dim = query.shape
    k_cache = paged.kv[:, layer_idx, 0]  # [blocks, block_size, KVH, D], a strided view
    v_cache = paged.kv[:, layer_idx, 1]
    where = (paged.slot_blocks, paged.slot_offsets)
    real = paged.slot_blocks.shape[0]  # rows past the step's tokens pad it to a CUDA-graph bucket
    k_cache.index_put_(where, key[0, :, :real].transpose(0, 1).to(k_cache.dtype))
    v_cache.index_put_(where, value[0, :, :real].transpose(0, 1).to(v_cache.dtype))

    out = query.new_empty(1, num_tokens, num_heads, head_dim)
    if real < num_tokens:
        out[0, real:] = 0  # padding rows attend to nothing; zeros keep them finite
    rows = paged.decode_rows  # None without decode rows or without the kernel
    if rows is not None:
        n = rows.lens.shape[0]
        rows.kernel(_token_major(query, 0, n), k_cache, v_cache, rows.tables, rows.lens, out[0, :n], scaling,
                    sliding_window, softcap)
    for group in paged.decode_groups:
        mask = group.window_masks[sliding_window] if sliding_window else group.mask
        _decode(query, k_cache, v_cache, group, mask, scaling, softcap, out[0])
    for chunk in paged.prefills:
        if paged.prefill_kernel is not None:
            paged.prefill_kernel(_token_major(query, chunk.start, chunk.end), k_cache, v_cache, chunk.table,
                                 chunk.first_pos, out[0, chunk.start:chunk.end], scaling, sliding_window, softcap)
            continue
        mask = chunk.window_masks[sliding_window] if sliding_window else chunk.mask
        _prefill(query, key, value, k_cache, v_cache, chunk, mask, scaling, softcap, out[0])
    return out


@paged_attention_op.register_fake
def _(query, key, value, layer_idx, scaling, sliding_window, softcap):
    return query.new_empty(1, query.shape[2], query.shape[1], query.shape[3])


def _token_major(query: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Tokens [start, end) of `query` `[1, H, T, D]` as `[n, H, D]` for the CPU kernels: a view, copied
    only when its last dim is not contiguous."""
    q = query[0, :, start:end].transpose(0, 1)
    return q if q.stride(2) == 1 else q.contiguous()


def window_mask(queries: torch.Tensor, keys: torch.Tensor, window: int) -> torch.Tensor:
    """`[q, k]` bool: query position t sees key position p iff t - window < p <= t."""
    delta = queries[:, None] - keys[None, :]
    return (delta >= 0) & (delta < window)


def _decode(query, k_cache, v_cache, group: DecodeGroup, mask, scale, softcap, out) -> None:
    n = group.end - group.start
    num_heads, head_dim = query.shape[1], query.shape[3]
    num_kv_heads = k_cache.shape[2]
    # one query per head; heads sharing a KV head ride together as a [G, D] "query block" so
    # the gathered K/V is never expanded to all heads (GQA without repeat_kv)
    q = query[0, :, group.start:group.end].transpose(0, 1)
    q = q.reshape(n, num_kv_heads, num_heads // num_kv_heads, head_dim)  # [B, KVH, G, D]
    flat = group.blocks.view(-1)  # whole blocks: one contiguous copy each
    k = k_cache.index_select(0, flat).view(n, -1, num_kv_heads, head_dim).transpose(1, 2)  # [B, KVH, ctx, D]
    v = v_cache.index_select(0, flat).view(n, -1, num_kv_heads, head_dim).transpose(1, 2)
    if softcap:
        o = _softcapped(q, k, v, mask, scale, softcap)
    else:
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)  # [B, KVH, G, D]
    out[group.start:group.end] = o.reshape(n, num_heads, head_dim)


def _prefill(query, key, value, k_cache, v_cache, chunk: PrefillChunk, mask, scale, softcap, out) -> None:
    q = query[:, :, chunk.start:chunk.end]  # [1, H, q, D]
    if chunk.ctx_blocks is None:
        k = key[:, :, chunk.start:chunk.end]  # [1, KVH, q, D]
        v = value[:, :, chunk.start:chunk.end]
    else:
        kvh, d = k_cache.shape[2], k_cache.shape[3]
        k = k_cache.index_select(0, chunk.ctx_blocks).view(-1, kvh, d).transpose(0, 1).unsqueeze(0)  # [1, KVH, ctx, D]
        v = v_cache.index_select(0, chunk.ctx_blocks).view(-1, kvh, d).transpose(0, 1).unsqueeze(0)
    if softcap:
        n_q, n_kv = q.shape[2], k.shape[2]
        if mask is None:  # a fresh prompt: plain causal
            mask = torch.ones(n_q, n_kv, dtype=torch.bool, device=q.device).tril()
        # heads sharing a KV head as one group: [1, KVH, G, q, D] against [1, KVH, 1, ctx, D]
        grouped = q.view(1, k.shape[1], -1, n_q, q.shape[3])
        o = _softcapped(grouped, k.unsqueeze(2), v.unsqueeze(2), mask, scale, softcap).flatten(1, 2)
    else:
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                           scale=scale, enable_gqa=True)
    out[chunk.start:chunk.end] = o[0].transpose(0, 1)


def _softcapped(q, k, v, mask, scale: float, softcap: float):
    """Attention with scores soft-capped to (-cap, cap) before the mask and softmax, in the order
    and precision of transformers' eager path (softmax in float32). `mask` True = attend."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


def _no_mask(*args, **kwargs):
    return None  # masking is done per sequence inside paged_attention


def register() -> str:
    """Make the paged implementation selectable by name; idempotent."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _no_mask)
    return ATTN_IMPLEMENTATION
