"""The CPU decode kernel (engine/kernels/cpu_kernel.py): the same attention as each row's own keys give,
built once per source and compiler, token-exact in the engine on and off, and what happens when it
cannot be built (`engine.cpu_kernels: auto` runs SDPA and says why; `on` refuses)."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from checkpoints.families import WINDOW
from engine.config import EngineConfig
from engine.forward import dense
from engine.kernels import cpu_kernel, kernel_build
from engine.llm_engine import LLMEngine
from engine.model_runner import ModelRunner
from microbench.device_check import staggered_tokens
from tests.kernel_util import KERNELS, WHY, attention_on
from tests.kernel_util import attention_reference as _reference
from tests.reference import hf_greedy
from tests.test_fused import _avx2_fma

ROOT = Path(__file__).resolve().parent.parent

KERNEL = KERNELS.decode if KERNELS else None
needs_kernel = pytest.mark.skipif(KERNEL is None, reason=f"no CPU decode kernel here: {WHY}")


@needs_kernel
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize("dim", [16, 20, 64, 72])
@pytest.mark.parametrize("window, softcap", [(0, 0.0), (9, 0.0), (0, 5.0)])
@pytest.mark.parametrize("block_size", [4, 16])  # 16: a bfloat16 pool's scores on AMX tiles, where the host has them
def test_the_kernel_attends_each_row_over_its_own_keys(dtype, tol, rows, dim, window, softcap, block_size):
    torch.manual_seed(rows)
    layers, blocks, kv_heads, heads = 3, 64, 2, 6
    pool = torch.randn(blocks, layers, 2, block_size, kv_heads, dim).to(dtype)
    k_cache, v_cache = pool[:, 1, 0], pool[:, 1, 1]  # one layer's strided views, as the op passes them
    lens = torch.tensor([1, 4, 5, 23, 40][:rows] + [random.Random(i).randint(1, 40) for i in range(rows - 5)])
    width = -(-int(lens.max()) // block_size)
    tables = torch.stack([torch.randperm(blocks)[:width] for _ in range(rows)])
    query = torch.randn(1, heads, rows, dim).to(dtype)[0].transpose(0, 1)  # [rows, H, D], strided like the op's
    out = torch.full((rows, heads, dim), float("nan"), dtype=dtype)
    KERNEL(query, k_cache, v_cache, tables, lens, out, 0.3, window, softcap)
    expected = _reference(query, k_cache, v_cache, tables, lens, 0.3, window, softcap)
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol)


@needs_kernel
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("small_rows", [64, None])
def test_the_small_gemm_equals_linear_and_takes_the_rows_it_is_set_to(bias, small_rows):
    """Panels of 16 columns (here 40 outputs: two whole panels and a part), tiles of up to six rows
    (every tile size and tile count), inputs strided or not. With a cut (`SMALL_ROWS` where oneDNN has
    wider vectors) oneDNN takes the larger products; without one (AVX2 hosts) the GEMM takes every
    product and no oneDNN copy of the weight is made."""
    torch.manual_seed(3)
    linear = nn.Linear(72, 40, bias=bias)
    packed = dense.PackedLinear(linear, keep_weight=False, gemm=KERNELS.gemm, small_rows=small_rows)
    assert (packed.packed is None) == (small_rows is None)
    calls = []
    gemm = packed.gemm
    packed.gemm = lambda *a: calls.append(a[0].shape[0]) or gemm(*a)
    counts = (*range(1, 130), 512, 1100)
    for rows in counts:
        x = torch.randn(1, rows, 72)
        torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-5)
    wide = torch.randn(1, 5, 144)[..., ::2]  # a strided view: copied before the kernel reads it
    torch.testing.assert_close(packed(wide), linear(wide), rtol=1e-5, atol=1e-5)
    taken = [rows for rows in counts if small_rows is None or rows <= small_rows]
    assert calls == [*taken, 5]  # the others went to oneDNN


def test_the_gemm_takes_every_product_where_torch_vectorizes_with_avx2():
    assert cpu_kernel._gemm_rows("AVX2") is None
    assert cpu_kernel._gemm_rows("AVX512") == cpu_kernel._gemm_rows("DEFAULT") == 64


@needs_kernel
def test_the_small_gemm_gives_a_row_the_same_bits_in_any_batch():
    """Each output is one sum over k in order, whatever tile its row falls in: a sequence's logits do
    not change with the batch it decodes in (1 row alone, or any row of 2..300)."""
    torch.manual_seed(5)
    weight, x = torch.randn(40, 72), torch.randn(300, 72)
    panels = KERNELS.gemm.pack(weight)
    alone = torch.cat([KERNELS.gemm(x[i:i + 1], panels, None, 40) for i in range(len(x))])
    for rows in range(2, len(x) + 1):
        assert torch.equal(KERNELS.gemm(x[:rows], panels, None, 40), alone[:rows]), f"{rows} rows"


_TEAMS = """
import sys, torch
from engine.kernels import cpu_kernel
gemm = cpu_kernel.load()[0].gemm
torch.manual_seed(7)
weight, x = torch.randn(200, 96), torch.randn(16, 96)
panels = gemm.pack(weight)
alone = gemm(x, panels, None, 200, threads=1)
for threads in (2, 3, 8, 500):  # 500: more threads than jobs
    assert torch.equal(gemm(x, panels, None, 200, threads=threads), alone), threads
print("ok")
"""


@needs_kernel
@pytest.mark.parametrize("limit", [None, "2"])
def test_the_small_gemm_gives_the_same_bits_on_any_team(limit):
    """The threads share the jobs and take the rest of a slower one's share from its back: every job is
    done once, by whichever thread, so the product is the same bits on 1, 2, 3, 8 or 500 threads, and
    when the OpenMP runtime gives a smaller team than asked for (OMP_THREAD_LIMIT=2 with 8 asked: the
    shares nobody owns are taken from the back)."""
    env = {**os.environ, **({"OMP_THREAD_LIMIT": limit} if limit else {})}
    done = subprocess.run([sys.executable, "-c", _TEAMS], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


@needs_kernel
def test_an_engine_with_the_kernels_runs_few_row_linears_on_them(llama_dir):
    runner = ModelRunner(EngineConfig(model_path=llama_dir, dtype="float32", num_blocks=16))
    assert dense.small_gemm_layers(runner.model) == sum(1 for m in runner.model.modules() if isinstance(m, dense.PackedLinear))
    assert dense.small_gemm_layers(runner.model) > 0
    assert f", linears by the CPU kernel ({cpu_kernel.GEMM_REACH})" in runner.describe()
    packed = [m for m in runner.model.modules() if isinstance(m, dense.PackedLinear)]
    assert all((m.packed is None) == (cpu_kernel.SMALL_ROWS is None) for m in packed)  # oneDNN's copy only with a cut
    off = ModelRunner(EngineConfig(model_path=llama_dir, dtype="float32", num_blocks=16, cpu_kernels="off"))
    assert dense.small_gemm_layers(off.model) == 0 and "by the CPU kernel" not in off.describe()


@needs_kernel
@pytest.mark.parametrize("family", ["llama", "gemma2"])
@pytest.mark.parametrize("setting", ["on", "off"])
def test_attention_by_the_kernels_or_by_sdpa_gives_generates_tokens(family_dir, llama_dir, family, setting):
    """Gemma 2 is the family that asks most of decode attention: windows on 3 of 4 layers,
    soft-capping, query_pre_attn_scalar; 4-token blocks the window does not divide."""
    path = llama_dir if family == "llama" else family_dir("gemma2")
    engine = LLMEngine(EngineConfig(model_path=path, dtype="float32", num_blocks=256, block_size=4, chunk_size=5,
                                    max_num_batched_tokens=64, cpu_kernels=setting))
    assert (engine.runner.decode_kernel is not None) == (setting == "on")
    assert ("decode and prefill attention by the CPU kernels" in engine.runner.describe()) == (setting == "on")
    if setting == "on":  # the start-up line names what runs: e.g. "AVX512-BF16, AVX-512, AVX2 (native build; ...)"
        assert engine.runner.describe().startswith(f"CPU kernels {KERNELS.paths()}; ")
        assert engine.runner.kernel_isa == KERNELS.best() in KERNELS.paths()
    rng = random.Random(21)
    prompts = [[rng.randrange(10, 2000) for _ in range(rng.randint(1, 60))] for _ in range(6)]
    prompts.append([rng.randrange(10, 2000) for _ in range(4 * WINDOW)])  # several windows long
    assert staggered_tokens(engine, prompts, 10) == [hf_greedy(path, p, 10, ignore_eos=True) for p in prompts]
    assert engine.allocator.num_used == 0


def test_without_a_kernel_auto_runs_sdpa_and_says_why_and_on_refuses(llama_dir, monkeypatch, caplog):
    monkeypatch.setattr(cpu_kernel, "load", lambda: (None, "no C compiler on PATH (cc, gcc or $CC)"))
    runner = ModelRunner(EngineConfig(model_path=llama_dir, dtype="float32", num_blocks=16))
    assert runner.decode_kernel is None and runner.kernel_isa == "torch"
    assert "engine.cpu_kernels: auto runs torch's slower paths: no C compiler on PATH" in caplog.text  # never silent
    assert runner.describe().startswith("CPU kernels none (torch's paths); llama in float32 on cpu")
    assert ", decode attention by SDPA (no C compiler on PATH (cc, gcc or $CC))," in runner.describe()
    assert runner.describe().endswith("(rotary by torch) and 2 MLPs on one gate|up, the decoder's loop as direct calls")
    with pytest.raises(ValueError, match=r"cpu_kernels is on, but no C compiler on PATH"):
        ModelRunner(EngineConfig(model_path=llama_dir, dtype="float32", num_blocks=16, cpu_kernels="on"))
    with pytest.raises(ValueError, match=r"cpu_kernels is on, but the kernel runs on CPU in float32 or "
                                         r"bfloat16, not cpu torch.float16"):
        ModelRunner(EngineConfig(model_path=llama_dir, dtype="float16", num_blocks=16, cpu_kernels="on"))
    with pytest.raises(ValueError, match="cpu_kernels"):
        EngineConfig(model_path=llama_dir, cpu_kernels="sometimes")


def test_a_build_names_what_failed_and_a_built_kernel_is_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_KERNEL_CACHE", str(tmp_path))
    with pytest.raises(cpu_kernel.KernelUnavailable, match="--version failed"):
        kernel_build.build(str(tmp_path / "no-such-cc"))
    failing = tmp_path / "failing-cc"
    failing.write_text("#!/bin/sh\n[ \"$1\" = --version ] && echo failing-cc 1.0 && exit 0\necho 'error: no space' >&2\nexit 1\n")
    failing.chmod(0o755)
    with pytest.raises(cpu_kernel.KernelUnavailable, match=r"failing-cc failed to build amx_gemm.c, argmax.c, bf16_gemm.c, decode_amx.c, greedy_i8.c, isa.c, layer.c, layer_cols.c, layer_team.c, paged_decode.c, paged_prefill.c, prefill_amx.c, rms_norm.c, rope.c, silu_mul.c and small_gemm.c: error: no space"):
        kernel_build.build(str(failing))
    assert [p.name for p in tmp_path.iterdir() if p.suffix == ".so"] == []  # nothing half-built left behind
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv("PDSERVE_KERNEL_CACHE", str(blocked / "kernels"))  # under a file: cannot be made
    with pytest.raises(cpu_kernel.KernelUnavailable, match=r"cannot write the kernel cache .*a-file/kernels .*set "
                                                           r"PDSERVE_KERNEL_CACHE to a writable directory"):
        kernel_build.build(str(failing))
    monkeypatch.setenv("PDSERVE_KERNEL_CACHE", str(tmp_path))
    if KERNEL is None:
        return
    # The compiles are recorded, not run: the real compile into an empty PDSERVE_KERNEL_CACHE is
    # tests/test_wheel.py's (from the installed sources), and the session's own load compiles
    # where the default cache is cold; a second real one here cost ~10 s and checked nothing more.
    compiled: list = []

    def record(cc, name, target):
        compiled.append(target)
        target.write_bytes(b"a library")
        target.chmod(0o755)
    monkeypatch.setattr(kernel_build, "_compile", record)
    cc = kernel_build.compiler()
    built = kernel_build.build(cc)
    assert built.parent == tmp_path and compiled == [built]  # nothing cached: built, into the cache
    stamp = built.stat().st_mtime_ns
    assert kernel_build.build(cc) == built and built.stat().st_mtime_ns == stamp  # reused, not rebuilt
    assert compiled == [built]
    header = tmp_path / "vec.h"  # the sources' shared header is part of the name too
    header.write_text(kernel_build.HEADERS[0].read_text() + "\n/* changed */\n")
    monkeypatch.setattr(kernel_build, "HEADERS", (header,))
    rebuilt = kernel_build.build(cc)
    assert rebuilt != built and compiled == [built, rebuilt]  # a new name, so built afresh


@pytest.fixture
def decode_path(amx):
    """The decode kernel with a bfloat16 pool's scores on AMX tiles (where this host has them), or on
    vectors."""
    yield from attention_on(amx)


@needs_kernel
@pytest.mark.parametrize("rows, dim, kv_heads, heads, window", [
    (1, 64, 3, 9, 0), (17, 72, 2, 6, 9), (5, 20, 1, 4, 0),
    # AVX-512's paths: query heads taken 3 + 1 (scores), 4 (values), 2, 3 + 2 and 4 + 4 + 1 a KV head;
    # values in 32-dim pieces; Gemma 3's shape (head dim 256, one KV head, four query heads)
    (3, 128, 2, 8, 0), (4, 96, 2, 4, 9), (2, 32, 4, 20, 0), (3, 64, 1, 16, 21), (2, 64, 1, 9, 0),
    (2, 256, 1, 4, 0)])
@pytest.mark.parametrize("amx", [True, False], ids=["amx", "vectors"])
def test_bfloat16_decode_is_the_float32_kernel_on_the_widened_pool_rounded(rows, dim, kv_heads, heads, window, amx,
                                                                           decode_path):
    """A bfloat16 pool's keys and values are widened (exactly), then the float32 arithmetic runs
    (with AVX-512, values widened in registers and up to four query heads at once, the same sums in
    the same order): the output is the float32 kernel's on the widened inputs, rounded to bfloat16,
    bit for bit. Queries and keys are -1, 0 or 1, so every score is exact whatever the order of its
    sum (the scores on AMX tiles, or by vdpbf16ps, are summed in their own orders, not the float32
    kernel's): everything after the scores is compared bit for bit."""
    torch.manual_seed(rows * dim)
    blocks, block_size = 48, 16
    pool = torch.randn(blocks, 2, 2, block_size, kv_heads, dim).bfloat16()
    pool[:, :, 0] = torch.randint(-1, 2, pool[:, :, 0].shape).bfloat16()
    lens = torch.tensor([random.Random(i).randint(1, 300) for i in range(rows)])
    tables = torch.stack([torch.randperm(blocks)[:-(-300 // block_size)] for _ in range(rows)])
    query = torch.randint(-1, 2, (rows, heads, dim)).bfloat16()
    out = torch.empty(rows, heads, dim, dtype=torch.bfloat16)
    KERNEL(query, pool[:, 1, 0], pool[:, 1, 1], tables, lens, out, 0.125, window, 0.0)
    wide = pool.float()
    want = torch.empty(rows, heads, dim)
    KERNEL(query.float(), wide[:, 1, 0], wide[:, 1, 1], tables, lens, want, 0.125, window, 0.0)
    assert torch.equal(out.view(torch.int16), want.bfloat16().view(torch.int16))


@needs_kernel
def test_bfloat16_decode_by_the_kernel_gives_generates_bfloat16_tokens(llama_dir):
    """A bfloat16 pool: the kernel widens it to float32 on load and rounds its output to nearest
    even; greedy tokens equal transformers' `generate` run in bfloat16 (same checkpoint). Where the
    CPU has AMX, few-row linears run on its tiles (the AMX GEMM), larger ones by oneDNN; where it has
    AVX512-BF16 without AMX (AMD Zen 4), every linear by vdpbf16ps and every step (prompt chunks
    too) one kernel call per layer."""
    from transformers import AutoModelForCausalLM

    engine = LLMEngine(EngineConfig(model_path=llama_dir, dtype="bfloat16", num_blocks=256, chunk_size=16))
    assert engine.runner.decode_kernel is not None
    assert engine.runner.small_gemm is KERNELS.gemm_for(torch.bfloat16)  # None without AMX: oneDNN takes all
    assert (dense.small_gemm_layers(engine.runner.model) > 0) == (engine.runner.small_gemm is not None)
    vectors = engine.runner.small_gemm is not None and engine.runner.small_gemm.path in ("AVX512-BF16", "AVX2")
    if vectors and _avx2_fma():  # the SiLU kernel's condition for whole layers
        assert engine.runner.forward.kernel_decoder is not None and engine.runner.small_gemm.max_rows is None
    rng = random.Random(5)
    prompts = [[rng.randrange(10, 2000) for _ in range(rng.randint(1, 60))] for _ in range(6)]
    got = staggered_tokens(engine, prompts, 12)
    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.bfloat16).eval()
    with torch.inference_mode():
        expected = [model.generate(torch.tensor([p]), max_new_tokens=12, min_new_tokens=12, do_sample=False)[0, len(p):].tolist()
                    for p in prompts]
    assert got == expected
    assert engine.allocator.num_used == 0


@needs_kernel
@pytest.mark.parametrize("rows, n", [(1, 1), (1, 7), (3, 8), (2, 9), (16, 49152), (5, 1003), (64, 2048)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_argmax_kernel_gives_torchs_argmax(rows, n, dtype):
    """torch's argmax of the rows (bfloat16 ones: of the rows converted to float32, which the kernel
    does not build)."""
    def check(x: torch.Tensor) -> None:
        x = x.to(dtype)
        assert torch.equal(KERNELS.argmax(x), x.float().argmax(dim=-1))

    g = torch.Generator().manual_seed(rows * n)
    x = torch.randn(rows, n, generator=g) * 10
    check(x)
    # ties keep the first largest (same lane and across lanes), -0.0 and 0.0 tie, -inf rows
    tied = torch.zeros(rows, n)
    tied[:, n // 2:] = torch.tensor(-0.0)
    check(tied)
    spread = x.clone()
    spread[:, n - 1] = spread[:, max(0, n - 4)] = spread.max() + 1  # the same best twice: the first
    check(spread)
    assert torch.equal(KERNELS.argmax(torch.full((rows, n), float("-inf"), dtype=dtype)), torch.zeros(rows, dtype=torch.int64))
    # a NaN anywhere is the answer (torch's), the first of several
    nan = x.clone()
    nan[rows - 1, n // 3] = float("nan")
    nan[rows - 1, n - 1] = float("nan")
    check(nan)
    # rows of a wider tensor (a strided view, as the LM head's rows may be)
    check(torch.randn(rows, n + 5, generator=g).to(dtype)[:, :n])


def test_greedy_sampling_takes_the_engines_argmax_where_it_runs_and_torchs_elsewhere(llama_dir):
    from engine import sampler
    logits = torch.randn(4, 300)
    seen = []
    assert torch.equal(sampler.greedy(logits, lambda x: seen.append(x) or x.argmax(dim=-1)), logits.argmax(-1))
    assert len(seen) == 1
    assert torch.equal(sampler.greedy(logits.double(), lambda x: 1 / 0), logits.double().argmax(-1))  # not float32
    on = LLMEngine(EngineConfig(model_path=llama_dir, num_blocks=32, dtype="float32")).runner
    off = LLMEngine(EngineConfig(model_path=llama_dir, num_blocks=32, dtype="float32", cpu_kernels="off")).runner
    assert (on.argmax is not None) == (KERNEL is not None) and off.argmax is None
