"""The dense half of the forward on CPU: linear layers on weights prepacked for oneDNN.

A decode step multiplies a handful of rows by every weight matrix. torch's default CPU linear
hands that to MKL's GEMM, which on small row counts runs far below the memory bandwidth; oneDNN
with the weight reordered once into its blocked layout runs the same product 1.3-2.4x faster on
this project's 2-core host (docs/engine_speed.md has the figures and the command). Prepacking is
what inductor's `freezing` pass does for a compiled CPU graph; this module does it eagerly, so
the uncompiled engine gets it too and a compiled one keeps it (the packed linear is an extern
call inductor leaves as it is).

Only plain `nn.Linear` modules with a float32 weight on CPU are packed, and only when oneDNN is
built in. The packed weight replaces the module's parameter; a weight shared with another module
(tied embeddings and LM head) is left in place and the packed copy sits beside it.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

log = logging.getLogger(__name__)

PACKABLE = (torch.float32,)  # oneDNN's bf16 path needs AVX512-BF16/AMX, which `cpu_computes_bf16` checks


class PackedLinear(nn.Module):
    """`nn.Linear`'s forward on a oneDNN-packed weight; same inputs, same outputs."""

    def __init__(self, linear: nn.Linear, keep_weight: bool):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach())
        self.bias = linear.bias
        # a weight other modules use too (tied embeddings) stays reachable as it was
        self.weight = linear.weight if keep_weight else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed=onednn"


def can_pack(model: nn.Module, device: torch.device) -> bool:
    return (device.type == "cpu" and torch.backends.mkldnn.is_available()
            and next(model.parameters()).dtype in PACKABLE)


def pack_linears(model: nn.Module, device: torch.device, skip: nn.Module | None = None) -> int:
    """Swap every packable `nn.Linear` in `model` (outside `skip`) for a `PackedLinear`; returns
    how many."""
    if not can_pack(model, device):
        return 0
    skipped = set(map(id, skip.modules())) if skip is not None else set()
    uses: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        uses[id(p)] = uses.get(id(p), 0) + 1
    swaps = [(parent, name, child) for parent in model.modules() if id(parent) not in skipped
             for name, child in parent.named_children() if type(child) is nn.Linear and child.weight.dtype in PACKABLE]
    for parent, name, child in swaps:
        setattr(parent, name, PackedLinear(child, keep_weight=uses[id(child.weight)] > 1))
    return len(swaps)
