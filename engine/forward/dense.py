"""The dense half of the forward on CPU: linear layers on weights prepacked for oneDNN.

A decode step multiplies a handful of rows by every weight matrix. torch's default CPU linear
hands that to MKL's GEMM, which on small row counts runs far below the memory bandwidth; oneDNN
with the weight reordered once into its blocked layout runs the same product 1.3-2.4x faster on
this project's 2-core host (docs/engine_speed.md has the figures and the command). Prepacking is
what inductor's `freezing` pass does for a compiled CPU graph; this module does it eagerly, so
the uncompiled engine gets it too and a compiled one keeps it (the packed linear is an extern
call inductor leaves as it is).

Only plain `nn.Linear` modules with a float32 weight (or bfloat16, where the CPU computes it natively:
`packable`) on CPU are packed, and only when oneDNN is
built in. The packed weight replaces the module's parameter; a weight shared with another module
(tied embeddings and LM head) is left in place and the packed copy sits beside it.

With pdserve's CPU kernels (`engine.cpu_kernels`, engine/kernels/cpu_kernel.py), each packed linear keeps
its weight in 16-column panels for the CPU GEMM. Where torch vectorizes with AVX2 (this project's
host) the GEMM takes every product, decode rows and prefill chunks alike (2x oneDNN's speed at 16
rows, 1.1x at 512 to 2048), and no oneDNN copy is made: the panels replace the weight. Elsewhere
(`SMALL_ROWS` = 64) it takes products of up to 64 rows and oneDNN the larger ones, a second copy
of the linear weights. bfloat16 weights go to the bfloat16 GEMM (`cpu_kernel.Bf16Gemm`,
engine/kernels/csrc/bf16_gemm.c): where the CPU has AMX, products of up to 32 rows on AMX tiles
(engine/kernels/csrc/amx_gemm.c, 0.66x oneDNN's time at 1-16 rows on a Xeon, 0.72x at 32), larger ones by
oneDNN; where it has AVX512-BF16 without AMX (AMD Zen 4), every product by vdpbf16ps on the same
panels, and no oneDNN copy; where it has neither (AVX2 alone, as AMD Zen 3, where oneDNN has no
bfloat16 at all and torch's linears emulate it at a fifth of float32's speed), every product by AVX2's
FMAs on the same panels (docs/engine_speed.md, "bfloat16 linears").

The norms around them: an RMSNorm module written as transformers' Llama / Qwen / Mistral ones are
(square, mean, add eps, rsqrt, two multiplies: six passes over the hidden states) becomes one
call, where that gives the module's own output bit for bit on probe inputs (checked per module at
load; Gemma's `1 + weight` norm, for one, fails the check and stays as it is): pdserve's CPU kernel
(engine/kernels/csrc/rms_norm.c, float32: torch's own sum order, so its bits) where it builds and matches,
else `F.rms_norm` (on CPU a chain of eight torch ops: 45-50 us per norm at 16 rows, mostly dispatch).
A 512-token prefill's 61 norms on SmolLM2: 23-49 ms eager, 9-10 ms as `F.rms_norm`.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels.cpu_kernel import DTYPES, SMALL_ROWS
from sizing import kv_pool

log = logging.getLogger(__name__)



def cpu_computes_bf16() -> bool:
    """The CPU multiplies bfloat16 natively (AVX512-BF16 or AMX): oneDNN's bf16 kernels run there."""
    return kv_pool.computes_bf16("cpu")


def packable(dtype: torch.dtype, gemm=None) -> bool:
    """Weights of `dtype` are prepacked: float32 always; bfloat16 where the CPU computes it natively
    (oneDNN's packed bf16 linear gives `F.linear`'s bits at twice its speed there; elsewhere oneDNN
    emulates bf16 and torch's own path is kept), or where `gemm` is a bfloat16 GEMM that takes every
    product (AVX2's: no oneDNN copy is made)."""
    takes_all = gemm is not None and gemm.dtype == torch.bfloat16 and gemm.max_rows is None
    return dtype == torch.float32 or (dtype == torch.bfloat16 and (cpu_computes_bf16() or takes_all))


class PackedLinear(nn.Module):
    """`nn.Linear`'s forward on prepacked weights (oneDNN's, the CPU GEMM's panels, or both); same
    inputs, same outputs."""

    def __init__(self, linear: nn.Linear, keep_weight: bool, gemm=None, small_rows: int | None = SMALL_ROWS):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # the GEMM's cut (None: it takes every product, and oneDNN's copy is not made)
        self.small_rows = small_rows if gemm is not None else 0  # 0: oneDNN takes everything
        self.packed = (torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach())
                       if self.small_rows is not None else None)
        self.bias = linear.bias
        # a weight other modules use too (tied embeddings) stays reachable as it was
        self.weight = linear.weight if keep_weight else None
        self.gemm = gemm  # cpu_kernel.SmallGemm (float32 weights), cpu_kernel.AmxGemm (bfloat16), or None
        self.panels = gemm.pack(linear.weight) if gemm is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if self.gemm is not None and (self.packed is None
                                      or (rows <= self.small_rows and not torch.compiler.is_compiling())):
            flat = x.reshape(rows, self.in_features)
            if flat.stride(1) != 1 or flat.stride(0) != self.in_features:
                flat = flat.contiguous()
            return self.gemm(flat, self.panels, self.bias, self.out_features).view(*x.shape[:-1], self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        if self.gemm is None:
            packed = "onednn"
        elif self.packed is None:
            packed = "gemm panels, every product"
        else:
            packed = f"gemm panels up to {self.small_rows} rows, onednn past"
        return f"in_features={self.in_features}, out_features={self.out_features}, packed={packed}"


def can_pack(model: nn.Module, device: torch.device, gemm=None) -> bool:
    return (device.type == "cpu" and torch.backends.mkldnn.is_available()
            and packable(next(model.parameters()).dtype, gemm))


def small_gemm_layers(model: nn.Module) -> int:
    """How many linears of `model` take few-row products by the small-batch GEMM."""
    return sum(1 for m in model.modules() if isinstance(m, PackedLinear) and m.gemm is not None)


def child_modules(model: nn.Module, skip: nn.Module | None) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent, name, child) for every direct child of every module of `model` outside `skip`."""
    skipped = set(map(id, skip.modules())) if skip is not None else set()
    return [(parent, name, child) for parent in model.modules() if id(parent) not in skipped
            for name, child in parent.named_children()]


def pack_linears(model: nn.Module, device: torch.device, skip: nn.Module | None = None, gemm=None) -> int:
    """Swap every packable `nn.Linear` in `model` (outside `skip`) for a `PackedLinear` (with the
    small-batch GEMM's panels too when `gemm` is given); returns how many."""
    if not can_pack(model, device, gemm):
        return 0
    uses: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        uses[id(p)] = uses.get(id(p), 0) + 1
    swaps = [(parent, name, child) for parent, name, child in child_modules(model, skip)
             if type(child) is nn.Linear and packable(child.weight.dtype, gemm)]
    for parent, name, child in swaps:
        takes = gemm is not None and child.weight.dtype == gemm.dtype
        setattr(parent, name, PackedLinear(child, keep_weight=uses[id(child.weight)] > 1, gemm=gemm if takes else None,
                                           small_rows=gemm.max_rows if takes else SMALL_ROWS))
    return len(swaps)


class FusedRMSNorm(nn.Module):
    """An RMSNorm module's forward as one call (pdserve's CPU kernel, or torch's `F.rms_norm`);
    same inputs, same outputs."""

    def __init__(self, norm: nn.Module, eps: float, kernel=None):
        super().__init__()
        self.weight = norm.weight
        self.eps = eps
        self.normalized_shape = (norm.weight.shape[0],)
        self.kernel = kernel  # cpu_ops.RmsNorm, or None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None and x.dtype in DTYPES and not torch.compiler.is_compiling():
            return self.kernel(x, self.weight, self.eps)
        return F.rms_norm(x, self.normalized_shape, self.weight, self.eps)

    def add(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(`x + y`, this norm of it): a residual add and the norm after it, in one pass on the kernel
        (same bits as the two ops)."""
        if (self.kernel is not None and x.dtype in DTYPES and x.shape == y.shape and x.dtype == y.dtype
                and not torch.compiler.is_compiling()):
            return self.kernel.add(x, y, self.weight, self.eps)
        total = x + y
        return total, self(total)

    def extra_repr(self) -> str:
        how = "the CPU kernel" if self.kernel is not None else "F.rms_norm"
        return f"{self.normalized_shape[0]}, eps={self.eps}, fused={how}"


def _norm_eps(module: nn.Module) -> float | None:
    """The epsilon of an RMSNorm-shaped module (a class named *RMSNorm with a 1-D weight), else None."""
    weight = getattr(module, "weight", None)
    if not type(module).__name__.endswith("RMSNorm") or not isinstance(weight, nn.Parameter) or weight.dim() != 1:
        return None
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    return float(eps) if isinstance(eps, float) else None


@torch.inference_mode()
def _fuses_exactly(module: nn.Module, fused: FusedRMSNorm) -> bool:
    generator = torch.Generator().manual_seed(0)
    size = fused.normalized_shape[0]
    for rows, scale in ((1, 1.0), (7, 30.0), (64, 1e-3)):
        x = (torch.randn(1, rows, size, generator=generator) * scale).to(module.weight.device, module.weight.dtype)
        if not torch.equal(module(x), fused(x)):
            return False
    return True


def fuse_rms_norms(model: nn.Module, device: torch.device, skip: nn.Module | None = None, kernel=None) -> int:
    """Swap every RMSNorm module of `model` (outside `skip`) whose output a fused norm reproduces
    bit for bit (on probe inputs of 1, 7 and 64 rows at three scales) for a `FusedRMSNorm`: on
    pdserve's CPU kernel (`kernel`, float32 or bfloat16) where that one matches, else on `F.rms_norm`; on CPU
    only (GPU kernels of the two may round differently); returns how many."""
    if device.type != "cpu":
        return 0
    swaps = []
    for parent, name, child in child_modules(model, skip):
        eps = _norm_eps(child)
        if eps is None:
            continue
        for candidate in (kernel, None) if kernel is not None else (None,):
            if _fuses_exactly(child, fused := FusedRMSNorm(child, eps, candidate)):
                swaps.append((parent, name, fused))
                break
    for parent, name, fused in swaps:
        setattr(parent, name, fused)
    return len(swaps)
