"""The bfloat16 GEMM (`cpu_kernel.Bf16Gemm`, engine/kernels/csrc/bf16_gemm.c) on each path this host runs:
AMX tiles (amx_gemm.c), AVX512-BF16's vdpbf16ps (AMX switched off, or absent, as on AMD Zen 4) and
AVX2's FMAs on the pairs widened to float32 (a CPU with neither, as AMD Zen 3):
a linear within a bfloat16 rounding of float64's at every row count it takes, a row's bits the same
in any batch and on any thread count, and `PackedLinear`'s cut between it and oneDNN. A path the
CPU or the OS lacks is skipped."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine.forward import dense
from engine.kernels import kernel_build
from tests.kernel_util import KERNELS


@pytest.fixture(params=["AMX", "AVX512-BF16", "AVX2"])
def gemm(request):
    """The bfloat16 GEMM on one path: AMX tiles, or vdpbf16ps with the engine's AMX use off."""
    if KERNELS is None:
        pytest.skip("no CPU kernels here")
    KERNELS.use_amx(request.param == "AMX")
    try:
        if KERNELS.bf16_gemm.path != request.param:
            pytest.skip(f"no {request.param} here (CPU or OS)")
        yield KERNELS.bf16_gemm
    finally:
        KERNELS.use_amx(True)


def _row_counts(gemm) -> tuple[int, ...]:
    """1 to 64 rows (one to four AMX row tiles: four panels at a time, or pairs through blocks of 32
    rows; vdpbf16ps blocks of 1 to 8 rows by 1 to 8 panels), and past 256 (on AMX tiles, 256 rows a call)."""
    return (1, 2, 3, 5, 8, 9, 16, 17, 31, 32, 33, 48, 64, 100, 257)


@pytest.mark.parametrize("n, k", [(40, 72), (576, 576), (960, 576), (576, 1536), (33, 100)])
def test_the_bfloat16_gemm_is_a_bfloat16_linear_on_any_row_count_it_takes(gemm, n, k):
    """Panels of 16 columns (a part panel past n), k padded to 32, with and without a bias: each
    output the float32 sum of exact products, rounded once, so within a bfloat16 rounding of
    float64's (and F.linear's bits on over 99% of outputs)."""
    torch.manual_seed(n + k)
    weight, bias = torch.randn(n, k).bfloat16(), torch.randn(n).bfloat16()
    panels = gemm.pack(weight)
    same = outputs = 0
    for rows in _row_counts(gemm):
        x = torch.randn(rows, k).bfloat16()
        for b in (None, bias):
            out = gemm(x, panels, b, n)
            exact = x.double() @ weight.double().T + (0 if b is None else b.double())
            torch.testing.assert_close(out.double(), exact, rtol=2 ** -8, atol=1e-2)
            same, outputs = same + int((out == F.linear(x, weight, b)).sum()), outputs + out.numel()
    assert same > 0.99 * outputs


def test_the_bfloat16_gemm_gives_a_row_the_same_bits_in_any_batch_and_on_any_thread_count(gemm):
    """A sequence's logits do not change with the rows it decodes beside (1 row alone, or any row of
    2..100: past 64 on AMX tiles too) nor with the threads that split the panels."""
    torch.manual_seed(6)
    rows = 100
    weight, x = torch.randn(600, 576).bfloat16(), torch.randn(rows, 576).bfloat16()
    panels = gemm.pack(weight)
    alone = torch.cat([gemm(x[i:i + 1], panels, None, 600) for i in range(len(x))])
    for m in range(2, len(x) + 1):
        assert torch.equal(gemm(x[:m], panels, None, 600), alone[:m]), f"{m} rows"
    for threads in (1, 3):
        assert torch.equal(gemm(x, panels, None, 600, threads=threads), alone), f"{threads} threads"


def test_the_panels_prefetch_changes_no_bit_and_its_switch_says_what_it_was():
    """Calls of up to 16 rows prefetch the panels' tiles some k-steps ahead (`pd_amx_prefetch`):
    none, one step, the default, and more steps than k has (it wraps to the next four panels' first
    steps, never past the thread's last panel) give the same bits, on 1 and 3 threads, with a
    part group of panels at the end (n = 600: 38 panels) and k of 3 steps (72) or 18 (576)."""
    if KERNELS is None or not KERNELS.amx_gemm.ready():
        pytest.skip("no AMX tiles here (CPU or OS)")
    amx, gemm = KERNELS.amx_gemm, KERNELS.bf16_gemm
    default = amx.prefetch(4)
    try:
        assert amx.prefetch(4) == 4
        torch.manual_seed(7)
        for n, k in ((600, 72), (600, 576), (40, 576)):
            weight, bias = torch.randn(n, k).bfloat16(), torch.randn(n).bfloat16()
            panels = gemm.pack(weight)
            for rows in (1, 5, 16):
                x = torch.randn(rows, k).bfloat16()
                amx.prefetch(0)
                want = {t: gemm(x, panels, bias, n, threads=t) for t in (1, 3)}
                for steps in (1, 4, 64):
                    amx.prefetch(steps)
                    for t, out in want.items():
                        assert torch.equal(gemm(x, panels, bias, n, threads=t), out), (n, k, rows, steps, t)
        assert amx.prefetch(2) == 64
    finally:
        amx.prefetch(default)
    assert default == 4


def test_packed_bfloat16_linears_take_the_gemm_up_to_its_cut_and_onednn_past(gemm):
    """On AMX tiles up to 32 rows, oneDNN past; by vdpbf16ps every product, with no oneDNN copy."""
    linear = nn.Linear(72, 40, bias=True).bfloat16()
    packed = dense.PackedLinear(linear, keep_weight=False, gemm=gemm, small_rows=gemm.max_rows)
    assert (packed.packed is None) == (gemm.max_rows is None)
    calls = []
    packed.gemm = lambda *a: calls.append(a[0].shape[0]) or gemm(*a)
    cut = gemm.max_rows or 300
    for rows in (1, 16, cut, cut + 1, 512):
        x = torch.randn(1, rows, 72).bfloat16()
        torch.testing.assert_close(packed(x).double(), F.linear(x, linear.weight, linear.bias).double(),
                                   rtol=2 ** -7, atol=1e-2)
    assert calls == ([1, 16, cut] if gemm.max_rows is not None else [1, 16, cut, cut + 1, 512])


def test_the_engine_picks_the_bfloat16_gemm_by_the_cpus_features():
    """AMX where it runs, else vdpbf16ps where the CPU and the build (`$PDSERVE_KERNEL_ARCH`) have
    AVX512-BF16, else AVX2's FMAs on the pairs widened (AVX-512 without BF16 too), else none (oneDNN's
    linears)."""
    if KERNELS is None:
        pytest.skip("no CPU kernels here")
    has_bf16 = "avx512_bf16" in kernel_build.cpu_flags().split() and KERNELS.isa & 4  # isa.c's AVX512-BF16 bit
    want = "AMX" if KERNELS.amx_gemm.ready() else "AVX512-BF16" if has_bf16 else "AVX2" if KERNELS.isa & 1 else ""
    assert KERNELS.bf16_gemm.path == want
    assert (KERNELS.gemm_for(torch.bfloat16) is KERNELS.bf16_gemm) == bool(want)
