"""The engine's fast paths keep it token-exact: oneDNN-prepacked linears (eager), the compiled
forward with paged attention as an opaque op (compile on, on the Gemma 2 family: windows,
soft-capping, scaling), and the dtype `auto` picks."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from checkpoints.families import FULL, SLIDING, WINDOW, make_family_model
from engine.config import EngineConfig
from engine.forward import dense, switchboard
from engine.llm_engine import LLMEngine
from engine.model_runner import computes_bf16, resolve_dtype
from microbench.device_check import staggered_tokens
from tests.kernel_util import KERNELS, WHY
from tests.reference import hf_greedy


def _prompts(n: int, seed: int, lo: int, hi: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 2000) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _engine(path: str, **kw) -> LLMEngine:
    kw.setdefault("num_blocks", 256)
    return LLMEngine(EngineConfig(model_path=path, dtype="float32", **kw))


def _run(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Arrivals staggered one per step, so steps mix decodes, fresh prompts and chunks (the device
    check's own driver); every block free after."""
    tokens = staggered_tokens(engine, prompts, max_tokens)
    assert engine.allocator.num_used == 0
    return tokens


def test_eager_cpu_forward_runs_on_prepacked_linears_token_exact(llama_dir):
    engine = _engine(llama_dir, compile="off", chunk_size=16)
    model = engine.runner.model
    packed = [m for m in model.modules() if isinstance(m, dense.PackedLinear)]
    assert packed and not [m for m in model.modules() if type(m) is nn.Linear]
    # a weight only the linear used is gone (the packed copy replaces it); a tied LM head's stays
    tied = model.config.tie_word_embeddings
    assert (model.lm_head.weight is model.get_input_embeddings().weight) if tied else model.lm_head.weight is None
    assert all(m.weight is None for m in packed if m is not model.lm_head)
    prompts = _prompts(5, seed=11, lo=1, hi=70)
    assert _run(engine, prompts, 12) == [hf_greedy(llama_dir, p, 12, ignore_eos=True) for p in prompts]


def test_packed_linear_equals_linear_on_any_row_count():
    torch.manual_seed(0)
    linear = nn.Linear(48, 40, bias=True)
    packed = dense.PackedLinear(linear, keep_weight=False)
    for rows in (1, 3, 17):
        x = torch.randn(1, rows, 48)
        torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-5)


def test_rms_norms_are_fused_where_f_rms_norm_gives_their_output_bit_for_bit(llama_dir, family_dir):
    """Llama's norms become one `F.rms_norm` call each (the eager engine above runs them,
    token-exact); Gemma 2's `1 + weight` norms fail the load-time check and stay as they are."""
    engine = _engine(llama_dir, compile="off")
    model = engine.runner.model
    fused = [m for m in model.modules() if isinstance(m, dense.FusedRMSNorm)]
    assert len(fused) == 2 * model.config.num_hidden_layers + 1  # two per layer and the final one
    assert not [m for m in model.modules() if type(m).__name__.endswith("RMSNorm") and not isinstance(m, dense.FusedRMSNorm)]
    assert all(m.kernel is not None for m in fused)  # pdserve's CPU kernel where it builds: it matched
    x = torch.randn(1, 5, model.config.hidden_size) * 3
    norm = fused[0]
    expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight  # Llama's own formula
    assert torch.equal(norm(x), expected)
    gemma = _engine(family_dir("gemma2"), compile="off").runner.model
    assert not [m for m in gemma.modules() if isinstance(m, dense.FusedRMSNorm)]
    assert dense.fuse_rms_norms(gemma, torch.device("cpu")) == 0


@pytest.mark.parametrize("size", [576, 64, 1536, 4096, 100])
def test_rms_norm_kernel_is_f_rms_norm_bit_for_bit(size):
    """The CPU kernel sums the squares in the order torch's CPU sum does (eight-lane vectors, four
    accumulators cascaded every sixteen steps), so it gives `F.rms_norm`'s bits; 32 rows and more
    split over threads."""
    kernels, why = KERNELS, WHY  # None: no C compiler here (tests/kernel_util.py)
    if kernels is None:
        pytest.skip(f"no CPU kernels here: {why}")
    g = torch.Generator().manual_seed(size)
    weight = torch.randn(size, generator=g)
    for rows in (1, 7, 16, 40, 100):
        for scale in (1.0, 30.0, 1e-3):
            x = torch.randn(1, rows, size, generator=g) * scale
            assert torch.equal(kernels.rms_norm(x, weight, 1e-6), F.rms_norm(x, (size,), weight, 1e-6)), (rows, scale)
    strided = torch.randn(rows, size + 8, generator=g)[:, :size]  # rows apart by more than their length
    assert torch.equal(kernels.rms_norm(strided, weight, 1e-5), F.rms_norm(strided, (size,), weight, 1e-5))


@pytest.mark.parametrize("size", [576, 100])
def test_rms_norm_kernel_is_llamas_norm_bit_for_bit_in_bfloat16(size):
    """bfloat16 rows: widened, normalized in float32 (the float32 kernel's sum order), rounded, times
    the bfloat16 weight: transformers' LlamaRMSNorm in bfloat16, bit for bit."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    kernels, why = KERNELS, WHY  # None: no C compiler here (tests/kernel_util.py)
    if kernels is None:
        pytest.skip(f"no CPU kernels here: {why}")
    g = torch.Generator().manual_seed(size)
    norm = LlamaRMSNorm(size, eps=1e-5).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(size, generator=g) * 2)
    for rows in (1, 16, 40):  # 32 rows and more split over threads
        for scale in (1.0, 30.0, 1e-3):
            x = (torch.randn(1, rows, size, generator=g) * scale).bfloat16()
            with torch.no_grad():
                want = norm(x)
            assert torch.equal(kernels.rms_norm(x, norm.weight.detach(), 1e-5).view(torch.int16),
                               want.view(torch.int16)), (rows, scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("size", [576, 100])
def test_the_residual_add_and_norm_in_one_pass_are_the_two_ops_bit_for_bit(dtype, size):
    """`RmsNorm.add(x, y)`: torch's `x + y` (in bfloat16 the float32 sum rounded) and the norm kernel
    on it, both outputs bit for bit, rows strided or not, 32 rows and more split over threads."""
    kernels, why = KERNELS, WHY  # None: no C compiler here (tests/kernel_util.py)
    if kernels is None:
        pytest.skip(f"no CPU kernels here: {why}")
    g = torch.Generator().manual_seed(size)
    weight = (torch.randn(size, generator=g) * 2).to(dtype)
    for rows in (1, 16, 40):
        for scale in (1.0, 30.0, 1e-3):
            x = (torch.randn(1, rows, size, generator=g) * scale).to(dtype)
            y = (torch.randn(rows, size + 4, generator=g) * scale).to(dtype)[:, :size].unsqueeze(0)  # strided rows
            total, normed = kernels.rms_norm.add(x, y, weight, 1e-5)
            assert torch.equal(total.view(-1).view(torch.int8), (x + y).view(-1).view(torch.int8)), (rows, scale)
            want = kernels.rms_norm(x + y, weight, 1e-5)
            assert torch.equal(normed.view(-1).view(torch.int8), want.view(-1).view(torch.int8)), (rows, scale)


def test_a_norm_the_kernel_does_not_match_is_fused_on_f_rms_norm(llama_dir):
    model = _engine(llama_dir, compile="off", prepack_linears=False).runner.model  # norms left unfused
    assert not [m for m in model.modules() if isinstance(m, dense.FusedRMSNorm)]

    def off_by_a_bit(x, weight, eps):
        return F.rms_norm(x, (x.shape[-1],), weight, eps) * (1 + 2 ** -20)
    assert dense.fuse_rms_norms(model, torch.device("cpu"), kernel=off_by_a_bit) == 2 * model.config.num_hidden_layers + 1
    assert all(m.kernel is None for m in model.modules() if isinstance(m, dense.FusedRMSNorm))


def test_compiled_forward_is_token_exact_with_windows_soft_caps_and_scaling_and_never_recompiles(tmp_path):
    """The suite's one compile, on the family that asks most of the paged-attention op: Gemma 2
    (soft-capping, query_pre_attn_scalar, a windowed layer and a global one), 4-token blocks the
    7-token window does not divide and 5-token chunks that split a window. Compiled, it is as
    token-exact as eager while serving, and never recompiles. Two layers, not the family's four:
    inductor's cold compile (a fresh CI machine) took 41 s for two and 64 s for four here."""
    path = str(make_family_model(tmp_path / "gemma2", "gemma2", num_hidden_layers=2, layer_types=[SLIDING, FULL]))
    engine = _engine(path, compile="on", block_size=4, chunk_size=5, max_num_batched_tokens=64)
    forward = engine.runner.forward
    assert forward.compiled, forward.fallback_reason
    assert "compiled" in engine.runner.describe()
    # batches of 1..7 rows, fresh prompts, chunks with context, a single-token prompt and prompts
    # several windows long
    prompts = _prompts(5, seed=12, lo=1, hi=60) + [[42]] + _prompts(1, seed=13, lo=3 * WINDOW, hi=5 * WINDOW)
    assert _run(engine, prompts, 10) == [hf_greedy(path, p, 10, ignore_eos=True) for p in prompts]
    assert forward.recompilations == 0


def test_a_forward_that_does_not_compile_falls_back_to_eager_with_the_reason(llama_dir, caplog):
    engine = _engine(llama_dir, compile="off")
    runner = engine.runner
    forward = switchboard.Forward(runner.model, "on", runner.device)

    def broken(*args, **kwargs):
        raise RuntimeError("inductor cannot lower this op\nmore detail")

    forward._compiled = forward.decoder.forward = broken
    with caplog.at_level("WARNING", logger="engine.forward.switchboard"):
        forward.warm_up(runner.fresh_prompt_metadata)
    assert not forward.compiled and "forward" not in vars(forward.decoder)  # the eager decoder again
    assert forward.fallback_reason == "RuntimeError: inductor cannot lower this op"
    assert [r.getMessage() for r in caplog.records] == [
        "engine.compile: this model did not compile, serving it eagerly (RuntimeError: inductor cannot lower this op)"]


def test_compile_mode_is_checked():
    with pytest.raises(ValueError, match="compile"):
        EngineConfig(model_path="x", compile="sometimes")


def test_auto_dtype_is_bfloat16_only_where_the_device_computes_it():
    cpu = torch.device("cpu")
    expected = torch.bfloat16 if computes_bf16(cpu) else torch.float32
    assert resolve_dtype(EngineConfig(model_path="x"), cpu) == expected
    assert resolve_dtype(EngineConfig(model_path="x", dtype="bfloat16"), cpu) == torch.bfloat16
    flags = open("/proc/cpuinfo").read() if __import__("os").path.exists("/proc/cpuinfo") else ""
    if flags:
        native = " avx512_bf16" in flags or " amx_bf16" in flags
        assert computes_bf16(cpu) == native


def test_graph_buckets_cover_every_decode_batch_up_to_max_num_seqs():
    assert switchboard.graph_buckets(64) == (1, 2, 4, 8, 16, 32, 64)
    assert switchboard.graph_buckets(48) == (1, 2, 4, 8, 16, 32, 48)
    assert switchboard.graph_buckets(1) == (1,)
    buckets = switchboard.graph_buckets(48)
    assert [switchboard.bucket_for(n, buckets) for n in (1, 2, 3, 5, 16, 17, 33, 48, 49)] == [
        1, 2, 4, 8, 16, 32, 48, 48, None]


def test_pad_tokens_pads_ids_and_positions_with_zeros():
    ids, pos = torch.tensor([[5, 6, 7]]), torch.tensor([[9, 4, 2]])
    padded_ids, padded_pos = switchboard.pad_tokens(ids, pos, 5)
    assert padded_ids.tolist() == [[5, 6, 7, 0, 0]] and padded_pos.tolist() == [[9, 4, 2, 0, 0]]
    assert switchboard.pad_tokens(ids, pos, 3) == (ids, pos)


def test_decode_steps_padded_to_a_bucket_stay_token_exact(llama_dir):
    """What a CUDA-graph bucket does to a decode step (padding rows that write no KV and are never
    sampled), run on CPU without the graphs: tokens and block accounting unchanged."""
    engine = _engine(llama_dir, compile="off", chunk_size=16)
    forward = engine.runner.forward
    forward.buckets = (2, 4, 8)
    widths: list[tuple[int, int]] = []  # (rows run, slots written) of each padded step
    plain = forward._logits

    def spy(input_ids, positions, sample_rows, greedy=False):
        from engine.forward import attention

        widths.append((input_ids.shape[1], attention._current[-1].slot_blocks.shape[0]))
        return plain(input_ids, positions, sample_rows, greedy)

    forward._logits = spy
    prompts = _prompts(5, seed=13, lo=1, hi=40)
    assert _run(engine, prompts, 9) == [hf_greedy(llama_dir, p, 9, ignore_eos=True) for p in prompts]
    assert any(rows > real for rows, real in widths if rows in (4, 8))  # 3 or 5-7 rows were padded
