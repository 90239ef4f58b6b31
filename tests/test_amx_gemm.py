"""The bfloat16 GEMM on AMX tiles (engine/csrc/amx_gemm.c, `cpu_kernel.AmxGemm`): a linear within
a bfloat16 rounding of float64's at every row count it takes, a row's bits the same in any batch,
and `PackedLinear`'s cut between it and oneDNN. Skipped where the CPU or the OS has no AMX."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine import cpu_kernel, dense

KERNELS, _ = cpu_kernel.load()

needs_amx_gemm = pytest.mark.skipif(KERNELS is None or not KERNELS.amx_gemm.ready(), reason="no AMX tiles here")


@needs_amx_gemm
@pytest.mark.parametrize("n, k", [(40, 72), (576, 576), (960, 576), (576, 1536), (33, 100)])
def test_the_amx_gemm_is_a_bfloat16_linear_on_any_row_count_it_takes(n, k):
    """Panels of 16 columns (a part panel past n), k padded to 32, 1 to 64 rows in one to four row
    tiles, with and without a bias: each output the float32 sum of exact products, rounded once, so
    within a bfloat16 rounding of float64's (and F.linear's bits on over 99% of outputs)."""
    gemm = KERNELS.amx_gemm
    torch.manual_seed(n + k)
    weight, bias = torch.randn(n, k).bfloat16(), torch.randn(n).bfloat16()
    panels = gemm.pack(weight)
    same = outputs = 0
    for rows in (1, 5, 16, 17, 31, 32, 33, 48, 64):
        x = torch.randn(rows, k).bfloat16()
        for b in (None, bias):
            out = gemm(x, panels, b, n)
            exact = x.double() @ weight.double().T + (0 if b is None else b.double())
            torch.testing.assert_close(out.double(), exact, rtol=2 ** -8, atol=1e-2)
            same, outputs = same + int((out == F.linear(x, weight, b)).sum()), outputs + out.numel()
    assert same > 0.99 * outputs


@needs_amx_gemm
def test_the_amx_gemm_gives_a_row_the_same_bits_in_any_batch():
    """A sequence's logits do not change with the rows it decodes beside (1 row alone, or any row of
    2..64: one to four row tiles, groups of four, two or one panel)."""
    torch.manual_seed(6)
    weight, x = torch.randn(576, 576).bfloat16(), torch.randn(64, 576).bfloat16()
    panels = KERNELS.amx_gemm.pack(weight)
    alone = torch.cat([KERNELS.amx_gemm(x[i:i + 1], panels, None, 576) for i in range(len(x))])
    for rows in range(2, len(x) + 1):
        assert torch.equal(KERNELS.amx_gemm(x[:rows], panels, None, 576), alone[:rows]), f"{rows} rows"


@needs_amx_gemm
def test_packed_bfloat16_linears_take_the_amx_gemm_up_to_32_rows_and_onednn_past():
    linear = nn.Linear(72, 40, bias=True).bfloat16()
    packed = dense.PackedLinear(linear, keep_weight=False, gemm=KERNELS.amx_gemm, small_rows=KERNELS.amx_gemm.max_rows)
    calls = []
    gemm = packed.gemm
    packed.gemm = lambda *a: calls.append(a[0].shape[0]) or gemm(*a)
    for rows in (1, 16, 32, 33, 512):
        x = torch.randn(1, rows, 72).bfloat16()
        torch.testing.assert_close(packed(x).double(), F.linear(x, linear.weight, linear.bias).double(),
                                   rtol=2 ** -7, atol=1e-2)
    assert calls == [1, 16, 32]
