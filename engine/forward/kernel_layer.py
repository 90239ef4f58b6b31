"""Whole decoder layers as one CPU kernel call each (engine/kernels/csrc/layer.c), float32 or bfloat16 on CPU.

After engine/forward/fused.py and engine/forward/dense.py, a Llama-shaped layer's step is already the CPU kernels'
work: two norms, four GEMMs, rotary, the attention kernels, SiLU times up. What is left around
them is Python: about twenty module calls, torch ops and ctypes calls per layer (two residual
sums, two `index_put_` for the new K/V, views, allocations), 3-4 ms of a 16-row decode step on
SmolLM2 (docs/engine_speed.md, "One call per layer"). `KernelLayer` makes the layer one ctypes
call: the same kernels in the same order on the same buffers, so the same bits. The layer's dtype
(`Shape.dtype`) is its weights': float32 on the float32 GEMM, bfloat16 where the bfloat16 GEMM runs (AMX
tiles, or AVX512-BF16's vdpbf16ps: docs/engine_speed.md, "One call per layer", "bfloat16
linears"); the pool and every scratch buffer share it.

A layer is swapped only where all of it is the kernels' (a `FusedAttention` with the rotary
kernel, a `FusedMLP` with the SiLU kernel, both norms on the RMSNorm kernel, every linear on the
GEMM's panels), in a layer class known to be `x + attn(norm1(x))` then `y + mlp(norm2(y))`
(`LAYER_TYPES`), and where a scratch step through it (decode rows and prefill chunks, written
into a scratch pool) gives the module path's output and pool bit for bit. A step it does not take
(its decode rows in SDPA groups, prefill chunks without the prefill kernel, more rows than the
GEMM takes, a traced forward) runs the module path, unchanged.

`StepArgs` is built once per step, by the first layer, and shared by the others: the pool, the
new tokens' slots, the decode rows' tables, the prefill chunks, the rotary tables and scratch
buffers for the step's rows.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch
from torch import nn

from engine.forward import attention, dense, features, fused
from engine.kernels import cpu_kernel
from engine.kernels import kernel_checks as checks
from engine.kernels.abi import LayerArgs, StepArgs

log = logging.getLogger(__name__)

# decoder layers whose forward is exactly residual + attention(norm), residual + mlp(norm)
LAYER_TYPES = frozenset({"LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "SmolLM3DecoderLayer"})

@dataclass(frozen=True)
class Shape:
    hidden: int
    heads: int
    kv_heads: int
    dim: int
    inter: int
    dtype: torch.dtype = torch.float32  # the weights', the pool's and every buffer's


@dataclass
class Step:
    """A step's `StepArgs` and the tensors its addresses point into (kept alive with it)."""

    args: StepArgs
    cos: torch.Tensor  # the rotary table it was built for: each forward hands its layers a new one
    shape: Shape  # the layer shape its scratch buffers are sized for
    outs: tuple[torch.Tensor, torch.Tensor]  # [1, T, hidden] each: the layers' outputs in turn
    keep: tuple

    def out_for(self, x: torch.Tensor) -> torch.Tensor:
        """The output buffer for a layer whose input is x: the one x is not, so a layer's output is
        the next one's input and no layer allocates (the model keeps only the latest hidden states;
        a probe runs the modules)."""
        return self.outs[1] if x is self.outs[0] else self.outs[0]


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _build_step(meta: attention.StepMetadata, shape: Shape, cos: torch.Tensor, sin: torch.Tensor) -> Step:
    """cos/sin `[1, T, dim]`: the rotary tables this forward hands every layer. The step's slots and
    block tables are checked here, once for every layer (engine/kernels/kernel_checks.py)."""
    tokens = cos.shape[1]
    kv = meta.kv
    checks.require(tuple(kv.shape[4:]) == (shape.kv_heads, shape.dim),
                   lambda: f"layer kernel: a pool of {tuple(kv.shape[4:])} KV heads x dims for layers of "
                   f"{(shape.kv_heads, shape.dim)}")
    _check_step(meta)
    widths = (shape.hidden, (shape.heads + 2 * shape.kv_heads) * shape.dim, shape.heads * shape.dim,
              2 * shape.inter, shape.inter, shape.hidden)
    scratch = torch.empty(tokens * (sum(widths) + 2 * shape.hidden), dtype=kv.dtype)
    buffers, at = [], 0
    for width in widths:
        buffers.append(scratch[at:at + tokens * width].data_ptr())
        at += tokens * width
    outs = tuple(scratch[at:].view(2, 1, tokens, shape.hidden).unbind(0))
    chunks = torch.tensor([[c.start, c.end, c.first_pos, c.table.data_ptr()] for c in meta.prefills],
                          dtype=torch.int64).reshape(-1, 4)
    rows = meta.decode_rows
    args = StepArgs(kv.data_ptr(), kv.stride(0), kv.stride(1), kv.stride(3),
                    meta.slot_blocks.data_ptr(), meta.slot_offsets.data_ptr(),
                    _ptr(rows.tables) if rows else None, _ptr(rows.lens) if rows else None,
                    rows.tables.stride(0) if rows else 0, chunks.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                    *buffers, tokens, rows.lens.shape[0] if rows else 0, len(meta.prefills), kv.shape[3],
                    torch.get_num_threads(), cpu_kernel.DTYPES[kv.dtype])
    return Step(args, cos, shape, outs, (scratch, chunks, cos, sin, [c.table for c in meta.prefills]))


def _check_step(meta: attention.StepMetadata) -> None:
    num_blocks, block_size = meta.kv.shape[0], meta.kv.shape[3]
    checks.slots(meta.slot_blocks, meta.slot_offsets, num_blocks, block_size)
    if meta.decode_rows is not None:
        checks.decode_tables(meta.decode_rows.tables, meta.decode_rows.lens, num_blocks, block_size)
    for c in meta.prefills:
        checks.prefill_table(c.table, c.first_pos, c.end - c.start, num_blocks, block_size)


def _kernels_take(meta: attention.StepMetadata, tokens: int, dtype: torch.dtype) -> bool:
    """Whether every attention of this step goes through the CPU kernels, on an unpadded pool of `dtype`."""
    rows = meta.decode_rows
    return (not meta.decode_groups and (not meta.prefills or meta.prefill_kernel is not None)
            and meta.slot_blocks.shape[0] == tokens and meta.kv.dtype == dtype
            and all(t.dtype == torch.int64 and t.is_contiguous() for t in (meta.slot_blocks, meta.slot_offsets))
            and meta.kv.device.type == "cpu" and meta.kv.is_contiguous()
            and all(c.table is not None and c.table.dtype == torch.int64 and c.table.is_contiguous()
                    and c.table.shape[0] * meta.kv.shape[3] >= c.end - c.start + c.first_pos for c in meta.prefills)
            and (rows is None or (rows.tables.dtype == rows.lens.dtype == torch.int64 and rows.tables.stride(1) == 1
                                  and rows.lens.is_contiguous())))


class KernelLayer:
    """A decoder layer's forward (set on the module as its `forward`): one `pd_layer_forward` call
    where the step allows, the module's own forward otherwise. The module keeps its children, so
    everything that walks the model sees the layer it was."""

    def __init__(self, layer: nn.Module, args: LayerArgs, shape: Shape, kernel: cpu_kernel.LayerKernel,
                 max_rows: int | None):
        self.module_forward = layer.forward  # the module path; the module holds what args points into
        self.args, self.shape, self.kernel = args, shape, kernel
        self.max_rows = max_rows  # the GEMM's cut (None: every product)

    def __call__(self, hidden_states: torch.Tensor, *args, position_embeddings=None, **kwargs) -> torch.Tensor:
        step = self._step(hidden_states, position_embeddings)
        if step is None:
            return self.module_forward(hidden_states, *args, position_embeddings=position_embeddings, **kwargs)
        out = step.out_for(hidden_states)
        self.kernel(self.args, step.args, hidden_states, out)
        return out

    def _step(self, x: torch.Tensor, position_embeddings, decoder: bool = False) -> Step | None:
        """The step's arguments where this layer's call can take it, else None (the module runs).
        `decoder`: for `pd_decoder_forward`, which also takes steps past the GEMM's cut where it runs
        them as one region (its GEMMs on tiles of at most 64 rows: layer_team.c)."""
        if not attention._current or position_embeddings is None or torch.compiler.is_compiling():
            return None
        meta, (cos, sin) = attention._current[-1], position_embeddings
        step = meta.kernel_step
        if step is None or step.cos is not cos or step.shape != self.shape:  # the forward's first layer
            tokens = cos.shape[1] if cos.dim() == 3 else 0
            wide = decoder and self.kernel.team_takes(tokens, torch.get_num_threads())
            if (features.active_probe() is not None or cos.dim() != 3 or cos.shape[0] != 1
                    or cos.shape[2] != self.shape.dim or sin.shape != cos.shape or cos.dtype != self.shape.dtype
                    or not (cos.is_contiguous() and sin.is_contiguous())
                    or not self._fits(x, tokens, wide) or not _kernels_take(meta, tokens, self.shape.dtype)):
                return None
            step = meta.kernel_step = _build_step(meta, self.shape, cos, sin)
            return step
        # later layers: the step is checked; an input that is the previous layer's output fits
        if x is step.outs[0] or x is step.outs[1]:
            return step if self.max_rows is None or step.args.tokens <= self.max_rows else None
        return step if self._fits(x, step.args.tokens) else None

    def _fits(self, x: torch.Tensor, tokens: int, wide: bool = False) -> bool:
        """x is `[1, tokens, hidden]` of the layer's dtype on the CPU, contiguous, within the GEMM's cut
        (or past it, `wide`)."""
        return ((wide or self.max_rows is None or tokens <= self.max_rows) and x.shape == (1, tokens, self.shape.hidden)
                and x.dtype == self.shape.dtype and x.device.type == "cpu" and x.is_contiguous())


def _gemm_only(linears: list[nn.Module]) -> tuple[bool, int | None]:
    """Whether each linear is on the GEMM's panels, and the most rows all of them take there."""
    if not all(isinstance(m, dense.PackedLinear) and m.gemm is not None and m.panels is not None
               and (m.bias is None or m.bias.is_contiguous()) for m in linears):
        return False, None
    cuts = {m.small_rows if m.packed is not None else None for m in linears}
    return len(cuts) == 1, cuts.pop()


def layer_args(layer: nn.Module) -> tuple[LayerArgs, Shape, int | None] | None:
    """The kernel's arguments for `layer`, or None where the layer is not all the kernels'."""
    if type(layer).__name__ not in LAYER_TYPES or {n for n, _ in layer.named_children()} != {
            "self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}:
        return None
    attn, mlp, norm1, norm2 = layer.self_attn, layer.mlp, layer.input_layernorm, layer.post_attention_layernorm
    dtype = norm1.weight.dtype
    if not (isinstance(attn, fused.FusedAttention) and attn.rope is not None and isinstance(mlp, fused.FusedMLP)
            and mlp.silu_mul is not None and dtype in cpu_kernel.DTYPES
            and all(isinstance(n, dense.FusedRMSNorm) and n.kernel is not None and n.weight.dtype == dtype
                    and n.weight.is_contiguous() for n in (norm1, norm2))):
        return None
    linears = [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]
    gemm_only, max_rows = _gemm_only(linears)
    if not gemm_only or any(m.gemm.dtype != dtype for m in linears):
        return None
    shape = Shape(norm1.normalized_shape[0], attn.heads, attn.kv_heads, attn.head_dim, mlp.intermediate, dtype)
    checks.require(shape.kv_heads > 0 and shape.heads % shape.kv_heads == 0,
                   lambda: f"layer kernel: {shape.heads} query heads are no multiple of {shape.kv_heads} KV heads")
    scaling = attn.call.get("scaling")
    args = LayerArgs(norm1.weight.data_ptr(), attn.qkv_proj.panels.data_ptr(), _ptr(attn.qkv_proj.bias),
                     attn.o_proj.panels.data_ptr(), _ptr(attn.o_proj.bias), norm2.weight.data_ptr(),
                     mlp.gate_up_proj.panels.data_ptr(), _ptr(mlp.gate_up_proj.bias), mlp.down_proj.panels.data_ptr(),
                     _ptr(mlp.down_proj.bias), norm1.eps, norm2.eps,
                     float(scaling) if scaling is not None else attn.head_dim ** -0.5,
                     float(attn.call.get("softcap") or 0.0), attn.layer_idx, shape.hidden, shape.heads,
                     shape.kv_heads, shape.dim, shape.inter, int(attn.call.get("sliding_window") or 0))
    return args, shape, max_rows


def _probe_step(kernels: cpu_kernel.Kernels, shape: Shape, layers: int, tokens_of: list[tuple[int, int]],
                generator: torch.Generator) -> attention.StepMetadata:
    """A step over a scratch pool of random keys: for each (first position, queries) of `tokens_of`,
    one query is a decode row and more are a prefill chunk (decode rows first, as the runner orders them)."""
    block_size = 4
    blocks = max(64, sum(-(-(p + q) // block_size) for p, q in tokens_of))  # every request's blocks fit
    kv = torch.randn(blocks, layers, 2, block_size, shape.kv_heads, shape.dim, generator=generator).to(shape.dtype)
    free = torch.randperm(blocks, generator=generator).tolist()
    decodes = [(p, q) for p, q in tokens_of if q == 1]
    chunks = [(p, q) for p, q in tokens_of if q > 1]
    width = max(-(-(p + q) // block_size) for p, q in tokens_of)
    slot_blocks, slot_offsets, tables, prefills = [], [], [], []
    row = 0
    for first, queries in decodes + chunks:
        table = [free.pop() for _ in range(-(-(first + queries) // block_size))]
        for pos in range(first, first + queries):
            slot_blocks.append(table[pos // block_size])
            slot_offsets.append(pos % block_size)
        if queries == 1:
            tables.append(table + [0] * (width - len(table)))
        else:
            prefills.append(attention.PrefillChunk(row, row + queries, None, None, table=torch.tensor(table),
                                                   first_pos=first))
        row += queries
    rows = attention.DecodeRows(kernels.decode, torch.tensor(tables).reshape(len(decodes), width),
                                torch.tensor([p + 1 for p, _ in decodes], dtype=torch.int64)) if decodes else None
    return attention.StepMetadata(kv, torch.tensor(slot_blocks), torch.tensor(slot_offsets), [], prefills,
                                  decode_rows=rows, prefill_kernel=kernels.prefill)


# scratch steps a swapped layer must match: decode rows alone; decode rows with a fresh prompt and
# a chunk after cached context
PROBE_STEPS = ([(8, 1)], [(0, 1), (5, 1), (12, 1), (0, 3), (5, 7)])


@torch.inference_mode()
def _same_as_module(layer: nn.Module, candidate: KernelLayer, kernels: cpu_kernel.Kernels) -> bool:
    """The layer's module forward and one kernel call, on each scratch step: same output, same pool."""
    generator = torch.Generator().manual_seed(0)
    shape = candidate.shape
    for tokens_of in PROBE_STEPS:
        tokens = sum(q for _, q in tokens_of)
        if candidate.max_rows is not None and tokens > candidate.max_rows:
            continue
        meta = _probe_step(kernels, shape, int(candidate.args.layer) + 1, tokens_of, generator)
        x = torch.randn(1, tokens, shape.hidden, generator=generator).to(shape.dtype)
        angles = torch.rand(1, tokens, shape.dim // 2, generator=generator) * 100.0
        angles = torch.cat((angles, angles), dim=-1)
        position_embeddings = (angles.cos().to(shape.dtype), angles.sin().to(shape.dtype))
        outs, pools = [], []
        for module in (layer, candidate):
            run = dataclasses.replace(meta, kv=meta.kv.clone())
            with attention.step_context(run):
                outs.append(module(x, attention_mask=None, position_embeddings=position_embeddings))
            pools.append(run.kv)
        if run.kernel_step is None:  # the kernel did not take the step it must take
            return False
        if not (torch.equal(outs[0], outs[1]) and torch.equal(pools[0], pools[1])):
            return False
    return True


def swap_layers(model: nn.Module, kernels: cpu_kernel.Kernels) -> int:
    """Give each decoder layer of `model` that is all the kernels' and whose one call gives its
    module's outputs bit for bit on the scratch steps a `KernelLayer` as its forward; returns how many."""
    layers = getattr(model.get_decoder(), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        return 0
    swapped = 0
    for i, layer in enumerate(layers):
        if isinstance(layer.forward, KernelLayer):  # swapped before
            swapped += 1
            continue
        found = layer_args(layer)
        if found is None:
            continue
        candidate = KernelLayer(layer, *found[:2], kernels.layer, found[2])
        try:
            same = _same_as_module(layer, candidate, kernels)
        except Exception as exc:  # noqa: BLE001 - a layer the check cannot run is served as it is
            log.info("decoder layer %d stays a module: its check failed (%s: %s)", i, type(exc).__name__, exc)
            continue
        if not same:
            log.info("decoder layer %d stays a module: one call does not give its outputs bit for bit", i)
            continue
        layer.forward = candidate
        swapped += 1
    return swapped
