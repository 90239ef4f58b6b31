"""Whole decoder layers as one CPU kernel call (engine/forward/kernel_layer.py, engine/kernels/csrc/layer.c).

A layer gets the one-call forward only where all of it is the kernels' and the call gives its
module's output and pool bit for bit (a layer that differs stays a module, with a log line); a
step the call does not take runs the module; and engines with and without it give transformers'
greedy tokens, the call taking every step it can."""

from __future__ import annotations

import dataclasses
import logging
import random

import pytest
import torch

from engine.config import EngineConfig
from engine.forward import attention, kernel_decoder, kernel_layer
from engine.kernels import cpu_kernel
from engine.llm_engine import LLMEngine
from microbench.device_check import staggered_tokens
from tests.reference import hf_greedy
from tests.test_fused import _avx2_fma, _kernels


@pytest.fixture
def needs_layers():
    if not _avx2_fma():
        pytest.skip("no AVX2 + FMA: the SiLU kernel defers to torch, so no layer is all the kernels'")


class Counting:
    """Counts the layer kernel's runs of its layer: a call for the layer alone, or a decoder call
    (`pd_decoder_forward`), which runs every layer (`siblings`: every layer's counter)."""

    def __init__(self, kernel, siblings: list):
        self.kernel, self.calls, self.siblings = kernel, 0, siblings

    def __call__(self, *args):
        self.calls += 1
        return self.kernel(*args)

    def team_takes(self, *args):
        return self.kernel.team_takes(*args)

    def decoder(self, table, *args):
        assert len(table) == len(self.siblings)
        for counter in self.siblings:
            counter.calls += 1
        return self.kernel.decoder(table, *args)


def _engine(path: str, dtype: str = "float32", **overrides) -> LLMEngine:
    return LLMEngine(EngineConfig(model_path=path, dtype=dtype, num_blocks=256, chunk_size=16, **overrides))


@pytest.fixture(params=["float32", "bfloat16"])
def layer_dtype(request, needs_layers):
    """The dtypes whole layers run in: float32 on the float32 GEMM; bfloat16 where the bfloat16 GEMM
    runs (AMX tiles, AVX512-BF16's vdpbf16ps, or AVX2's FMAs)."""
    if request.param == "bfloat16" and _kernels().gemm_for(torch.bfloat16) is None:
        pytest.skip("no bfloat16 GEMM here (neither AMX, AVX512-BF16 nor AVX2): bfloat16 layers stay modules")
    return request.param


def test_engines_with_and_without_one_call_per_layer_give_transformers_greedy_tokens(llama_dir, layer_dtype,
                                                                                      monkeypatch):
    """float32: transformers' `generate`'s tokens. bfloat16: the module path's tokens, each step's
    logits bit for bit (the test below), whose few-row GEMM (AMX tiles) sums in another order than
    `generate`'s oneDNN, so a random tiny model's near-ties can part from `generate` in the last bit
    either way (test_cpu_kernel.py checks `generate`'s bfloat16 tokens on prompts that do not). A
    32-token step budget keeps every step within the AMX GEMM's 32 rows."""
    rng = random.Random(11)
    prompts = [[rng.randrange(10, 2000) for _ in range(rng.randint(1, 90))] for _ in range(6)]
    if layer_dtype == "float32":
        want = [hf_greedy(llama_dir, p, 10, ignore_eos=True) for p in prompts]
    else:
        want = staggered_tokens(_engine(llama_dir, layer_dtype, kernel_layers=False, max_num_batched_tokens=32),
                                prompts, 10)
    builds = []
    real_build = kernel_layer._build_step
    monkeypatch.setattr(kernel_layer, "_build_step", lambda *a: builds.append(1) or real_build(*a))
    for on in (True, False):
        engine = _engine(llama_dir, layer_dtype, kernel_layers=on, max_num_batched_tokens=32)
        builds.clear()
        layers = engine.runner.model.model.layers
        assert engine.runner.forward.kernel_layers == (len(layers) if on else 0)
        calls = []
        for layer in layers:
            assert isinstance(layer.forward, kernel_layer.KernelLayer) == on
            if on:
                layer.forward.kernel = Counting(layer.forward.kernel, calls)
                calls.append(layer.forward.kernel)
        assert ("decoder layers as one kernel call each" in engine.runner.describe()) == on
        assert staggered_tokens(engine, prompts, 10) == want, on
        assert engine.allocator.num_used == 0
        if on:  # every step (mixed decode rows, fresh prompts and chunks) went through the one call
            assert len({c.calls for c in calls}) == 1 and calls[0].calls >= 10 + len(prompts)
            assert len(builds) == calls[0].calls  # one step's arguments, built by its first layer, serve all


@pytest.mark.parametrize("family, swapped", [("mistral", True), ("qwen2", True), ("smollm3", True),
                                             ("qwen3", False), ("gemma2", False), ("granite", False)])
def test_only_layers_that_are_all_the_kernels_are_one_call(family_dir, family, swapped, layer_dtype):
    """Mistral's and Qwen2's windowed layers take the call with their window; SmolLM3's NoPE layers
    (attention left unfused) stay modules; Qwen3's q/k norms, Gemma's norms and Granite's
    multipliers keep every layer a module. The families' tokens are checked in test_families.py
    (float32); in bfloat16 here, the engine with the calls gives the module path's tokens (windows,
    Qwen2's q|k|v bias on the AMX GEMM), every step within the GEMM's 32 rows."""
    engine = _engine(family_dir(family), layer_dtype, max_num_batched_tokens=32)
    layers = engine.runner.model.model.layers
    one_call = [isinstance(layer.forward, kernel_layer.KernelLayer) for layer in layers]
    if family == "smollm3":
        assert one_call == [bool(rope) for rope in engine.runner.hf_config.no_rope_layers]
    else:
        assert one_call == [swapped] * len(layers)
    assert engine.runner.forward.kernel_layers == sum(one_call)
    if layer_dtype == "bfloat16" and any(one_call):
        rng = random.Random(3)
        prompts = [[rng.randrange(10, 500) for _ in range(rng.randint(1, 40))] for _ in range(3)]
        modules = _engine(family_dir(family), layer_dtype, max_num_batched_tokens=32, kernel_layers=False)
        assert staggered_tokens(engine, prompts, 8) == staggered_tokens(modules, prompts, 8)


def test_the_decoder_loop_calls_the_layers_where_every_layer_is_one_call(llama_dir, family_dir, monkeypatch,
                                                                          layer_dtype):
    """Where every layer is one call, the decoder's own loop runs as direct calls (`KernelDecoder`):
    the logits of each step equal the model's own forward's bit for bit; a step the layers would
    not take (a probe running) goes to the model's forward; a model with a layer left a module
    (SmolLM3's NoPE layers) keeps its forward."""
    engine = _engine(llama_dir, layer_dtype)
    forward = engine.runner.forward
    assert forward.kernel_decoder is not None and forward.kernel_decoder.table is not None  # one call for all
    assert "(the decoder's loop too)" in engine.runner.describe()
    compared = []
    real = type(forward)._logits

    def both(self, input_ids, positions, sample_rows, greedy=False):  # logits, greedy or not: compared here
        mine = real(self, input_ids, positions, sample_rows)  # the pool takes the same K/V twice
        decoders = self.kernel_decoder, self.lean_decoder
        self.kernel_decoder = self.lean_decoder = None
        try:
            theirs = real(self, input_ids, positions, sample_rows)
        finally:
            self.kernel_decoder, self.lean_decoder = decoders
        compared.append(torch.equal(mine, theirs))
        return mine

    monkeypatch.setattr(type(forward), "_logits", both)
    rng = random.Random(5)
    prompts = [[rng.randrange(10, 2000) for _ in range(rng.randint(1, 40))] for _ in range(3)]
    tokens = staggered_tokens(engine, prompts, 6)
    if layer_dtype == "float32":
        assert tokens == [hf_greedy(llama_dir, p, 6, ignore_eos=True) for p in prompts]
    assert compared and all(compared)
    smollm3 = _engine(family_dir("smollm3"), layer_dtype).runner.forward  # its rotary layers one call each
    assert smollm3.kernel_decoder is None and smollm3.lean_decoder is None  # the model's forward calls them
    decoder = forward.kernel_decoder
    meta = kernel_layer._probe_step(_kernels(), decoder.layers[0].shape, len(decoder.layers), [(8, 1)],
                                    torch.Generator().manual_seed(1))
    x, positions = torch.tensor([[17]]), torch.tensor([[8]])
    with torch.inference_mode(), attention.step_context(meta):
        one_call = decoder(x, positions)
        table, decoder.table = decoder.table, None  # the layers called one by one, the norm as a module
        try:
            assert torch.equal(decoder(x, positions), one_call)  # the pool takes the same K/V twice
        finally:
            decoder.table = table
        monkeypatch.setattr(kernel_layer.features, "active_probe", lambda: object())
        assert decoder(x, positions) is None


def test_rotary_tables_are_the_modules_outputs_for_any_positions(llama_dir, caplog):
    """The table's (cos, sin) for a step's positions equal the rotary module's bit for bit, for steps
    of any size and positions past the first table (it grows); a module whose output depends on the
    batch it is given (not elementwise in the position) gets no table; dynamic rotary keeps the module."""
    rotary = _engine(llama_dir).runner.model.model.rotary_emb
    table = kernel_decoder.RotaryTable(rotary)
    x = torch.randn(1, 1, 8)
    g = torch.Generator().manual_seed(2)
    for tokens in (1, 2, 5, 16, 64, 300):
        positions = torch.randint(0, 6000, (1, tokens), generator=g)
        got, want = table(x, positions), rotary(x, position_ids=positions)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), tokens
    assert table.usable and table.cos.shape[1] >= 6000
    far = torch.tensor([[5, kernel_decoder.RotaryTable.MAX_POSITIONS + 3]])  # past the table's cap: the module's
    assert torch.equal(table(x, far)[0], rotary(x, position_ids=far)[0])
    assert table.cos.shape[1] <= kernel_decoder.RotaryTable.MAX_POSITIONS

    class BatchDependent(torch.nn.Module):
        rope_type = "default"

        def forward(self, x, position_ids):
            cos, sin = rotary(x, position_ids=position_ids)
            return cos + position_ids.shape[1], sin

    odd = kernel_decoder.RotaryTable(BatchDependent())
    positions = torch.tensor([[3, 4, 5]])
    with caplog.at_level(logging.INFO, logger="engine.forward.kernel_decoder"):
        got = odd(x, positions)
    assert not odd.usable and torch.equal(got[0], rotary(x, position_ids=positions)[0] + 3)
    assert "rotary tables computed each step" in caplog.text
    dynamic = BatchDependent()
    dynamic.rope_type = "dynamic"
    assert not kernel_decoder.RotaryTable(dynamic).usable


def _fused_engine(path: str) -> LLMEngine:
    return _engine(path, kernel_layers=False)  # fused modules, no one-call forward yet


def test_a_layer_whose_one_call_differs_stays_a_module(llama_dir, monkeypatch, caplog, needs_layers):
    engine = _fused_engine(llama_dir)
    model = engine.runner.model
    real = kernel_layer.layer_args

    def off_by_eps(layer):  # layer 1's arguments name a different epsilon than its norm's
        args, shape, max_rows = real(layer)
        if layer.self_attn.layer_idx == 1:
            args.eps1 *= 2
        return args, shape, max_rows

    monkeypatch.setattr(kernel_layer, "layer_args", off_by_eps)
    with caplog.at_level(logging.INFO, logger="engine.forward.kernel_layer"):
        assert kernel_layer.swap_layers(model, _kernels()) == len(model.model.layers) - 1
    assert not isinstance(model.model.layers[1].forward, kernel_layer.KernelLayer)
    assert isinstance(model.model.layers[0].forward, kernel_layer.KernelLayer)
    assert "decoder layer 1 stays a module: one call does not give its outputs bit for bit" in caplog.text


def test_a_layer_whose_check_cannot_run_stays_a_module(llama_dir, monkeypatch, caplog, needs_layers):
    model = _fused_engine(llama_dir).runner.model

    def failing(layer, candidate, kernels):
        raise RuntimeError("no scratch pool today")

    monkeypatch.setattr(kernel_layer, "_same_as_module", failing)
    with caplog.at_level(logging.INFO, logger="engine.forward.kernel_layer"):
        assert kernel_layer.swap_layers(model, _kernels()) == 0
    assert not any(isinstance(layer.forward, kernel_layer.KernelLayer) for layer in model.model.layers)
    assert "decoder layer 0 stays a module: its check failed (RuntimeError: no scratch pool today)" in caplog.text


def _run(module, meta: attention.StepMetadata, x, position_embeddings):
    run = dataclasses.replace(meta, kv=meta.kv.clone(), kernel_step=None)
    with attention.step_context(run):
        out = module(x, attention_mask=None, position_embeddings=position_embeddings)
    return out, run


def test_a_step_with_more_rows_than_the_gemm_takes_runs_the_module(llama_dir, needs_layers):
    """Where oneDNN takes products past the GEMM's cut (`SMALL_ROWS`, hosts with AVX-512), a step
    of more rows runs the layer's modules: same output, same pool, no one-call step built."""
    engine = _fused_engine(llama_dir)
    layer = engine.runner.model.model.layers[0]
    found = kernel_layer.layer_args(layer)
    assert found is not None
    kernels = _kernels()
    candidate = kernel_layer.KernelLayer(layer, *found[:2], kernels.layer, max_rows=4)
    shape = candidate.shape
    g = torch.Generator().manual_seed(3)
    tokens_of = kernel_layer.PROBE_STEPS[1]
    tokens = sum(q for _, q in tokens_of)
    meta = kernel_layer._probe_step(kernels, shape, 1, tokens_of, g)
    x = torch.randn(1, tokens, shape.hidden, generator=g)
    angles = torch.rand(1, tokens, shape.dim, generator=g)
    position_embeddings = (angles.cos(), angles.sin())
    assert candidate._step(x, position_embeddings) is None  # outside a step, too
    want, want_run = _run(layer, meta, x, position_embeddings)
    got, got_run = _run(candidate, meta, x, position_embeddings)
    assert got_run.kernel_step is None
    assert torch.equal(got, want) and torch.equal(got_run.kv, want_run.kv)


@pytest.mark.parametrize("code, error", [(-2, "could not allocate its buffers for 3 tokens"),
                                         (-3, r"pd_(layer|decoder)_forward failed \(-3\)")])
def test_a_failing_layer_call_raises_what_failed(code, error):
    failing = cpu_kernel.LayerKernel.__new__(cpu_kernel.LayerKernel)
    failing._fn = failing._decoder = lambda *args: code
    x = torch.zeros(3, 8)
    with pytest.raises(MemoryError if code == -2 else RuntimeError, match=error):
        failing(kernel_layer.LayerArgs(), kernel_layer.StepArgs(), x, x)
    with pytest.raises(MemoryError if code == -2 else RuntimeError, match=error):
        failing.decoder((kernel_layer.LayerArgs * 2)(), kernel_layer.StepArgs(), x, (x, x), x[0], 1e-6, x)


SHORT, LONG = [(8, 1), (30, 1), (0, 70), (40, 50)], [(8, 1), (0, 1100)]


@pytest.mark.parametrize("threads, tokens_of", [(2, SHORT), (3, SHORT), (2, LONG)], ids=["2-short", "3-short", "2-long"])
def test_a_step_on_one_region_split_by_rows_gives_the_kernel_by_kernel_bits(llama_dir, layer_dtype, threads,
                                                                            tokens_of, monkeypatch):
    """`pd_use_team` (layer_team.c): a step of decode rows, a fresh prompt and a chunk after cached
    context, run as one OpenMP region split by rows and attention pieces, gives the per-kernel
    loop's hidden states and pool bit for bit, on two and three threads; past the float32 GEMM's
    cut (64 rows on AVX-512 hosts) too, and over a 1,100-token prompt (on AMX tiles of 256 rows, the
    most a tile takes). Both with each item waiting for the whole previous phase and with items
    starting once what they read is done (`pd_team_overlap`, the default), and that again with the
    second thread slow on every item it holds (`pd_team_lag`), so the first runs ahead into the
    next phases as far as its waits let it: a wait too short reads K/V or attention outputs not yet
    written, or overwrites q|k|v still to be read."""
    decoder = _engine(llama_dir, layer_dtype).runner.forward.kernel_decoder
    assert decoder is not None and decoder.table is not None
    kernels = _kernels()
    tokens = sum(q for _, q in tokens_of)
    meta = kernel_layer._probe_step(kernels, decoder.layers[0].shape, len(decoder.layers), tokens_of,
                                    torch.Generator().manual_seed(2))
    ids = torch.randint(10, 2000, (1, tokens), generator=torch.Generator().manual_seed(3))
    positions = torch.tensor([[p + i for p, q in tokens_of for i in range(q)]])
    max_rows = [layer.max_rows for layer in decoder.layers]

    def region(rows: int) -> int:  # 0: per kernel (the GEMM on all the step's rows at once); else one region
        for layer, most in zip(decoder.layers, max_rows, strict=True):
            monkeypatch.setattr(layer, "max_rows", most if rows else None)
        return kernels.layer.use_team(int(rows))

    overlap = kernels.layer.team_overlap(True)
    try:
        for on, lag_us in ((False, 0), (True, 0), (True, 3000)):
            kernels.layer.team_overlap(on)
            kernels.layer.team_lag(lag_us)
            _same_bits_both_ways(decoder, meta, ids, positions, threads, region, kernels.layer.team_steps)
    finally:
        kernels.layer.team_overlap(overlap)
        kernels.layer.team_lag(0)


def _same_bits_both_ways(decoder, meta, ids, positions, threads: int, use, steps) -> None:
    """One step of `decoder` on `threads` threads with `use(False)`, then `use(True)` (each returns the
    setting before), on copies of `meta`'s pool: the same hidden states and pool bit for bit, and
    `steps()` counted the one step the switched-on path ran."""
    before, was = torch.get_num_threads(), use(False)
    results = []
    try:
        torch.set_num_threads(threads)
        for on in (False, True):
            use(on)
            run = dataclasses.replace(meta, kv=meta.kv.clone())
            count = steps()
            with torch.inference_mode(), attention.step_context(run):
                results.append((decoder(ids, positions).clone(), run.kv))
            assert steps() == count + on  # the path asked for ran
    finally:
        torch.set_num_threads(before)
        use(was)
    (want, want_kv), (got, got_kv) = results
    assert torch.equal(got, want) and torch.equal(got_kv, want_kv)
    assert not torch.equal(got_kv, meta.kv)  # the step wrote its K/V


@pytest.mark.parametrize("threads, rows", [(2, 16), (2, 5), (3, 1)])
def test_a_decode_step_on_one_region_split_by_columns_gives_the_kernel_by_kernel_bits(llama_dir, needs_layers,
                                                                                     threads, rows):
    """`pd_use_cols` (layer_cols.c): a bfloat16 step of decode rows on AMX tiles, run as one OpenMP
    region whose GEMMs are split by columns, gives the per-kernel loop's hidden states and pool bit
    for bit, on two and three threads (more threads than rows too)."""
    kernels = _kernels()
    if kernels.gemm_for(torch.bfloat16) is None or not kernels.use_amx(True):
        pytest.skip("no AMX tiles here: the path runs only on them")
    decoder = _engine(llama_dir, "bfloat16").runner.forward.kernel_decoder
    assert decoder is not None and decoder.table is not None
    tokens_of = [(random.Random(i).randint(0, 60), 1) for i in range(rows)]
    meta = kernel_layer._probe_step(kernels, decoder.layers[0].shape, len(decoder.layers), tokens_of,
                                    torch.Generator().manual_seed(rows))
    ids = torch.randint(10, 2000, (1, rows), generator=torch.Generator().manual_seed(3))
    positions = torch.tensor([[p for p, _ in tokens_of]])
    _same_bits_both_ways(decoder, meta, ids, positions, threads, kernels.layer.use_cols, kernels.layer.cols_steps)
