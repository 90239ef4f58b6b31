"""The decoder's loop where every layer is one kernel call (engine/forward/kernel_layer.py's `KernelLayer`):
the embedding, the rotary (cos, sin) looked up in a table of the rotary module's own outputs, every
layer and the final norm as one C call (`pd_decoder_forward`), for Llama-shaped models under their
plain heads. Same modules and kernels on the same inputs as the model's own forward, so the same
bits (docs/engine_speed.md, "One call per layer")."""

from __future__ import annotations

import logging

import torch
from torch import nn

from engine.forward import dense
from engine.forward.kernel_layer import KernelLayer, LayerArgs

log = logging.getLogger(__name__)

# decoder models whose forward is exactly embed -> rotary -> layers -> norm, under a plain lm_head
DECODER_TYPES = frozenset({"LlamaModel", "MistralModel", "Qwen2Model", "SmolLM3Model"})
HEAD_TYPES = frozenset({"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "SmolLM3ForCausalLM"})


class RotaryTable:
    """A rotary module's (cos, sin) for a step's positions, looked up in a table of its own outputs
    for positions [0, size) instead of computed each step (a quarter of the Python left in a 16-row
    step). The module is elementwise in the position (position x inverse frequency, then cos and sin),
    so a row of the table is what the module gives that position in any step; each build checks that
    on batches of several sizes and offsets, and a table that differs is dropped for the module.
    Rotary types that change with the positions seen (dynamic, longrope) keep the module, and so do
    positions past `MAX_POSITIONS` (the table stays under 64 MB at a head dimension of 128)."""

    MAX_POSITIONS = 65536

    def __init__(self, rotary: nn.Module):
        self.rotary = rotary
        kind = str(getattr(rotary, "rope_type", "default"))
        self.usable = "dynamic" not in kind and "longrope" not in kind
        self.cos: torch.Tensor | None = None  # [1, size, dim]
        self.sin: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions `[1, T]` -> (cos, sin) `[1, T, dim]` each, in x's dtype, as the module gives them."""
        top = int(positions.max()) + 1 if self.usable and positions.numel() else 0
        if self.usable and positions.shape[0] == 1 and top <= self.MAX_POSITIONS:
            if (self.cos is None or top > self.cos.shape[1] or self.cos.dtype != x.dtype
                    or self.cos.device != x.device):
                grown = 2 * self.cos.shape[1] if self.cos is not None else 4096
                self._build(x, min(max(top, grown), self.MAX_POSITIONS))
            if self.usable:
                return self.cos.index_select(1, positions[0]), self.sin.index_select(1, positions[0])
        return self.rotary(x, position_ids=positions)

    def _build(self, x: torch.Tensor, size: int) -> None:
        everything = torch.arange(size, device=x.device)[None]
        self.cos, self.sin = self.rotary(x[:, :1], position_ids=everything)
        g = torch.Generator().manual_seed(size)
        for tokens in (1, 3, 7, 16, 33):
            at = torch.randint(0, max(size - tokens, 1), (1,), generator=g).item()
            positions = everything[:, at:at + tokens]
            cos, sin = self.rotary(x[:, :1], position_ids=positions)
            if not (torch.equal(cos, self.cos[:, at:at + tokens]) and torch.equal(sin, self.sin[:, at:at + tokens])):
                log.info("rotary tables computed each step: a table's rows differ from the module's")
                self.usable, self.cos, self.sin = False, None, None
                return


class KernelDecoder:
    """The decoder's forward where every layer is a `KernelLayer`: the embedding, the rotary tables,
    one `pd_layer_forward` call per layer straight from here, the final norm. The same modules and
    kernels on the same inputs as the model's own forward (so the same bits), without what a kernel
    step does not read: the attention masks, the module call around each layer, the output records.
    Half a millisecond to a millisecond of Python a step on SmolLM2, where the layers' work is ~40 ms
    (docs/engine_speed.md, "One call per layer")."""

    def __init__(self, decoder: nn.Module, layers: list[KernelLayer]):
        self.embed, self.norm = decoder.embed_tokens, decoder.norm
        self.rotary = RotaryTable(decoder.rotary_emb)
        self.layers = layers  # one shape and GEMM cut (kernel_decoder checks): the first's checks hold for all
        # the layers' arguments side by side, for one call that runs them all and the final norm,
        # where the norm is the RMSNorm kernel's (the module path's FusedRMSNorm calls the same)
        norm = self.norm
        self.table = (LayerArgs * len(layers))(*(layer.args for layer in layers)) if (
            isinstance(norm, dense.FusedRMSNorm) and norm.kernel is not None and norm.weight.dtype == layers[0].shape.dtype
            and norm.weight.is_contiguous() and norm.weight.device.type == "cpu") else None

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """The last hidden states `[1, T, hidden]`, or None where the step is not all the kernels'
        (the caller runs the model's forward instead)."""
        x = self.embed(input_ids)
        cos_sin = self.rotary(x, positions)
        step = self.layers[0]._step(x, cos_sin, decoder=self.table is not None)  # its checks and arguments
        if step is None:
            return None
        if self.table is not None:  # the norm into the output buffer the last layer read (free by then)
            normed = step.outs[len(self.layers) % 2]
            self.layers[0].kernel.decoder(self.table, step.args, x, step.outs, self.norm.weight, self.norm.eps, normed)
            return normed
        for layer in self.layers:
            out = step.out_for(x)
            layer.kernel(layer.args, step.args, x, out)
            x = out
        return self.norm(x)


def plain_decoder(model: nn.Module) -> nn.Module | None:
    """`model`'s decoder where it is one of `DECODER_TYPES` under one of `HEAD_TYPES`, with its
    embedding, rotary, norm and one module per layer (the loop a decoder of these is); else None."""
    decoder = model.get_decoder()
    if type(model).__name__ not in HEAD_TYPES or type(decoder).__name__ not in DECODER_TYPES:
        return None
    layers = getattr(decoder, "layers", None)
    if (not isinstance(layers, nn.ModuleList) or len(layers) != decoder.config.num_hidden_layers
            or not all(hasattr(decoder, name) for name in ("embed_tokens", "rotary_emb", "norm"))):
        return None
    return decoder


def kernel_decoder(model: nn.Module) -> KernelDecoder | None:
    """A `KernelDecoder` for `model` where its decoder is a `plain_decoder` with every layer it runs
    swapped (`swap_layers`) alike; None otherwise."""
    decoder = plain_decoder(model)
    if decoder is None:
        return None
    kernels = [layer.forward for layer in decoder.layers]
    if not kernels or not all(isinstance(k, KernelLayer) for k in kernels):
        return None
    if len({(k.shape, k.max_rows) for k in kernels}) != 1:
        return None
    return KernelDecoder(decoder, kernels)
