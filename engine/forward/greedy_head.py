"""The LM head of an all-greedy step: each row's argmax without reading all of the head's float32 weights.

A decode step whose rows all sample greedily needs the largest of each row's logits, not the
logits. The head is the biggest single weight of a small model (SmolLM2-135M: 49152 x 576 float32,
113 MB, a fifth of a step's reads at 16 rows), so it first runs on a copy of its panels in IEEE
half floats (half the bytes), which pins every float32 logit to a narrow window, and then reruns
in float32 only the few panels whose columns can still be the largest. The token is the one the
full float32 product and argmax give, bit for bit; it is not an approximation:

For row x and column j, let L_j be the float32 logit as the GEMM computes it (a plain sum over k
in order) and A_j the same sum over f16(W_j), W rounded to nearest half float: |f16(w) - w| <=
u |w| + t with u = 2^-11 (and t = 2^-25 for values in the subnormal range). With S_j = sum_k |x_k|
|W_jk| <= |x| |W_j| (Cauchy-Schwarz), sum_k |x_k| <= sqrt(K) |x|, and g = K 2^-24 / (1 - K 2^-24)
the float32 rounding of a K-term sum:

    |L_j - A_j| <= (u + g (2 + u)) |W_j| |x| + t (1 + g) sqrt(K) |x| = D_j.

The argmax j* of L then has A_j* + D_j* >= L_j* >= L_i >= A_i - D_i for every i: it is among the
columns with A_j + D_j >= max_i (A_i - D_i). Those columns' panels are multiplied by x in float32
exactly as the GEMM does (the same tile code: the same bits), and the largest, the first on a
tie (torch's argmax's rule), is the token. A row with a value that is not finite takes the full
product, as does a head with a weight beyond half float's range (none is built).

Where the CPU has AMX tiles the first pass runs there instead (`AmxGemm.head_approx`): the weight
rounded to bfloat16 (the same 57 MB), x split into two bfloat16 parts, both products summed in
float32 on the tiles, at a fraction of the vectors' arithmetic (the half-float pass is
compute-bound at 16 rows). Its window is wider (`tile_bounds`: u = 2^-8 for the weight's rounding),
about 1.3 panels reread per row on SmolLM2's decode steps against 1.0, and the float32 rerun and the
argmax are the same code. A row whose values are all under 2^-60 takes the full product there (the
tiles flush values under 2^-126 to zero, which the bound covers only above that).

Only steps whose every sampled row is greedy use it; any other step computes the logits
(engine/model_runner.py). docs/engine_speed.md has the window's width and the step's figures.

A bfloat16 head on the bfloat16 GEMM (`Bf16GreedyHead`: vdpbf16ps, or AMX tiles up to the GEMM's
32-row cut) needs no window: its logits are already the bfloat16 GEMM's, so `pd_bf16_greedy` computes
exactly them and keeps each row's running argmax in registers instead of writing them (a 262k
vocabulary at 16 rows: 8 MiB of logits written and read again by the argmax); the token is the
argmax of the logits the unfused head gives, bit for bit. Where the CPU has AMX-INT8 tiles it first
reads an int8 copy of the head (half the bytes) whose bound leaves only a few panels that can hold a
row's largest, and reruns those exactly (`pd_bf16_greedy_i8`, engine/kernels/csrc/greedy_i8.c, which
states the bound): the same token; where the bound leaves too many, that step takes the exact head.
"""

from __future__ import annotations

import math

import torch

HALF_ROUNDING = 2.0**-11  # relative error of rounding float32 to an IEEE half float, to nearest
HALF_SUBNORMAL = 2.0**-25  # the absolute error below half float's normal range
HALF_LARGEST = 65504.0


def bounds(k: int) -> tuple[float, float]:
    """(rel, abs): D_j = |x| (rel |W_j| + abs) for a K-long row x."""
    g = k * 2.0**-24 / (1 - k * 2.0**-24)
    return HALF_ROUNDING + g * (2 + HALF_ROUNDING), HALF_SUBNORMAL * (1 + g) * math.sqrt(k)


def tile_bounds(k: int) -> tuple[float, float]:
    """(rel, abs) for the first pass on AMX tiles (`AmxGemm.head_approx`): W rounded to bfloat16
    (u = 2^-8), x in two bfloat16 parts (2^-16 left over), 2K exact products summed in float32, the
    float32 product's own rounding; abs for what the tiles flush to zero (values under 2^-126), which
    the kernel bounds by refusing rows with |x| under 2^-60."""
    u, g2, g = 2.0**-8, 2 * k * 2.0**-24 / (1 - 2 * k * 2.0**-24), k * 2.0**-24 / (1 - k * 2.0**-24)
    rel = u + 2.0**-16 * (1 + u) + g2 * (1 + u) ** 2 * (1 + 2.0**-8) + 2.0**-24 + g * (1 + 2.0**-24)
    return rel * 1.01 + 2.0**-60, 2.0**-120 * math.sqrt(k) + 2 * k * 2.0**-66


def column_norms(panels: torch.Tensor, k: int, n: int) -> torch.Tensor:
    """|W_j| for each of the n columns of GEMM panels, in float32 rounded up."""
    columns = panels.view(-1, k, 16)  # [panel, k, column]: a panel's 16 rows of W
    norms = torch.cat([part.double().square().sum(1).sqrt().flatten() for part in columns.split(64)])[:n]
    return torch.nextafter(norms.float(), torch.tensor(math.inf))


class GreedyHead:
    """`(x [M, K] float32) -> [M] int64 greedy tokens` of a `dense.PackedLinear` with GEMM panels,
    or None where the full product must be taken (a value that is not finite)."""

    def __init__(self, head, tiles=None) -> None:
        self.gemm, self.panels, self.bias = head.gemm, head.panels, head.bias
        self.n, self.k = head.out_features, head.in_features
        self.norms = column_norms(self.panels, self.k, self.n)
        # the first pass on AMX tiles (`tiles`: a ready cpu_kernel.AmxGemm) from the weight in bfloat16,
        # else on vectors from a half-float copy
        self.tiles = tiles
        if tiles is not None:
            weight = self.panels.view(-1, self.k, 16).permute(0, 2, 1).reshape(-1, self.k)[:self.n]
            self.half, self.bf16 = None, tiles.pack(weight.bfloat16())
            self.rel, self.abs = tile_bounds(self.k)
        else:
            self.half, self.bf16 = self.gemm.half(self.panels), None
            self.rel, self.abs = bounds(self.k)
        self._approx = torch.empty(0)
        self.what = "a bfloat16 copy of the LM head on AMX tiles" if tiles is not None else "a half-float copy of the LM head"
        self.calls = self.full = 0  # steps it ran; of those, the ones that took the full product
        self.rows = self.reread = 0  # rows it gave tokens for; the float32 panels it reread for them

    @staticmethod
    def fits(head) -> str | None:
        """Why `head` gets no greedy head, or None: it does."""
        if getattr(head, "panels", None) is None or head.gemm.dtype != torch.float32:
            return "the LM head is not on the CPU GEMM's float32 panels"
        low, high = torch.aminmax(head.panels)
        if max(-low, high) >= HALF_LARGEST:
            return "a weight of the LM head is beyond half float's range"
        return None

    def __call__(self, x: torch.Tensor) -> torch.Tensor | None:
        m = x.shape[0]
        if self._approx.numel() < m * self.n:
            self._approx = torch.empty(m * self.n)
        x = x.contiguous()
        if self.tiles is not None and not self.tiles.head_approx(x, self.bf16, self.bias, self.n, self._approx):
            self.calls += 1
            self.full += 1
            return None
        found = self.gemm.greedy(x, self.panels, self.half, self.bias, self.norms, self.rel, self.abs,
                                 self._approx)
        self.calls += 1
        if found is None:
            self.full += 1
            return None
        tokens, reread = found
        self.rows += m
        self.reread += int(reread.sum())
        return tokens


class Bf16GreedyHead:
    """`(x [M, K] bfloat16) -> [M] int64 greedy tokens` of a bfloat16 `dense.PackedLinear` on the
    bfloat16 GEMM's panels (`pd_bf16_greedy`: vdpbf16ps, or AMX tiles), or None where the logits must
    be taken (a NaN; on AMX, more rows than the GEMM's cut, past which the unfused head is oneDNN's).
    With AMX-INT8 and no bias, steps of up to 16 rows of a head of at least `INT8_BYTES` first try the
    int8 copy (`int8`: None by that size, True for any head with no bias, False never)."""

    MOST = 0.25  # the share of panels to rerun past which the int8 pass gives way to the exact head
    TRIES = 16  # int8 steps after which, if most did not decide, the copy is dropped
    # the int8 pass reads half the bytes but adds its rerun and its bound's arithmetic: it pays where the
    # head streams from memory, as in a decode step, after the layers' weights have passed through the
    # cache (host E, 2026-12-06, 16 rows, 2 threads: a 262,144 x 640 head 9.7-11.9 ms against 17.8 exact;
    # SmolLM2's 49,152 x 576, 57 MB, from memory (`microbench.head --cold`) 4.25-4.29 against 4.62-4.78 ms,
    # a whole 16-row decode step 0.967-0.973x the time; only from cache, in a loop of calls, is it slower)
    INT8_BYTES = 32 << 20

    def __init__(self, head, int8: bool | None = None) -> None:
        self.gemm, self.panels, self.bias, self.n = head.gemm, head.panels, head.bias, head.out_features
        # the unfused head's cut: past it oneDNN computes the logits (None: the GEMM takes every product)
        self.cut = head.small_rows if head.packed is not None else None
        self.calls = self.full = 0  # steps it ran; of those, the ones that took the logits
        # the int8 first pass: (q, cols, wmax) or None; its steps, the ones it left to the exact head, the panels reread
        wanted = int8 if int8 is not None else self.int8_bytes(self.n, head.in_features, self.bias is not None) > 0
        self.int8 = (self.gemm.int8_copy(self.panels, self.n, head.in_features)
                     if wanted and self.bias is None and hasattr(self.gemm, "int8_copy") else None)
        self._upper = torch.empty(16 * -(-self.n // 16)) if self.int8 is not None else None
        self.int8_calls = self.undecided = self.reread = 0
        how = "AMX tiles" if self.gemm.path == "AMX" else "vdpbf16ps"
        self.what = f"the bfloat16 LM head with its argmax fused ({how}" + (
            ", an int8 copy's first pass on AMX-INT8 tiles)" if self.int8 is not None else ")")  # for the start-up line

    @classmethod
    def int8_bytes(cls, n: int, k: int, bias: bool) -> int:
        """The memory an n x k head takes for its int8 first pass by its size (`int8` None) where
        AMX-INT8 runs: its int8 copy and its columns' bounds (5 float32 each); 0 for a head under
        `INT8_BYTES` or with a bias (the KV budget counts it: engine/model_runner.py)."""
        return 0 if bias or 2 * n * k < cls.INT8_BYTES else n * k + n * 20

    @staticmethod
    def fits(head) -> str | None:
        """Why `head` gets no fused bfloat16 greedy head, or None: it does."""
        gemm = getattr(head, "gemm", None)
        if getattr(head, "panels", None) is None or gemm is None or gemm.dtype != torch.bfloat16:
            return "the LM head is not on the CPU GEMM's bfloat16 panels"
        if getattr(gemm, "path", "") not in ("AVX512-BF16", "AMX"):
            return "the LM head's bfloat16 GEMM is neither vdpbf16ps nor AMX tiles here (the fused argmax runs on those)"
        return None

    def __call__(self, x: torch.Tensor) -> torch.Tensor | None:
        self.calls += 1
        if self.cut is not None and x.shape[0] > self.cut:  # the unfused head's logits are oneDNN's there
            self.full += 1
            return None
        x = x.contiguous()
        if self.int8 is not None and x.shape[0] <= 16:
            tokens, rc, reread = self.gemm.greedy_int8(x, self.panels, self.int8, self.n, self.MOST, self._upper)
            if rc != -1:
                self.int8_calls += 1
                self.reread += max(reread, 0)
            if rc == 0:
                return tokens
            if rc == 1:
                self.full += 1
                return None
            if rc == 2:
                self.undecided += 1
                if self.int8_calls >= self.TRIES and 2 * self.undecided > self.int8_calls:
                    self.int8 = self._upper = None  # the window is too wide for this model: the exact head only
        tokens = self.gemm.greedy(x, self.panels, self.bias, self.n)
        self.full += tokens is None
        return tokens
