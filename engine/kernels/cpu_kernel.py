"""pdserve's CPU kernels (engine/kernels/csrc/*.c): built on first use, then cached.

- decode attention (paged_decode.c): decode rows attend straight from their blocks in the pool:
  no gathered copy of whole blocks, no padding to a group's longest context, no mask
  (docs/engine_speed.md, "Decode attention");
- prefill attention (paged_prefill.c): a prompt chunk's queries attend straight from the pool
  too, tiled so keys and queries are each read once per tile, the causal half skipped; bfloat16
  chunks on AMX tiles where the CPU has them (prefill_amx.c; docs/engine_speed.md, "Prefill
  attention");
- small-batch GEMM (small_gemm.c): a linear layer on a few rows (a decode step) from weights
  packed in 16-column panels (engine/forward/dense.py; docs/engine_speed.md, "Small-batch linears");
  in bfloat16 on AMX tiles (amx_gemm.c), where the CPU has them (engine/kernels/cpu_gemm.py has their
  wrappers);
- rotary embedding (rope.c), RMSNorm (rms_norm.c), SiLU times up (silu_mul.c) and greedy argmax
  (argmax.c): the small ops around them, bit for bit torch's (engine/kernels/cpu_ops.py has their
  wrappers);
- a whole decoder layer (layer.c): the kernels above called in a Llama layer's order from C, one
  call per layer, and the new tokens' K/V written to their slots (engine/forward/kernel_layer.py).

Plain C with OpenMP, compiled together by the host's C compiler (`cc`, or `$CC`) for one variant
(`-march=native` unless `$PDSERVE_KERNEL_ARCH` names another) and cached (engine/kernels/kernel_build.py).
Loaded with ctypes: the OpenMP runtime it links is the one torch already loaded (same soname), so
the kernels and torch share one thread pool.

`load()` returns the kernels or None with the reason (no compiler, a failed build, a distrusted
cache); the engine then runs torch's paths (`engine.cpu_kernels: auto`, with a warning) or refuses
to start (`on`). `Kernels.paths` names the instruction sets the loaded build runs, for start-up.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools

import torch

from engine.kernels import abi, cpu_ops, kernel_build
from engine.kernels import kernel_checks as checks
from engine.kernels.cpu_gemm import GEMM_REACH, SMALL_ROWS, AmxGemm, Bf16Gemm, SmallGemm, _gemm_rows  # noqa: F401 - cpu_kernel's names too
from engine.kernels.cpu_ops import _FLOAT, _I64, _INT, _PTR, KernelUnavailable  # noqa: F401 - KernelUnavailable: cpu_kernel's error too

DTYPES = checks.DTYPES  # what the kernels take, and their C code for it



class DecodeKernel:
    """`pd_paged_decode`, called with tensors."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = lib.pd_paged_decode
        self._checked = checks.Memo()

    def __call__(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 tables: torch.Tensor, lens: torch.Tensor, out: torch.Tensor, scale: float,
                 window: int, softcap: float) -> None:
        """query `[n, H, D]`, k/v_cache `[blocks, block_size, KVH, D]` (one layer's, strided views of
        the pool), tables `[n, max_blocks]` int64, lens `[n]` int64 (keys each row sees, its own
        new one included), out `[n, H, D]` written in place. The last dim of each is contiguous."""
        checks.attention("decode kernel", query, k_cache, v_cache, out)
        n, heads, dim = query.shape
        num_blocks, block_size, kv_heads, _ = k_cache.shape
        checks.require(lens.shape == (n,), lambda: f"decode kernel: {n} query rows, {tuple(lens.shape)} lens")
        if not self._checked.seen(tables, lens, num_blocks, block_size):  # once a step, not once a layer
            checks.decode_tables(tables, lens, num_blocks, block_size)
            self._checked.remember(tables, lens, num_blocks, block_size)
        rc = self._fn(DTYPES[query.dtype], query.data_ptr(), query.stride(0), query.stride(1),
                      k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1),
                      k_cache.stride(2), tables.data_ptr(), tables.stride(0), lens.data_ptr(), out.data_ptr(),
                      out.stride(0), out.stride(1), n, heads, kv_heads, dim, block_size, scale, window,
                      softcap, torch.get_num_threads())
        if rc == -2:
            raise MemoryError(f"the decode kernel could not allocate its scores for {n} rows")
        if rc != 0:
            raise RuntimeError(f"pd_paged_decode failed ({rc}) for dtype {query.dtype}")


class PrefillKernel:
    """`pd_paged_prefill`, called with tensors."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = lib.pd_paged_prefill

    def __call__(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 table: torch.Tensor, first_pos: int, out: torch.Tensor, scale: float,
                 window: int, softcap: float) -> None:
        """One chunk of one sequence: query `[q, H, D]` at positions first_pos .. first_pos + q - 1,
        k/v_cache `[blocks, block_size, KVH, D]` (one layer's views of the pool, the chunk's keys
        already written), table `[>= ceil((first_pos + q) / block_size)]` int64, the sequence's
        blocks; out `[q, H, D]` written in place. The last dim of each is contiguous."""
        checks.attention("prefill kernel", query, k_cache, v_cache, out)
        n, heads, dim = query.shape
        num_blocks, block_size, kv_heads, _ = k_cache.shape
        checks.prefill_table(table, first_pos, n, num_blocks, block_size)
        rc = self._fn(DTYPES[query.dtype], query.data_ptr(), query.stride(0), query.stride(1),
                      k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1),
                      k_cache.stride(2), table.data_ptr(), first_pos, n, out.data_ptr(), out.stride(0),
                      out.stride(1), heads, kv_heads, dim, block_size, scale, window, softcap,
                      torch.get_num_threads())
        if rc == -2:
            raise MemoryError(f"the prefill kernel could not allocate its buffers for {n} queries")
        if rc != 0:
            raise RuntimeError(f"pd_paged_prefill failed ({rc}) for dtype {query.dtype}")


class LayerKernel:
    """`pd_layer_forward`: one decoder layer; its arguments are engine/forward/kernel_layer.py's structures."""

    KINDS = ("small ops", "gemm", "kv write", "decode attention", "prefill attention")  # layer.c's LAYER_* order

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = lib.pd_layer_forward
        self._seconds = (ctypes.c_double * len(self.KINDS)).in_dll(lib, "pd_layer_seconds")
        self._decoder = lib.pd_decoder_forward
        self._team, self._team_steps = lib.pd_use_team, lib.pd_team_steps
        self._overlap, self._lag = lib.pd_team_overlap, lib.pd_team_lag
        self._cols, self._cols_steps = lib.pd_use_cols, lib.pd_cols_steps

    def use_team(self, rows: int) -> int:
        """`pd_use_team`: `decoder` runs steps of at least `rows` tokens on two or more threads as one
        OpenMP region split by rows (layer_team.c), 0 never; returns the setting before. Process-wide:
        for tests and measurements of either path (the outputs are the same bits)."""
        return int(self._team(max(int(rows), 0)))

    def team_takes(self, tokens: int, threads: int) -> bool:
        """Whether `decoder` runs a step of `tokens` rows on `threads` threads as one region, whose
        GEMMs then take tiles of at most 64 rows (so a step past the GEMM's cut may run there)."""
        rows = int(self._team(-1))
        return threads > 1 and 0 < rows <= tokens

    def team_overlap(self, on: bool) -> bool:
        """`pd_team_overlap`: on that path, a rows or attention item starts as soon as the items it
        reads are done, so one thread's GEMMs run beside the other's attention (on), or only once
        the whole previous phase is (off); returns the setting before. Process-wide, for tests and
        measurements (the outputs are the same bits)."""
        return bool(self._overlap(int(bool(on))))

    def team_lag(self, us: int) -> int:
        """`pd_team_lag`, for tests: on that path the second thread sleeps `us` microseconds after
        claiming each item, so the first runs ahead as far as the waits let it; returns the setting before."""
        return int(self._lag(max(int(us), 0)))

    def team_steps(self) -> int:
        """The steps `decoder` has run as one region so far, in this process."""
        return int(self._team_steps())

    def use_cols(self, on: bool) -> bool:
        """`pd_use_cols`: `decoder` runs bfloat16 steps of up to 16 decode rows on AMX tiles and two or
        more threads as one OpenMP region, the GEMMs split by columns (layer_cols.c); returns the
        setting before. Process-wide, for tests and measurements (the outputs are the same bits)."""
        return bool(self._cols(int(bool(on))))

    def cols_steps(self) -> int:
        """The steps `decoder` has run as one region split by columns so far, in this process."""
        return int(self._cols_steps())

    def seconds(self) -> dict[str, float]:
        """Wall seconds every call so far spent on each kind of work (`KINDS`), summed over the process."""
        return dict(zip(self.KINDS, self._seconds, strict=True))

    def __call__(self, layer: ctypes.Structure, step: ctypes.Structure, x: torch.Tensor, out: torch.Tensor) -> None:
        """x `[..., T, hidden]` of the step's dtype, contiguous; out likewise, written (may be x)."""
        rc = self._fn(ctypes.addressof(layer), ctypes.addressof(step), x.data_ptr(), out.data_ptr())
        self._check(rc, "pd_layer_forward", x)

    def decoder(self, layers: ctypes.Array, step: ctypes.Structure, x: torch.Tensor,
                outs: tuple[torch.Tensor, torch.Tensor], norm: torch.Tensor, eps: float, normed: torch.Tensor) -> None:
        """`pd_decoder_forward`: every layer of `layers` (an array of the layer structures) in turn,
        the outputs in `outs` by turns, then RMSNorm(last output; norm, eps) into `normed` (all
        `[..., T, hidden]` of the step's dtype, contiguous)."""
        rc = self._decoder(ctypes.addressof(layers), len(layers), ctypes.addressof(step), x.data_ptr(),
                           outs[0].data_ptr(), outs[1].data_ptr(), norm.data_ptr(), eps, normed.data_ptr())
        self._check(rc, "pd_decoder_forward", x)

    @staticmethod
    def _check(rc: int, name: str, x: torch.Tensor) -> None:
        if rc == -2:
            tokens = x.numel() // x.shape[-1]
            raise MemoryError(f"a decoder layer's attention or GEMM could not allocate its buffers for {tokens} tokens")
        if rc != 0:
            raise RuntimeError(f"{name} failed ({rc})")


class AmxSwitch:
    """`pd_use_amx`: whether bfloat16 attention takes AMX tiles where the CPU and the OS allow it
    (the default: prefill chunks' scores and values, decode rows' scores), or vectors as float32
    does. Process-wide: for tests and measurements of either path."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = lib.pd_use_amx

    def __call__(self, enable: bool) -> bool:
        """Sets it; returns whether the tiles are now in use."""
        return bool(self._fn(int(enable)))


@dataclasses.dataclass(frozen=True)
class Kernels:
    decode: DecodeKernel
    prefill: PrefillKernel
    gemm: SmallGemm
    rope: cpu_ops.Rope
    rms_norm: cpu_ops.RmsNorm
    silu_mul: cpu_ops.SiluMul
    layer: LayerKernel
    argmax: cpu_ops.Argmax
    use_amx: AmxSwitch
    amx_gemm: AmxGemm
    bf16_gemm: Bf16Gemm
    variant: str  # kernel_build.VARIANTS' name of the build
    isa: int  # engine/kernels/csrc/isa.c's bits: what the build was compiled to use

    def _names(self) -> list[str]:
        names = [name for bit, name in ((4, "AVX512-BF16"), (2, "AVX-512"), (1, "AVX2")) if self.isa & bit]
        return ["AMX", *names] if self.amx_gemm.ready() else names

    def best(self) -> str:
        """The best instruction set the kernels run here, in a word: AMX, AVX512-BF16, AVX-512, AVX2."""
        return (self._names() or ["portable C"])[0]

    def paths(self) -> str:
        """The instruction sets the kernels run here, best first, and the build, e.g.
        "AVX512-BF16, AVX-512, AVX2 (native build; this CPU has no AMX)"."""
        names = self._names()
        amx = names[:1] == ["AMX"]
        if amx:
            why = ""
        elif self.isa & 8:
            why = "; the OS refuses AMX tiles"
        else:
            why = "; this CPU has no AMX" if self.variant == "native" else "; no AMX in this build"
        return f"{', '.join(names) or 'portable C'} ({self.variant} build{why})"

    def gemm_for(self, dtype: torch.dtype) -> SmallGemm | Bf16Gemm | None:
        """The GEMM that takes few-row linears of `dtype` weights here: float32 always, bfloat16 where
        AMX, AVX512-BF16 or AVX2 runs (a build for an older x86: none); None: oneDNN takes them all."""
        if dtype == torch.float32:
            return self.gemm
        return self.bf16_gemm if dtype == torch.bfloat16 and self.bf16_gemm.ready() else None


def supports(dtype: torch.dtype, device: torch.device) -> bool:
    return device.type == "cpu" and dtype in DTYPES


def _open(variant: str) -> Kernels:
    """The kernels of `variant`, built if need be and loaded (KernelUnavailable: why not)."""
    kernel_build.check_runs_here(variant)
    path = kernel_build.build(kernel_build.compiler(), variant)
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        raise KernelUnavailable(f"cannot load {path}: {e}; delete it to rebuild") from e
    abi.bind(lib)
    amx = AmxGemm(lib)
    return Kernels(DecodeKernel(lib), PrefillKernel(lib), SmallGemm(lib), cpu_ops.Rope(lib), cpu_ops.RmsNorm(lib),
                   cpu_ops.SiluMul(lib), LayerKernel(lib), cpu_ops.Argmax(lib), AmxSwitch(lib), amx, Bf16Gemm(lib, amx),
                   variant, _isa(lib))


_load = functools.cache(_open)  # one build and one library per variant and process


def _isa(lib: ctypes.CDLL) -> int:
    return lib.pd_isa()


def load(variant: str | None = None) -> tuple[Kernels | None, str]:
    """The kernels of `variant` (default: `$PDSERVE_KERNEL_ARCH`, else native), or None and why not
    (the reason is "" when they loaded)."""
    try:
        return _load(variant or kernel_build.variant()), ""
    except KernelUnavailable as e:
        return None, str(e)
