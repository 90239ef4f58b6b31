"""The decoder's loop as direct calls, for fused layers that are not one kernel call, and for the steps
the kernel decoder does not take (more rows than its GEMM's cut).

A decode step of a small model on CPU spends milliseconds in transformers' module machinery around
the work: the decoder's forward (masks, rotary, cache checks, output records), each layer's call
with its keyword arguments, and `nn.Module.__call__` around each of a layer's nine modules. Where
every layer is a Llama-shaped decoder layer (`kernel_layer.LAYER_TYPES`) whose attention and MLP
are fused (engine/forward/fused.py: `FusedAttention`, `FusedMLP`), this runs the same modules' forwards on
the same inputs in the same order: the embedding, the rotary (cos, sin) from the rotary module's
own table (`RotaryTable`), then per layer `x + attn(norm1(x))` and `x + mlp(norm2(x))`, as the
layer's forward writes them, and the final norm. Each residual add and the norm after it (the
next layer's input norm, or the final norm) run as one pass where the norm is fused
(`FusedRMSNorm.add`: the same add, the same norm). The same ops, so the same bits as the model's
forward; an engine test compares the two bit for bit. Steps whose layers are one kernel call each
(float32; bfloat16 where the bfloat16 GEMM runs, AMX, vdpbf16ps or AVX2, up to its cut) take `KernelDecoder` first; a layer
swapped for one call (`KernelLayer`) is still its modules here, which this loop calls directly.

Where it runs and why: docs/engine_speed.md, "How a step runs".
"""

from __future__ import annotations

import torch
from torch import nn

from engine.forward import dense, fused
from engine.forward.kernel_decoder import RotaryTable, plain_decoder
from engine.forward.kernel_layer import LAYER_TYPES, KernelLayer


class LeanDecoder:
    """`(input_ids [1, T], positions [1, T]) -> last hidden states [1, T, hidden]`, the decoder's
    forward without transformers' module machinery."""

    def __init__(self, decoder: nn.Module):
        self.embed, self.first_norm = decoder.embed_tokens, decoder.layers[0].input_layernorm.forward
        self.rotary = RotaryTable(decoder.rotary_emb)
        # each layer's attention, then its post-attention norm with the residual add before it, its
        # MLP, then the next layer's input norm (the final norm after the last) with its add
        norms = [layer.input_layernorm for layer in decoder.layers[1:]] + [decoder.norm]
        self.layers = [(layer.self_attn.forward, _add_then(layer.post_attention_layernorm), layer.mlp.forward,
                        _add_then(after)) for layer, after in zip(decoder.layers, norms, strict=True)]

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        cos_sin = self.rotary(x, positions)
        h = self.first_norm(x)
        for attn, add_norm2, mlp, add_next in self.layers:
            x, h = add_norm2(x, attn(h, cos_sin)[0])
            x, h = add_next(x, mlp(h))
        return h


def _add_then(norm: nn.Module):
    """`(x, y) -> (x + y, norm(x + y))`: one pass where the norm is fused (`FusedRMSNorm.add`), else the
    two ops."""
    if isinstance(norm, dense.FusedRMSNorm):
        return norm.add

    def add_then(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        total = x + y
        return total, norm(total)
    return add_then


def lean_decoder(model: nn.Module) -> LeanDecoder | None:
    """A `LeanDecoder` for `model` where its decoder is a `plain_decoder` and every layer is a
    `LAYER_TYPES` layer of a fused attention and a fused MLP between its two norms; None otherwise
    (the model's forward serves)."""
    decoder = plain_decoder(model)
    if decoder is None:
        return None
    for layer in decoder.layers:
        if (type(layer).__name__ not in LAYER_TYPES
                or not isinstance(vars(layer).get("forward"), (KernelLayer, type(None)))  # the class's, or one call
                or {n for n, _ in layer.named_children()} != {"self_attn", "mlp", "input_layernorm",
                                                              "post_attention_layernorm"}
                or not isinstance(layer.self_attn, fused.FusedAttention) or not isinstance(layer.mlp, fused.FusedMLP)):
            return None
    return LeanDecoder(decoder)
