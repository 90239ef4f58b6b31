"""pdserve's CPU GEMMs, as engine/kernels/cpu_kernel.py loads them (engine/kernels/csrc/small_gemm.c, amx_gemm.c):
float32 `x @ W^T + bias` on panel-packed weights (`SmallGemm`, with the greedy head's passes), and
bfloat16 on AMX tiles for a few rows (`AmxGemm`, with the float32 greedy head's first pass on the
tiles). engine/forward/dense.py's `PackedLinear` hands them their products; docs/engine_speed.md, "Small-batch
linears" and "AMX tiles", has the figures."""

from __future__ import annotations

import ctypes

import torch

from engine.kernels import hugepages
from engine.kernels import kernel_checks as checks


def _gemm_rows(capability: str) -> int | None:
    """The most rows the GEMM takes (`PackedLinear` hands larger products to oneDNN), or None: every
    product, and no oneDNN copy of the weights is kept. Where torch vectorizes with AVX2, as on this
    project's host, the GEMM (8-lane, like oneDNN there) was the faster at every row count measured,
    1 to 2048 (docs/engine_speed.md, "Small-batch linears"): None. Where oneDNN has wider vectors
    (AVX-512) or another ISA, it keeps what the GEMM did not measurably win there: past 64 rows."""
    return None if capability == "AVX2" else 64


SMALL_ROWS = _gemm_rows(torch.backends.cpu.get_cpu_capability())
GEMM_REACH = "every product" if SMALL_ROWS is None else f"up to {SMALL_ROWS} rows"  # what it takes, in words


def _gemm_args(name: str, panels: torch.Tensor, bias: torch.Tensor | None, n: int, numel: int,
               bias_dtype: torch.dtype | None = None) -> None:
    """The panels of an `[n, K]` weight (`numel` of them) and its bias, as the GEMM reads them."""
    checks.at_least(f"{name}: panels", panels, numel)
    if bias is not None:
        checks.at_least(f"{name}: bias", bias, n)
        dtype = bias_dtype or panels.dtype
        checks.require(bias.dtype == dtype, lambda: f"{name}: bias {bias.dtype}, not {dtype}")


class SmallGemm:
    """`pd_f32_pack` / `pd_f32_gemm`: float32 `x @ W^T + bias` (for up to SMALL_ROWS rows, where that is set)."""

    dtype = torch.float32
    max_rows = SMALL_ROWS  # None: every product (no oneDNN copy)
    reach = GEMM_REACH

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._pack, self._gemm, self._greedy = lib.pd_f32_pack, lib.pd_f32_gemm, lib.pd_f32_greedy
        self._arena = hugepages.Arena()  # every step reads the panels end to end: 2 MiB pages

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """`[N, K]` float32 -> its panels, `[ceil(N / 16) * K * 16]`."""
        checks.require(weight.dtype == torch.float32 and weight.dim() == 2,
                       lambda: f"small gemm pack: a float32 [N, K] weight, not {weight.dtype} {tuple(weight.shape)}")
        n, k = weight.shape
        weight = weight.detach().contiguous()
        panels = self._arena.take(-(-n // 16) * k * 16)
        self._pack(weight.data_ptr(), n, k, panels.data_ptr())
        return panels

    def half(self, panels: torch.Tensor) -> torch.Tensor:
        """The panels rounded to half floats (nearest even), laid out alike: the greedy head's first pass."""
        half = self._arena.take(panels.numel() // 2).view(torch.float16)
        half.copy_(panels)
        return half

    def greedy(self, x: torch.Tensor, panels: torch.Tensor, half: torch.Tensor, bias: torch.Tensor | None,
               norms: torch.Tensor, rel: float, abs_: float, approx: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`pd_f32_greedy`: x `[M, K]` (rows contiguous) -> (`[M]` int64, the argmax of each row of
        `x @ W^T + bias` as `self(...)` computes it; `[M]` int32, the float32 panels each row reread),
        or None where a value is not finite. `norms`: `[n]` float32, each at least its |W_j|;
        `approx`: `[>= M * n]` float32 scratch; `half` None: `approx` holds the first pass already
        (`AmxGemm.head_approx`), `rel` and `abs_` its bound."""
        m, k = x.shape
        n = norms.numel()
        checks.rows_of("greedy head: x", x, (torch.float32,))
        checks.at_least("greedy head: approx", approx, m * n)
        checks.at_least("greedy head: panels", panels, -(-n // 16) * k * 16)
        tokens, reread = torch.empty(m, dtype=torch.int64), torch.empty(m, dtype=torch.int32)
        rc = self._greedy(x.data_ptr(), x.stride(0), panels.data_ptr(), None if half is None else half.data_ptr(),
                          None if bias is None else bias.data_ptr(), norms.data_ptr(), approx.data_ptr(), m, n, k,
                          rel, abs_, tokens.data_ptr(), reread.data_ptr(), torch.get_num_threads())
        return (tokens, reread) if rc == 0 else None

    def __call__(self, x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, n: int,
                 threads: int | None = None) -> torch.Tensor:
        """x `[M, K]` (rows contiguous) -> `[M, n]`, for any M; on torch's thread count unless told."""
        m, k = x.shape
        checks.rows_of("small gemm: x", x, (torch.float32,))
        _gemm_args("small gemm", panels, bias, n, -(-n // 16) * k * 16)
        out = torch.empty(m, n, dtype=torch.float32)
        self._gemm(x.data_ptr(), x.stride(0), panels.data_ptr(), None if bias is None else bias.data_ptr(),
                   out.data_ptr(), n, m, n, k, threads or torch.get_num_threads())
        return out


class AmxGemm:
    """`pd_amx_pack` / `pd_amx_gemm`: bfloat16 `x @ W^T + bias` on AMX tiles for up to `kernel_rows`
    rows (engine/kernels/csrc/amx_gemm.c), where the CPU has AMX and the OS lets the process use it (`ready`);
    `PackedLinear` gives it up to `max_rows`."""

    dtype = torch.bfloat16
    kernel_rows = 256  # the most rows one call takes
    # the engine's cut: oneDNN takes larger products. SmolLM2's 210 linears, 2 threads (bench_linears
    # --dtype bfloat16, 2026-12-03): 0.66x oneDNN's time at 1-16 rows, 0.72-0.75x at 24-32, 1.06-1.19x
    # at 40-64 (three and four row tiles, one panel at a time)
    max_rows = 32
    reach = "bfloat16 up to 32 rows on AMX tiles"

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._pack, self._gemm, self._ready = lib.pd_amx_pack, lib.pd_amx_gemm, lib.pd_amx_gemm_ready
        self._head_approx, self._prefetch = lib.pd_amx_head_approx, lib.pd_amx_prefetch
        self._arena = hugepages.Arena()  # every step reads the panels end to end: 2 MiB pages

    def ready(self) -> bool:
        return bool(self._ready())

    def prefetch(self, steps: int) -> int:
        """`pd_amx_prefetch`: calls of up to 16 rows, and the int8 head's first pass, prefetch the
        weights' tiles `steps` k-steps ahead (0: none; the same bits either way); returns the setting
        before. Process-wide, for tests and measurements."""
        return int(self._prefetch(max(int(steps), 0)))

    def head_approx(self, x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, n: int,
                    approx: torch.Tensor) -> bool:
        """`pd_amx_head_approx`: approx[:M * n] = x `[M, K]` float32 (rows contiguous) times the
        bfloat16 panels (`pack` of the weight rounded to bfloat16), x in two bfloat16 parts, plus the
        float32 bias; False where the tiles cannot serve (no AMX; a row whose largest |x| is under
        2^-60, or NaN): the caller takes the full product."""
        m, k = x.shape
        checks.rows_of("AMX head: x", x, (torch.float32,))
        checks.at_least("AMX head: approx", approx, m * n)
        _gemm_args("AMX head", panels, bias, n, -(-n // 16) * -(-k // 32) * 512, bias_dtype=torch.float32)
        rc = self._head_approx(x.data_ptr(), x.stride(0), panels.data_ptr(), None if bias is None else bias.data_ptr(),
                               approx.data_ptr(), m, n, k, torch.get_num_threads())
        if rc == -2:
            raise MemoryError(f"the AMX head could not stage {m} rows")
        return rc == 0

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """`[N, K]` bfloat16 -> its panels, `[ceil(N / 16) * ceil(K / 32) * 512]` bfloat16."""
        n, k = weight.shape
        checks.require(weight.dtype == torch.bfloat16 and weight.dim() == 2,
                       lambda: f"AMX pack: a bfloat16 [N, K] weight, not {weight.dtype} {tuple(weight.shape)}")
        weight = weight.detach().contiguous()
        numel = -(-n // 16) * -(-k // 32) * 512
        panels = self._arena.take(numel // 2).view(torch.bfloat16)
        self._pack(weight.data_ptr(), n, k, panels.data_ptr())
        return panels

    def __call__(self, x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, n: int,
                 threads: int | None = None) -> torch.Tensor:
        """x `[M, K]` bfloat16 (rows contiguous, M <= kernel_rows) -> `[M, n]` bfloat16."""
        m = x.shape[0]
        checks.rows_of("AMX gemm: x", x, (torch.bfloat16,))
        checks.require(m <= self.kernel_rows, lambda: f"AMX gemm: {m} rows, more than the {self.kernel_rows} a call takes")
        return _panels_gemm(self._gemm, "AMX GEMM", x, panels, bias, n, threads,
                            lambda rc: f"pd_amx_gemm failed ({rc}): AMX unavailable, or {m} rows")


class Bf16Gemm:
    """`pd_bf16_gemm`: bfloat16 `x @ W^T + bias` on `AmxGemm.pack`'s panels, on AMX tiles where they
    run (64 rows a call, the same bits), else by AVX512-BF16's vdpbf16ps, else by AVX2's FMAs on the
    pairs widened, any row count (engine/kernels/csrc/bf16_gemm.c);
    the one bfloat16 GEMM `PackedLinear` and the kernel layers call, so both take the same path. `path`
    says which, or "" where neither runs here (oneDNN takes bfloat16's linears)."""

    dtype = torch.bfloat16
    PATHS = {2: "AMX", 1: "AVX512-BF16", 3: "AVX2", 0: ""}  # pd_bf16_gemm_path's answer, in words
    # the engine's cut on vectors: None, every product (and no oneDNN copy of the weights), so prompt
    # chunks and mixed steps run as one kernel call per layer too. SmolLM2 in bfloat16, 2 threads, AMD
    # EPYC Zen 4 (2026-12-04, engine steps side by side, oneDNN's linears / cut at 32 / every product):
    # a 512-token prompt 273.7 / 276.8 / 245.4 ms, a 48-row decode step 590 / 560 / 391 ms (a loaded host)
    VECTOR_ROWS: int | None = None

    def __init__(self, lib: ctypes.CDLL, amx: AmxGemm) -> None:
        self._gemm, self._path, self._greedy = lib.pd_bf16_gemm, lib.pd_bf16_gemm_path, lib.pd_bf16_greedy
        self._i8_ready, self._i8_pack, self._i8_greedy = lib.pd_i8_head_ready, lib.pd_i8_head_pack, lib.pd_bf16_greedy_i8
        self.pack = amx.pack  # the tiles' pair layout is vdpbf16ps's too
        self._arena = amx._arena  # the int8 copy, read end to end every greedy step: 2 MiB pages too

    def int8_head_ready(self) -> bool:
        """Whether a greedy head's int8 first pass runs here (AMX-INT8 tiles, the GEMM on AMX)."""
        return self.path == "AMX" and bool(self._i8_ready())

    def int8_copy(self, panels: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, float] | None:
        """`pd_i8_head_pack`: the int8 copy of a bfloat16 head's panels and its per-column bounds
        (engine/kernels/csrc/greedy_i8.c), and its largest |weight|; None where AMX-INT8 does not run
        here or a weight is not finite."""
        if not self.int8_head_ready():
            return None
        _gemm_args("int8 head copy", panels, None, n, -(-n // 16) * -(-k // 32) * 512)
        width = -(-n // 16) * 16
        q = self._arena.take(width * -(-k // 64) * 16).view(torch.int8)
        cols = torch.empty(5, width)
        if self._i8_pack(panels.data_ptr(), n, k, q.data_ptr(), cols.data_ptr()) != 0:
            return None
        return q, cols, float(cols[0].max()) * 127 * (1 + 2**-20)

    def greedy_int8(self, x: torch.Tensor, panels: torch.Tensor, copy: tuple, n: int, most: float,
                    upper: torch.Tensor) -> tuple[torch.Tensor | None, int, int]:
        """`pd_bf16_greedy_i8`: (tokens or None, its return code, the panels it reran or -1): the tokens
        `greedy` gives, from `int8_copy`'s first pass and an exact rerun of the candidate panels; None
        with code 2 where that pass does not decide (take `greedy`), 1 a NaN output, -1 not here."""
        m, k = x.shape
        checks.rows_of("int8 greedy head: x", x, (torch.bfloat16,))
        checks.require(m <= 16, lambda: f"int8 greedy head: {m} rows, more than 16")
        q, cols, wmax = copy
        checks.at_least("int8 greedy head: upper", upper, m * -(-n // 16))
        tokens, reread = torch.empty(m, dtype=torch.int64), torch.empty(1, dtype=torch.int64)
        rc = self._i8_greedy(x.data_ptr(), x.stride(0), panels.data_ptr(), q.data_ptr(), cols.data_ptr(), m, n, k,
                             wmax, most, upper.data_ptr(), tokens.data_ptr(), reread.data_ptr(), torch.get_num_threads())
        if rc == -2:
            raise MemoryError(f"the int8 greedy head could not stage {m} rows")
        return (tokens if rc == 0 else None), rc, int(reread[0])

    def greedy(self, x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor | None:
        """`pd_bf16_greedy`: x `[M, K]` bfloat16 (rows contiguous) -> `[M]` int64, the argmax of each
        row of this GEMM's `[M, n]` output (the first on a tie) without writing it; None where a row's
        output has a NaN or the fused head does not run here (neither vdpbf16ps nor AMX, or on AMX
        more than the 256 rows a call takes)."""
        m, k = x.shape
        checks.rows_of("bfloat16 greedy head: x", x, (torch.bfloat16,))
        _gemm_args("bfloat16 greedy head", panels, bias, n, -(-n // 16) * -(-k // 32) * 512)
        tokens = torch.empty(m, dtype=torch.int64)
        rc = self._greedy(x.data_ptr(), x.stride(0), panels.data_ptr(), None if bias is None else bias.data_ptr(),
                          m, n, k, tokens.data_ptr(), torch.get_num_threads())
        if rc == -2:
            raise MemoryError(f"the bfloat16 greedy head could not stage {m} rows")
        return tokens if rc == 0 else None

    @property
    def path(self) -> str:
        """"AMX", "AVX512-BF16", "AVX2" (pairs widened to float32 FMAs), or "" (none here); AMX follows
        `AmxSwitch`."""
        return self.PATHS[self._path()]

    def ready(self) -> bool:
        return bool(self.path)

    @property
    def max_rows(self) -> int | None:
        """`PackedLinear`'s cut (None: every product, and no oneDNN copy of the weights)."""
        return AmxGemm.max_rows if self.path == "AMX" else self.VECTOR_ROWS

    @property
    def reach(self) -> str:
        how = {"AMX": "on AMX tiles", "AVX512-BF16": "by vdpbf16ps (AVX512-BF16)"}.get(self.path, "by AVX2 FMAs")
        return f"bfloat16 {'every product' if self.max_rows is None else f'up to {self.max_rows} rows'} {how}"

    def __call__(self, x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, n: int,
                 threads: int | None = None) -> torch.Tensor:
        """x `[M, K]` bfloat16 (rows contiguous) -> `[M, n]` bfloat16."""
        checks.rows_of("bfloat16 gemm: x", x, (torch.bfloat16,))
        return _panels_gemm(self._gemm, "bfloat16 GEMM", x, panels, bias, n, threads,
                            lambda rc: f"pd_bf16_gemm failed ({rc}): no bfloat16 GEMM here")


def _panels_gemm(gemm, name: str, x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, n: int,
                 threads: int | None, failed) -> torch.Tensor:
    """`gemm` (pd_amx_gemm or pd_bf16_gemm) over `AmxGemm.pack`'s panels: x `[M, K]` bfloat16 ->
    `[M, n]` bfloat16; its return code -2 (staging memory) is a MemoryError, any other non-zero a
    RuntimeError saying `failed(rc)`."""
    m, k = x.shape
    _gemm_args(name.replace("GEMM", "gemm"), panels, bias, n, -(-n // 16) * -(-k // 32) * 512)
    out = torch.empty(m, n, dtype=torch.bfloat16)
    if m == 0:
        return out
    rc = gemm(x.data_ptr(), x.stride(0), panels.data_ptr(), None if bias is None else bias.data_ptr(),
              out.data_ptr(), n, m, n, k, threads or torch.get_num_threads())
    if rc == -2:
        raise MemoryError(f"the {name} could not stage {m} rows")
    if rc != 0:
        raise RuntimeError(failed(rc))
    return out
