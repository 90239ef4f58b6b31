"""pdserve's small CPU kernels around the linears and attention (engine/kernels/csrc/*.c, built with the
others by engine/kernels/cpu_kernel.py, which imports this module's ctypes helpers and error), each bit for
bit the torch ops it replaces:

- rotary embedding (rope.c): in place on a fused q|k|v projection, float32 or bfloat16, as
  transformers' rotary rounds (engine/forward/fused.py);
- RMSNorm (rms_norm.c): one call per norm, float32 as torch's `F.rms_norm`, bfloat16 as
  transformers' Llama-style norm (engine/forward/dense.py);
- SiLU times up (silu_mul.c): a gated MLP's activation on its fused gate|up projection, float32
  or bfloat16, as torch's on an AVX2 + FMA host (engine/forward/fused.py);
- greedy argmax (argmax.c): each logit row's, as torch's, the rows shared among threads
  (engine/sampler.py).
"""

from __future__ import annotations

import ctypes

import torch

from engine.kernels import kernel_checks as checks

_I64, _PTR, _INT, _FLOAT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float


def _rows(x: torch.Tensor, width: int) -> torch.Tensor:
    """x as `[rows, width]` with each row contiguous (a view where it already is, else a copy)."""
    flat = x.reshape(-1, width)
    return flat if flat.stride(1) == 1 else flat.contiguous()


def _norm_args(name: str, rows: torch.Tensor, weight: torch.Tensor, dtypes: tuple[torch.dtype, ...]) -> None:
    checks.rows_of(f"{name}: x", rows, dtypes)
    checks.require(weight.dtype == rows.dtype and weight.is_contiguous() and weight.shape == (rows.shape[1],),
                   lambda: f"{name}: weight must be [{rows.shape[1]}] contiguous {rows.dtype}, not {tuple(weight.shape)} "
                   f"{weight.dtype}")


class KernelUnavailable(RuntimeError):
    """A kernel cannot be built, loaded or give torch's bits here; the message says why (raised as
    `cpu_kernel.KernelUnavailable` too)."""


class Rope:
    """`pd_rope` / `pd_rope_bf16`: rotary embedding in place on float32 or bfloat16 q and k heads."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fns = {torch.float32: lib.pd_rope, torch.bfloat16: lib.pd_rope_bf16}

    def __call__(self, x: torch.Tensor, heads: int, dim: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """x `[T, >= heads * dim]` float32 or bfloat16 (rows of heads, each `dim` contiguous): its first
        `heads` heads rotated in place; cos/sin `[T, dim]` in x's dtype, rows contiguous."""
        tokens = x.shape[0]
        checks.rows_of("rope: x", x, tuple(self._fns))
        checks.require(x.shape[1] >= heads * dim, lambda: f"rope: rows of {x.shape[1]} hold no {heads} heads of {dim}")
        checks.require(cos.dtype == sin.dtype == x.dtype, lambda: f"rope: cos/sin {cos.dtype}, x {x.dtype}")
        checks.require(cos.shape == sin.shape == (tokens, dim) and cos.stride() == sin.stride() and cos.stride(1) == 1,
                       lambda: f"rope: cos and sin must be [{tokens}, {dim}] with contiguous rows, not {tuple(cos.shape)}")
        self._fns[x.dtype](x.data_ptr(), x.stride(0), heads, dim, cos.data_ptr(), sin.data_ptr(), cos.stride(0),
                           tokens, torch.get_num_threads())


class RmsNorm:
    """`pd_rms_norm` / `pd_rms_norm_bf16`: RMSNorm rows in float32 or bfloat16; `add` the residual add
    before it in the same pass (`pd_add_rms_norm[_bf16]`)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fns = {torch.float32: lib.pd_rms_norm, torch.bfloat16: lib.pd_rms_norm_bf16}
        self._adds = {torch.float32: lib.pd_add_rms_norm, torch.bfloat16: lib.pd_add_rms_norm_bf16}

    def add(self, x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """x, y `[..., n]` of one shape and dtype (rows contiguous) -> (`x + y`, its norm), each a new
        tensor of that shape: torch's add and `self(x + y, ...)` bit for bit."""
        n = x.shape[-1]
        a, b = _rows(x, n), _rows(y, n)
        checks.require(x.shape == y.shape, lambda: f"add rms_norm: x {tuple(x.shape)} and y {tuple(y.shape)} differ")
        _norm_args("add rms_norm", a, weight, tuple(self._adds))
        checks.rows_of("add rms_norm: y", b, (x.dtype,))
        total, out = torch.empty(x.shape, dtype=x.dtype), torch.empty(x.shape, dtype=x.dtype)
        self._adds[x.dtype](a.data_ptr(), a.stride(0), b.data_ptr(), b.stride(0), weight.data_ptr(), eps,
                            total.data_ptr(), out.data_ptr(), a.shape[0], n, torch.get_num_threads())
        return total, out

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x `[..., n]` float32 or bfloat16 (rows contiguous), weight `[n]` of x's dtype -> a new tensor
        of x's shape."""
        n = x.shape[-1]
        flat = _rows(x, n)
        _norm_args("rms_norm", flat, weight, tuple(self._fns))
        out = torch.empty(x.shape, dtype=x.dtype)
        self._fns[x.dtype](flat.data_ptr(), flat.stride(0), weight.data_ptr(), eps, out.data_ptr(), n,
                           flat.shape[0], n, torch.get_num_threads())
        return out


class SiluMul:
    """`pd_silu_mul` / `pd_silu_mul_bf16`: silu(gate) * up over the two halves of float32 or bfloat16 rows."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fns = {torch.float32: lib.pd_silu_mul, torch.bfloat16: lib.pd_silu_mul_bf16}

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        """h `[..., 2n]` float32 or bfloat16 (gate, then up; rows contiguous) -> `[..., n]`;
        KernelUnavailable where it cannot give torch's bits (no AVX2 + FMA, or n no multiple of 8,
        32 in bfloat16)."""
        checks.require(h.shape[-1] % 2 == 0, lambda: f"silu_mul: gate|up rows of odd width {h.shape[-1]}")
        n = h.shape[-1] // 2
        flat = _rows(h, 2 * n)
        checks.rows_of("silu_mul: h", flat, tuple(self._fns))
        out = torch.empty(*h.shape[:-1], n, dtype=h.dtype)
        if self._fns[h.dtype](flat.data_ptr(), flat.stride(0), out.data_ptr(), n, flat.shape[0], n,
                              torch.get_num_threads()) != 0:
            raise KernelUnavailable(f"pd_silu_mul does not match torch here ({h.dtype}, width {n}, or no AVX2 + FMA)")
        return out


class Argmax:
    """`pd_argmax[_bf16]`: each float32 (bfloat16) row's argmax, as torch's `argmax(dim=-1)` gives it."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fns = {torch.float32: lib.pd_argmax, torch.bfloat16: lib.pd_argmax_bf16}

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x `[rows, n]` float32 or bfloat16 on the CPU, n >= 1, rows contiguous -> `[rows]` int64."""
        rows, n = x.shape
        checks.rows_of("argmax: x", x, tuple(self._fns))
        checks.require(n >= 1, lambda: "argmax: rows of no values")
        out = torch.empty(rows, dtype=torch.int64)
        self._fns[x.dtype](x.data_ptr(), x.stride(0), rows, n, out.data_ptr(), torch.get_num_threads())
        return out
