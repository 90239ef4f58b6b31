"""Every kernel variant the engine can pick on x86 (engine/kernels/kernel_build.py's `VARIANTS`: native,
AVX-512 without BF16, AVX2) built on this host and checked: attention against a float64 reference,
the small ops bit for bit against torch, the GEMM against `F.linear`, and an engine's greedy tokens
against transformers, also at real head dims (64 and 128, several query heads per KV head). A
variant this CPU cannot run skips, saying what it lacks; one that fails to build fails. Then the
kernels' failure paths: a non-zero return, a build past its time, a library that will not load."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.config import EngineConfig
from engine.kernels import cpu_kernel, kernel_build
from engine.kernels.cpu_ops import KernelUnavailable
from engine.llm_engine import LLMEngine
from protocol.sampling import SamplingParams
from tests.kernel_util import KERNELS, attention_reference
from tests.reference import bf16_near_ties, hf_greedy

# native's builds run every other kernel test (tests/test_cpu_kernel.py and the rest); here the others.
# noamx is native less AMX: a build of its own only where the CPU has AMX (elsewhere it is native's code)
AMX_CPU = "amx_tile" in kernel_build.cpu_flags().split()
VARIANTS = pytest.mark.parametrize("variant", [v for v in kernel_build.VARIANTS
                                               if v != "native" and (v != "noamx" or AMX_CPU)])
PROMPTS = [[5, 17, 300, 42, 8, 99, 1000, 7, 7, 31, 64, 2, 5, 900, 12, 13, 14], [40, 41], list(range(100, 140))]


@pytest.fixture(scope="module")
def built():
    """variant -> its kernels, each built once for the module."""
    kernels = {}

    def get(variant: str) -> cpu_kernel.Kernels:
        if variant not in kernels:
            try:
                kernel_build.check_runs_here(variant)
            except KernelUnavailable as e:
                pytest.skip(str(e))
            loaded, why = cpu_kernel.load(variant)
            assert loaded is not None, f"the {variant} kernels failed to build or load: {why}"
            kernels[variant] = loaded
        return kernels[variant]
    return get


@VARIANTS
def test_each_variant_says_what_it_runs(built, variant):
    k = built(variant)
    expected = {"noamx": "AVX512-BF16, AVX-512, AVX2 (noamx build; no AMX in this build)",
                "avx2": "AVX2 (avx2 build; no AMX in this build)",
                "avx512": "AVX-512, AVX2 (avx512 build; no AMX in this build)"}
    assert k.variant == variant and k.paths() == expected[variant]
    assert k.best() == k.paths().split(",")[0].split(" (")[0]


@VARIANTS
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("dim, kv_heads, heads", [(16, 2, 6), (72, 1, 3), (128, 2, 8)])
def test_each_variant_attends_as_the_reference(built, variant, dtype, tol, dim, kv_heads, heads):
    k = built(variant)
    torch.manual_seed(dim)
    blocks, block_size = 32, 16
    pool = torch.randn(blocks, 2, 2, block_size, kv_heads, dim).to(dtype)
    k_cache, v_cache = pool[:, 1, 0], pool[:, 1, 1]  # one layer's strided views, as the op passes them
    lens = torch.tensor([1, 17, 40, 33])
    tables = torch.stack([torch.randperm(blocks)[:3] for _ in range(4)])
    query, out = torch.randn(4, heads, dim).to(dtype), torch.empty(4, heads, dim, dtype=dtype)
    for window, softcap in ((0, 0.0), (9, 0.0), (0, 5.0)):
        k.decode(query, k_cache, v_cache, tables, lens, out, 0.3, window, softcap)
        expected = attention_reference(query, k_cache, v_cache, tables, lens, 0.3, window, softcap)
        torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol)
    chunk = torch.randn(20, heads, dim).to(dtype)  # positions 13 .. 32 of one sequence
    out = torch.empty(20, heads, dim, dtype=dtype)
    k.prefill(chunk, k_cache, v_cache, tables[2], 13, out, 0.3, 0, 0.0)
    expected = attention_reference(chunk, k_cache, v_cache, tables[2].expand(20, -1), torch.arange(14, 34), 0.3, 0, 0.0)
    tol = 1e-5 if dtype == torch.float32 else tol  # the prefill kernel's online softmax: rescaled sums
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol)


@VARIANTS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_variants_small_ops_are_torchs_bit_for_bit(built, variant, dtype):
    k = built(variant)
    torch.manual_seed(1)
    x, weight = torch.randn(7, 576).to(dtype), torch.randn(576).to(dtype)
    if dtype == torch.float32:
        assert torch.equal(k.rms_norm(x, weight, 1e-5), F.rms_norm(x, (576,), weight, 1e-5))
    gate_up = torch.randn(5, 2 * 256).to(dtype)
    assert torch.equal(k.silu_mul(gate_up), F.silu(gate_up[:, :256]) * gate_up[:, 256:])
    logits = torch.randn(9, 2051).to(dtype)
    assert torch.equal(k.argmax(logits), logits.float().argmax(dim=-1))


@VARIANTS
def test_each_variants_gemm_is_linear(built, variant):
    k = built(variant)
    torch.manual_seed(2)
    weight, bias, x = torch.randn(72, 96), torch.randn(72), torch.randn(37, 96)
    panels = k.gemm.pack(weight)
    torch.testing.assert_close(k.gemm(x, panels, bias, 72), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


@VARIANTS
def test_each_variants_bfloat16_gemm_is_a_bfloat16_linear_with_a_rows_bits_in_any_batch(built, variant):
    """The bfloat16 GEMM each build takes: vdpbf16ps where it has AVX512-BF16 (noamx), else AVX2's FMAs
    on the pairs widened (avx512, avx2); within a bfloat16 rounding of float64's, a part panel past n
    and k padded to 32, and a row's bits the same alone, in any batch and on 1 or 3 threads."""
    k = built(variant)
    gemm = k.gemm_for(torch.bfloat16)
    assert gemm is k.bf16_gemm and gemm.path == {"noamx": "AVX512-BF16", "avx512": "AVX2", "avx2": "AVX2"}[variant]
    torch.manual_seed(3)
    n, kk = 600, 100
    weight, bias, x = torch.randn(n, kk).bfloat16(), torch.randn(n).bfloat16(), torch.randn(23, kk).bfloat16()
    panels = gemm.pack(weight)
    out = gemm(x, panels, bias, n)
    exact = x.double() @ weight.double().T + bias.double()
    torch.testing.assert_close(out.double(), exact, rtol=2 ** -8, atol=1e-2)
    alone = torch.cat([gemm(x[i:i + 1], panels, bias, n) for i in range(len(x))])
    for rows in (2, 5, 6, 11, 16, 23):
        assert torch.equal(gemm(x[:rows], panels, bias, n), alone[:rows]), f"{rows} rows"
    for threads in (1, 3):
        assert torch.equal(gemm(x, panels, bias, n, threads=threads), alone), f"{threads} threads"


@VARIANTS
def test_each_variants_engine_gives_transformers_greedy_tokens(built, variant, llama_dir, monkeypatch):
    built(variant)
    monkeypatch.setenv(kernel_build.VARIANT_ENV, variant)
    engine = LLMEngine(EngineConfig(model_path=llama_dir, dtype="float32", num_blocks=64, block_size=4,
                                    chunk_size=8, cpu_kernels="on"))
    assert f"({variant} build" in engine.runner.describe()
    got = engine.generate(PROMPTS, SamplingParams(max_tokens=10, ignore_eos=True))
    assert got == [hf_greedy(llama_dir, p, 10, ignore_eos=True) for p in PROMPTS]


@pytest.fixture(scope="module")
def real_dims(tmp_path_factory):
    """head_dim -> a Llama checkpoint with that head size and several query heads per KV head."""
    from checkpoints.families import make_family_model

    root = tmp_path_factory.mktemp("real-dims")
    shapes = {64: dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64),
              128: dict(hidden_size=512, num_attention_heads=4, num_key_value_heads=1, head_dim=128)}
    return {dim: str(make_family_model(root / str(dim), "llama", **shape)) for dim, shape in shapes.items()}


@pytest.mark.parametrize("variant, dtype", [("native", "float32"), ("native", "bfloat16"), ("avx2", "float32"),
                                            ("avx2", "bfloat16")])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_real_head_dims_give_transformers_greedy_tokens(built, variant, dtype, head_dim, real_dims, monkeypatch):
    """The AVX-512 splits of query heads and the 32-dim value pieces (native, bfloat16) and the 8-lane
    paths (AVX2, its bfloat16 GEMM too) at the head sizes real models have, compared end to end with
    transformers in the same dtype."""
    built(variant)
    monkeypatch.setenv(kernel_build.VARIANT_ENV, variant)
    path = real_dims[head_dim]
    engine = LLMEngine(EngineConfig(model_path=path, dtype=dtype, num_blocks=64, block_size=16, chunk_size=16,
                                    cpu_kernels="on"))
    assert engine.runner.shape.head_dim == head_dim and engine.runner.decode_kernel is not None
    got = engine.generate(PROMPTS, SamplingParams(max_tokens=8, ignore_eos=True))
    if dtype == "float32":
        assert got == [_greedy(path, p, 8, dtype) for p in PROMPTS]
        return
    # bfloat16: generate's tokens, except where a step's two best logits are a bfloat16 rounding apart
    # (on AMX hosts the engine's tiles and transformers' oneDNN sum in different orders: 2026-12-05,
    # this 17-token prompt's first logits 13.875 / 13.8125, the float32 model's 13.887 / 13.834); such a
    # sequence is checked token by token on transformers' logits along the engine's own tokens
    for prompt, tokens in zip(PROMPTS, got, strict=True):
        if tokens != _greedy(path, prompt, 8, dtype):
            assert bf16_near_ties(path, prompt, tokens), "differs from generate with no near-tie on its way"


def _greedy(path: str, prompt: list[int], tokens: int, dtype: str) -> list[int]:
    if dtype == "float32":
        return hf_greedy(path, prompt, tokens, ignore_eos=True)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    ids = torch.tensor([prompt])
    with torch.inference_mode():  # the mask: a prompt may hold the pad id (2), which generate would otherwise mask
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, min_new_tokens=tokens,
                             do_sample=False)
    return out[0, len(prompt):].tolist()


# ---- failure paths ------------------------------------------------------------------------
@pytest.mark.parametrize("code, error, message", [
    (-2, MemoryError, "could not allocate"), (-1, RuntimeError, r"failed \(-1\)")])
def test_a_kernels_non_zero_return_is_an_error(code, error, message, monkeypatch):
    """Each attention kernel and the AMX GEMM turn their C return codes into errors (a stand-in
    function returns the code, past the checks, which the arguments here pass)."""
    pool = torch.zeros(4, 2, 4, 1, 16)
    q, out = torch.zeros(2, 1, 16), torch.zeros(2, 1, 16)
    for kernel in (KERNELS.decode, KERNELS.prefill):
        monkeypatch.setattr(kernel, "_fn", lambda *args: code)
    with pytest.raises(error, match=message):
        KERNELS.decode(q, pool[:, 0], pool[:, 1], torch.tensor([[1], [2]]), torch.tensor([3, 4]), out, 1.0, 0, 0.0)
    with pytest.raises(error, match=message):
        KERNELS.prefill(q, pool[:, 0], pool[:, 1], torch.tensor([1]), 0, out, 1.0, 0, 0.0)
    monkeypatch.setattr(KERNELS.amx_gemm, "_gemm", lambda *args: code)
    weight = torch.zeros(16, 32, dtype=torch.bfloat16)
    panels = torch.zeros(512, dtype=torch.bfloat16)
    with pytest.raises(error, match="could not stage" if code == -2 else message):
        KERNELS.amx_gemm(weight[:2], panels, None, 16)


def test_a_build_past_its_time_is_unavailable_and_leaves_nothing(tmp_path, monkeypatch):
    slow = tmp_path / "slow-cc"
    slow.write_text("#!/bin/sh\n[ \"$1\" = --version ] && echo slow-cc 1.0 && exit 0\nexec sleep 30\n")
    slow.chmod(0o755)
    monkeypatch.setenv("PDSERVE_KERNEL_CACHE", str(tmp_path / "kernels"))
    monkeypatch.setattr(kernel_build, "BUILD_TIMEOUT_S", 1)
    with pytest.raises(KernelUnavailable, match=r"slow-cc took over 1 s to build amx_gemm.c, "):
        kernel_build.build(str(slow))
    assert list((tmp_path / "kernels").iterdir()) == []


def test_a_library_that_will_not_load_is_unavailable_with_the_reason(tmp_path, monkeypatch):
    """A cached file that is no library (cut short, say): load() says so and names it; auto falls back."""
    fake = tmp_path / "fake-cc"
    fake.write_text("#!/bin/sh\n[ \"$1\" = --version ] && echo fake-cc 1.0 && exit 0\n"
                    "while [ \"$1\" != -o ]; do shift; done\necho 'not ELF' > \"$2\"\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    monkeypatch.setenv("PDSERVE_KERNEL_CACHE", str(tmp_path / "kernels"))
    with pytest.raises(KernelUnavailable, match=rf"cannot load {tmp_path / 'kernels'}/pdserve_kernels-native-\w+\.so: "
                                                r".*; delete it to rebuild"):
        cpu_kernel._open("native")  # what load() returns as its reason (the process's cached kernels aside)


def test_an_unknown_variant_is_named_with_the_choices(monkeypatch):
    monkeypatch.setenv(kernel_build.VARIANT_ENV, "avx9000")
    assert cpu_kernel.load() == (None, "PDSERVE_KERNEL_ARCH='avx9000' is no kernel variant; choose one of native, noamx, "
                                       "avx512, avx2")
