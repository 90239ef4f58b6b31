"""Fused layers (engine/forward/fused.py): one q|k|v linear with rotary in place, one gate|up linear.

The rotary kernel is transformers' rotary bit for bit; a module is swapped only where its fused
form gives its outputs bit for bit (a module that differs stays, with a log line naming it); and
engines with and without fused layers give transformers' greedy tokens."""

from __future__ import annotations

import logging
import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModelForCausalLM
from transformers.models.llama.modeling_llama import LlamaMLP, apply_rotary_pos_emb

from engine.config import EngineConfig
from engine.forward import attention, dense, fused
from engine.kernels import cpu_kernel
from engine.llm_engine import LLMEngine
from microbench.device_check import staggered_tokens
from tests.kernel_util import KERNELS, WHY
from tests.reference import hf_greedy

CPU = torch.device("cpu")


def _bf16_packed() -> bool:
    """A bfloat16 engine's linears are packed here (`dense.packable` with the engine's bfloat16 GEMM)."""
    return dense.packable(torch.bfloat16, KERNELS.gemm_for(torch.bfloat16) if KERNELS is not None else None)


def _kernels() -> cpu_kernel.Kernels:
    if KERNELS is None:  # no C compiler here (a failed build fails tests/kernel_util.py's import)
        pytest.skip(f"no CPU kernels here: {WHY}")
    return KERNELS


@pytest.mark.parametrize("tokens", [1, 5, 64, 130])  # 64 and up: OpenMP threads share the rows
def test_rope_kernel_is_transformers_rotary_bit_for_bit(tokens):
    rope = _kernels().rope
    g = torch.Generator().manual_seed(tokens)
    heads, kv_heads, dim = 6, 2, 32
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim + 8, generator=g) * 3  # rows padded: a strided view
    x = qkv[:, : (heads + 2 * kv_heads) * dim]
    angles = torch.rand(tokens, dim // 2, generator=g) * 500
    angles = torch.cat((angles, angles), dim=-1)
    cos, sin = angles.cos(), angles.sin()
    q = x[:, : heads * dim].reshape(1, tokens, heads, dim).transpose(1, 2).clone()
    k = x[:, heads * dim: (heads + kv_heads) * dim].reshape(1, tokens, kv_heads, dim).transpose(1, 2).clone()
    v, tail = x[:, (heads + kv_heads) * dim:].clone(), qkv[:, x.shape[1]:].clone()
    want_q, want_k = apply_rotary_pos_emb(q, k, cos[None], sin[None])
    rope(x, heads + kv_heads, dim, cos, sin)
    assert torch.equal(x[:, : heads * dim].reshape(1, tokens, heads, dim).transpose(1, 2), want_q)
    assert torch.equal(x[:, heads * dim: (heads + kv_heads) * dim].reshape(1, tokens, kv_heads, dim).transpose(1, 2),
                       want_k)
    assert torch.equal(x[:, (heads + kv_heads) * dim:], v) and torch.equal(qkv[:, x.shape[1]:], tail)  # untouched


@pytest.mark.parametrize("tokens", [1, 7, 130])
def test_rope_kernel_is_transformers_rotary_bit_for_bit_in_bfloat16(tokens):
    """bfloat16 q|k|v and angles: each product and the sum rounded to bfloat16 as torch's ops round them."""
    rope = _kernels().rope
    g = torch.Generator().manual_seed(tokens)
    heads, kv_heads, dim = 9, 3, 64
    x = (torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g) * 3).bfloat16()
    angles = torch.rand(tokens, dim // 2, generator=g) * 500
    angles = torch.cat((angles, angles), dim=-1)
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    q = x[:, : heads * dim].reshape(1, tokens, heads, dim).transpose(1, 2).clone()
    k = x[:, heads * dim: (heads + kv_heads) * dim].reshape(1, tokens, kv_heads, dim).transpose(1, 2).clone()
    v = x[:, (heads + kv_heads) * dim:].clone()
    want_q, want_k = apply_rotary_pos_emb(q, k, cos[None], sin[None])
    rope(x, heads + kv_heads, dim, cos, sin)
    got_q = x[:, : heads * dim].reshape(1, tokens, heads, dim).transpose(1, 2)
    got_k = x[:, heads * dim: (heads + kv_heads) * dim].reshape(1, tokens, kv_heads, dim).transpose(1, 2)
    assert torch.equal(got_q.view(torch.int16), want_q.view(torch.int16))  # bits: -0.0 and NaN count too
    assert torch.equal(got_k.view(torch.int16), want_k.view(torch.int16))
    assert torch.equal(x[:, (heads + kv_heads) * dim:], v)


def test_bfloat16_engine_fuses_with_the_rotary_and_norm_kernels_and_packed_linears(llama_dir):
    """Where the CPU computes bfloat16 natively, a bfloat16 engine's linears are packed for the
    bfloat16 GEMM where it runs (on AMX tiles up to 32 rows, with oneDNN's prepacked copy for more;
    by vdpbf16ps or AVX2's FMAs every product, with no oneDNN copy), else prepacked for oneDNN alone; its attention
    and MLPs fused, rotary, norms and the activation by the kernels, each checked bit for bit at
    load; elsewhere torch's linears stay."""
    kernels = _kernels()
    engine = LLMEngine(EngineConfig(model_path=llama_dir, dtype="bfloat16", num_blocks=64))
    model = engine.runner.model
    gemm = kernels.gemm_for(torch.bfloat16)  # the bfloat16 GEMM where it runs (AMX, vdpbf16ps, AVX2), else None
    if not _bf16_packed():
        assert not [m for m in model.modules() if isinstance(m, dense.PackedLinear)]
        return
    linears = [m for m in model.modules() if isinstance(m, dense.PackedLinear)]
    cut = {"AMX": 32, "AVX512-BF16": None, "AVX2": None}[gemm.path] if gemm else 0
    assert linears and all(m.gemm is gemm and m.small_rows == cut for m in linears)
    assert all((m.packed is None) == (cut is None) and (m.panels is None) == (gemm is None) for m in linears)
    assert not [m for m in model.modules() if type(m) is nn.Linear]
    layers = engine.runner.hf_config.num_hidden_layers
    assert engine.runner.forward.fused_layers == (layers, layers)
    assert all(layer.self_attn.rope is kernels.rope for layer in model.model.layers)
    norms = [m for m in model.modules() if isinstance(m, dense.FusedRMSNorm)]
    assert len(norms) == 2 * layers + 1 and all(n.kernel is kernels.rms_norm for n in norms)
    assert all(layer.mlp.silu_mul is kernels.silu_mul for layer in model.model.layers)
    assert engine.runner.small_gemm is gemm
    assert engine.runner.forward.lean_decoder is not None
    if gemm is None:  # no GEMM for whole layers: the decoder's loop as direct calls serves every step
        assert engine.runner.forward.kernel_layers == 0
        assert engine.runner.describe().endswith("the decoder's loop as direct calls")
        return
    # decode steps as one kernel call per layer (the loop too); on AMX larger ones the loop as direct
    # calls, by vdpbf16ps every step
    assert engine.runner.forward.kernel_layers == layers and engine.runner.forward.kernel_decoder is not None
    past = "; past 32 rows the decoder's loop as direct calls" if cut else ""
    assert f"{layers} decoder layers as one kernel call each (the decoder's loop too){past}" in engine.runner.describe()
    assert gemm.reach in engine.runner.describe()


def test_the_decoders_loop_as_direct_calls_gives_the_model_forwards_tokens_and_logits(llama_dir):
    """engine/forward/lean_decoder.py runs the same modules on the same inputs as the model's forward: greedy
    tokens of staggered prompts and the logits of each step equal, bit for bit, in bfloat16 (where
    a different rounding anywhere shows) and in float32 without the layer kernel."""
    for dtype, extra in (("bfloat16", {}), ("float32", {"kernel_layers": False})):
        runs = []
        for lean in (True, False):
            engine = LLMEngine(EngineConfig(model_path=llama_dir, dtype=dtype, num_blocks=256, chunk_size=16, **extra))
            assert (engine.runner.forward.lean_decoder is not None) == (dtype == "float32" or _bf16_packed())
            if not lean:
                engine.runner.forward.lean_decoder = None
            logits = []
            forward = engine.runner.forward._logits
            engine.runner.forward._logits = lambda *a, _f=forward, _l=logits: _l.append(_f(*a)) or _l[-1]
            rng = random.Random(11)
            prompts = [[rng.randrange(10, 2000) for _ in range(rng.randint(1, 40))] for _ in range(5)]
            runs.append((staggered_tokens(engine, prompts, 12), logits))
            assert engine.allocator.num_used == 0
        (tokens, logits), (want_tokens, want_logits) = runs
        assert tokens == want_tokens and len(logits) == len(want_logits)
        assert all(torch.equal(a, b) for a, b in zip(logits, want_logits, strict=True)), dtype


@pytest.mark.parametrize("width", [1536, 64, 4096])
def test_silu_mul_kernel_is_torch_silu_times_up_bit_for_bit(width):
    silu_mul = _kernels().silu_mul
    g = torch.Generator().manual_seed(width)
    for rows in (1, 7, 64, 300):  # 300 x 4096 and up: threads share the rows
        for scale in (1.0, 12.0, 200.0, 1e-3):  # 200: e^-x overflows and underflows
            h = torch.randn(1, rows, 2 * width, generator=g) * scale
            gate, up = h.split(width, dim=-1)
            try:
                got = silu_mul(h)
            except cpu_kernel.KernelUnavailable:
                pytest.skip("this host has no AVX2 + FMA: the kernel defers to torch")
            assert torch.equal(got, F.silu(gate) * up), (rows, scale)
            hb = h.bfloat16()
            gate, up = hb.split(width, dim=-1)
            assert torch.equal(silu_mul(hb).view(torch.int16), (F.silu(gate) * up).view(torch.int16)), (rows, scale)


def test_silu_mul_kernel_refuses_a_width_torch_finishes_in_scalars():
    with pytest.raises(cpu_kernel.KernelUnavailable, match="width 12"):
        _kernels().silu_mul(torch.randn(3, 24))


def _avx2_fma() -> bool:
    try:
        _kernels().silu_mul(torch.zeros(1, 16))
        return True
    except cpu_kernel.KernelUnavailable:
        return False


class DoubledMLP(LlamaMLP):
    """Llama's MLP with one change its fused form would not make."""

    def forward(self, x):
        return 2 * super().forward(x)


class BrokenMLP(LlamaMLP):
    """One whose forward fails: the check cannot call it."""

    def forward(self, x):
        raise RuntimeError("not today")


def _loaded(path: str):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="pdserve_paged").eval()


def test_fuse_layers_swaps_modules_that_match_bit_for_bit_and_names_the_rest(family_dir, caplog):
    attention.register()
    model = _loaded(family_dir("llama"))
    layers = model.model.layers
    assert len(layers) >= 3
    odd = DoubledMLP(model.config)
    odd.load_state_dict(layers[1].mlp.state_dict())
    layers[1].mlp = odd
    broken = BrokenMLP(model.config)
    broken.load_state_dict(layers[0].mlp.state_dict())
    layers[0].mlp = broken
    kernels = _kernels()

    def refusing(h):  # a kernel that cannot give torch's bits here: the MLPs run torch's ops instead
        raise cpu_kernel.KernelUnavailable("not here")
    with caplog.at_level(logging.INFO, logger="engine.forward.fused"):
        attn, mlps = fused.fuse_layers(model, CPU, gemm=kernels.gemm, rope=kernels.rope, silu_mul=refusing)
    assert (attn, mlps) == (len(layers), len(layers) - 2)
    assert all(isinstance(layer.self_attn, fused.FusedAttention) for layer in layers)
    assert isinstance(layers[1].mlp, DoubledMLP) and isinstance(layers[0].mlp, BrokenMLP)
    assert all(isinstance(layer.mlp, fused.FusedMLP) and layer.mlp.silu_mul is None for layer in layers[2:])
    assert "LlamaDecoderLayer.mlp (DoubledMLP) stays unfused: its fused form does not give" in caplog.text
    assert "LlamaDecoderLayer.mlp (BrokenMLP) stays unfused: the check could not call it (RuntimeError: not today)" \
        in caplog.text
    # every linear of the modules it looked at is packed, the unfused one's too
    assert isinstance(layers[1].mlp.gate_proj, dense.PackedLinear)
    assert layers[0].self_attn.qkv_proj.out_features == sum(
        n * model.config.head_dim for n in (model.config.num_attention_heads, 2 * model.config.num_key_value_heads))


def test_a_layer_without_rotary_stays_unfused(family_dir):
    """SmolLM3 leaves rotary out of every fourth layer (NoPE): that layer's fused form would rotate,
    so the check keeps its module as it is."""
    engine = LLMEngine(EngineConfig(model_path=family_dir("smollm3"), dtype="float32", num_blocks=64))
    layers = engine.runner.model.model.layers
    kept = [i for i, layer in enumerate(layers) if not isinstance(layer.self_attn, fused.FusedAttention)]
    assert kept == [i for i, rope in enumerate(engine.runner.hf_config.no_rope_layers) if not rope]
    assert engine.runner.forward.fused_layers == (len(layers) - len(kept), len(layers))


def test_fused_and_unfused_engines_give_transformers_greedy_tokens(llama_dir):
    rng = random.Random(5)
    prompts = [[rng.randrange(10, 2000) for _ in range(rng.randint(1, 90))] for _ in range(6)]
    want = [hf_greedy(llama_dir, p, 10, ignore_eos=True) for p in prompts]
    for fuse, kernels in ((True, "auto"), (True, "off"), (False, "auto")):  # kernels off: torch's rotary
        engine = LLMEngine(EngineConfig(model_path=llama_dir, dtype="float32", num_blocks=256, chunk_size=16,
                                        fuse_layers=fuse, cpu_kernels=kernels))
        assert engine.runner.forward.fused_layers == ((2, 2) if fuse else (0, 0))
        layer = engine.runner.model.model.layers[0]
        assert (fuse and layer.self_attn.rope is not None) == (fuse and kernels == "auto")
        assert (fuse and layer.mlp.silu_mul is not None) == (fuse and kernels == "auto" and _avx2_fma())
        norms = [m for m in engine.runner.model.modules() if isinstance(m, dense.FusedRMSNorm)]
        assert norms and all((m.kernel is not None) == (fuse and kernels == "auto") for m in norms)
        assert staggered_tokens(engine, prompts, 10) == want, (fuse, kernels)
        assert engine.allocator.num_used == 0


def test_nothing_is_fused_where_linears_are_not_packed(llama_dir):
    engine = LLMEngine(EngineConfig(model_path=llama_dir, dtype="float32", num_blocks=64, prepack_linears=False))
    assert engine.runner.forward.fused_layers == (0, 0)
    assert not [m for m in engine.runner.model.modules() if isinstance(m, fused.FusedAttention | fused.FusedMLP)]
    assert [m for m in engine.runner.model.modules() if type(m) is nn.Linear]
