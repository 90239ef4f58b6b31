"""The greedy LM head (engine/forward/greedy_head.py): an all-greedy step's tokens from a half-float copy of
the head's panels, bit for bit the argmax of the full float32 product, on exact ties, near ties, tiny
(subnormal) weights and a bias; the full product where a value is not finite; in the engine,
token-exact against transformers' `generate`, and only on steps whose every row is greedy."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.config import EngineConfig
from engine.forward import dense
from engine.forward.greedy_head import Bf16GreedyHead, GreedyHead
from engine.llm_engine import LLMEngine
from protocol.sampling import SamplingParams
from tests.kernel_util import KERNELS, WHY
from tests.reference import hf_greedy

pytestmark = pytest.mark.skipif(KERNELS is None, reason=f"no CPU kernels here: {WHY}")


def _head(n: int, k: int, bias: bool, scale: float = 0.05, seed: int = 0) -> dense.PackedLinear:
    torch.manual_seed(seed)
    linear = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(n, k) * scale)
        linear.weight[300] = linear.weight[7]  # an exact tie: the first index wins
        linear.weight[11] = linear.weight[10] * (1 + 2**-20)  # a near tie, far inside the half-float window
        if bias:
            linear.bias[300] = linear.bias[7]
    return dense.PackedLinear(linear, keep_weight=False, gemm=KERNELS.gemm, small_rows=None)


def _full_argmax(head: dense.PackedLinear, x: torch.Tensor) -> torch.Tensor:
    return KERNELS.argmax(head(x))


@pytest.fixture(params=["vectors", "tiles"])
def tiles(request):
    """The first pass: on vectors from the half-float copy, or on AMX tiles from a bfloat16 copy."""
    if request.param == "vectors":
        return None
    if not KERNELS.amx_gemm.ready():
        pytest.skip("no AMX tiles here")
    return KERNELS.amx_gemm


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 5, 16, 23])
def test_the_greedy_head_gives_the_full_products_argmax_bit_for_bit(bias, rows, tiles):
    """Random rows, and rows pointing at the tied and near-tied columns (where the half-float
    estimates cannot tell them apart and the float32 rerun must), against argmax over the full
    float32 product by the same GEMM. Few panels are reread: the window is narrow."""
    n, k = 1003, 72  # a part panel at the end
    head = _head(n, k, bias)
    x = torch.randn(rows, k) * 4
    w = head.panels.view(-1, k, 16)  # [panel, k, column]
    column = lambda j: w[j // 16, :, j % 16]  # noqa: E731
    if rows >= 5:
        x[1], x[2], x[3] = column(7) * 200, column(10) * 200, -column(11) * 200
    greedy = GreedyHead(head, tiles)
    tokens = greedy(x)
    assert tokens is not None and torch.equal(tokens, _full_argmax(head, x))
    if rows >= 5:
        assert tokens[1] == 7  # not 300: the first of equal logits
    assert greedy.rows == rows and greedy.full == 0
    assert greedy.reread < rows * 8, "the window should leave a handful of panels per row, not all 63"


def test_the_window_holds_for_tiny_weights_and_a_long_row(tiles):
    """Weights below half float's normal range (rounded with an absolute, not a relative, error) and
    a 2048-long row (the float32 sums' own rounding grows with K): still the full argmax, every row."""
    for scale, k in ((3e-6, 64), (0.02, 2048)):
        head = _head(700, k, bias=False, scale=scale, seed=3)
        x = torch.randn(40, k) * 30
        greedy = GreedyHead(head, tiles)
        assert torch.equal(greedy(x), _full_argmax(head, x)), (scale, k)


def test_a_value_that_is_not_finite_takes_the_full_product_and_a_weight_beyond_half_float_gets_no_head(tiles):
    """On the tiles, a row of values under 2^-60 (where what the tiles flush to zero could matter)
    takes the full product too."""
    head = _head(400, 32, bias=False)
    greedy = GreedyHead(head, tiles)
    for bad in (float("nan"), float("inf")):
        x = torch.randn(3, 32)
        x[1, 4] = bad
        assert greedy(x) is None
    assert greedy.full == 2 and greedy.calls == 2
    tiny = torch.randn(3, 32)
    tiny[2] *= 2.0**-70
    if tiles is not None:
        assert greedy(tiny) is None and greedy.full == 3
    else:
        assert torch.equal(greedy(tiny), _full_argmax(head, tiny))
    assert GreedyHead.fits(head) is None
    with torch.no_grad():
        head.panels[5] = 7e4
    assert GreedyHead.fits(head) == "a weight of the LM head is beyond half float's range"


def _engine(path: str, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model_path=path, num_blocks=256, dtype="float32", **kw))


def _run(engine: LLMEngine, prompts: list[list[int]], sampling: list[SamplingParams]) -> list[list[int]]:
    for i, (prompt, params) in enumerate(zip(prompts, sampling, strict=True)):
        engine.add_request(f"r{i}", prompt_token_ids=prompt, sampling=params)
    out: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.token_ids)
    assert engine.allocator.num_used == 0
    return [out[f"r{i}"] for i in range(len(prompts))]


def test_greedy_steps_take_the_half_float_head_and_give_generates_tokens(llama_dir):
    engine = _engine(llama_dir)
    head = engine.runner.forward.greedy_head
    assert head is not None and head.what in engine.runner.describe()
    prompts = [[11, 12, 13], list(range(40, 75)), [5] * 9]
    greedy = SamplingParams(max_tokens=12, ignore_eos=True)
    assert _run(engine, prompts, [greedy] * 3) == [hf_greedy(llama_dir, p, 12, ignore_eos=True) for p in prompts]
    assert head.rows >= 3 * 12 and head.full == 0


def test_a_step_with_a_sampled_row_computes_the_logits_and_samples_as_without_the_greedy_head(llama_dir):
    """One sampled request among greedy ones: its steps take the full head (the greedy head is not
    called), and every request gets the tokens an engine without the greedy head gives."""
    prompts = [[11, 12, 13], list(range(40, 60))]
    sampling = [SamplingParams(max_tokens=10, ignore_eos=True),
                SamplingParams(max_tokens=6, temperature=0.9, seed=4, ignore_eos=True)]
    engine = _engine(llama_dir)
    head = engine.runner.forward.greedy_head
    got = _run(engine, prompts, sampling)
    off = _engine(llama_dir, greedy_head=False)
    assert off.runner.forward.greedy_head is None and off.runner.forward.greedy_reason == "engine.greedy_head: off"
    assert got == _run(off, prompts, sampling)
    assert head.rows == 10 - 6  # the greedy request's steps after the sampled one finished


@pytest.fixture(params=["AMX", "AVX512-BF16"])
def bf16_gemm(request):
    """The bfloat16 GEMM on one path: AMX tiles, or vdpbf16ps with the engine's AMX use off."""
    KERNELS.use_amx(request.param == "AMX")
    try:
        gemm = KERNELS.gemm_for(torch.bfloat16)
        if gemm is None or gemm.path != request.param:
            pytest.skip(f"no {request.param} bfloat16 GEMM here (CPU or OS)")
        yield gemm
    finally:
        KERNELS.use_amx(True)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 16, 23, 40])
@pytest.mark.parametrize("threads", [1, 2])
def test_the_bfloat16_greedy_head_gives_the_bfloat16_gemms_argmax_bit_for_bit(bf16_gemm, bias, rows, threads):
    """`pd_bf16_greedy` against the argmax kernel over the same GEMM's bfloat16 logits: random rows,
    rows whose logits tie exactly (equal columns, and many columns equal once rounded to bfloat16,
    where the first must win), a part panel at the end, every block shape of rows (vdpbf16ps's; on AMX
    four panels for up to 16 rows, pairs through blocks of 32 past) and both thread counts."""
    gemm = bf16_gemm
    n, k = 1003, 72
    torch.manual_seed(rows)
    linear = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(n, k) * 0.05)
        linear.weight[300] = linear.weight[7]  # an exact tie: the first index wins
        linear.weight[990] = linear.weight[5]  # across threads' shares and the part panel
        if bias:  # the tied columns' biases tied too, so the first of each pair is the row's argmax
            linear.bias[300], linear.bias[990] = linear.bias[7], linear.bias[5]
    head = dense.PackedLinear(linear.bfloat16(), keep_weight=False, gemm=gemm, small_rows=None)
    x = torch.randn(rows, k).bfloat16() * 4
    w = linear.weight
    if rows >= 3:
        x[0], x[1] = w[7] * 300, w[5] * 300
        x[2] = 0  # every logit the bias (or 0): ties everywhere, the first column wins
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        fused = Bf16GreedyHead(head)
        tokens = fused(x)
        want = KERNELS.argmax(head(x))
    finally:
        torch.set_num_threads(before)
    assert tokens is not None and torch.equal(tokens, want)
    if rows >= 3:
        assert tokens[0] == 7 and tokens[1] == 5
    assert Bf16GreedyHead.fits(head) is None and fused.full == 0


def test_a_nan_takes_the_bfloat16_logits_and_a_float32_head_gets_no_fused_one(bf16_gemm):
    head = dense.PackedLinear(nn.Linear(32, 400).bfloat16(), keep_weight=False, gemm=bf16_gemm, small_rows=None)
    fused = Bf16GreedyHead(head)
    x = torch.randn(3, 32).bfloat16()
    x[1, 4] = float("nan")
    assert fused(x) is None and fused.full == 1 and fused.calls == 1
    assert Bf16GreedyHead.fits(_head(400, 32, bias=False)) == "the LM head is not on the CPU GEMM's bfloat16 panels"


def test_past_the_gemms_cut_the_fused_head_leaves_the_logits_to_onednn(bf16_gemm):
    """Where the unfused head hands more rows than the GEMM's cut to oneDNN (AMX: past 32), the fused
    head takes only steps within it, so a step's tokens are the unfused head's on either side."""
    linear = nn.Linear(64, 300).bfloat16()
    head = dense.PackedLinear(linear, keep_weight=False, gemm=bf16_gemm, small_rows=bf16_gemm.max_rows)
    fused = Bf16GreedyHead(head)
    cut = bf16_gemm.max_rows
    for rows in (1, cut or 40, (cut or 40) + 1):
        x = torch.randn(rows, 64).bfloat16()
        tokens = fused(x)
        beyond = cut is not None and rows > cut
        assert (tokens is None) == beyond, rows
        if tokens is not None:
            assert torch.equal(tokens, KERNELS.argmax(head(x)))


def test_bfloat16_greedy_steps_take_the_fused_head_and_give_the_unfused_tokens(llama_dir):
    """An all-greedy bfloat16 engine's steps take the fused head where the GEMM is vdpbf16ps or AMX
    tiles, and give the tokens of an engine without it (its bfloat16 logits and the argmax kernel)."""
    engine = LLMEngine(EngineConfig(model_path=llama_dir, num_blocks=256, dtype="bfloat16"))
    head = engine.runner.forward.greedy_head
    if not isinstance(head, Bf16GreedyHead):
        pytest.skip(f"no fused bfloat16 head here: {engine.runner.forward.greedy_reason}")
    assert head.what in engine.runner.describe()
    prompts = [[11, 12, 13], list(range(40, 75)), [5] * 9]
    greedy = [SamplingParams(max_tokens=12, ignore_eos=True)] * 3
    got = _run(engine, prompts, greedy)
    assert head.calls >= 11 and head.full == 0  # every decode step (the prompts' step: the kernel decoder's where it takes 47 rows)
    off = LLMEngine(EngineConfig(model_path=llama_dir, num_blocks=256, dtype="bfloat16", greedy_head=False))
    assert got == _run(off, prompts, greedy)


@pytest.fixture
def int8_gemm():
    """The bfloat16 GEMM on AMX tiles where the greedy head's int8 first pass runs (AMX-INT8)."""
    gemm = KERNELS.gemm_for(torch.bfloat16)
    if gemm is None or not gemm.int8_head_ready():
        pytest.skip("no AMX-INT8 tiles here for the int8 first pass")
    return gemm


@pytest.mark.parametrize("rows", [1, 6, 16])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("prefetch", [4, 0, 64])
def test_the_int8_first_pass_gives_the_exact_heads_tokens(int8_gemm, rows, threads, prefetch):
    """`pd_bf16_greedy_i8` against the argmax kernel over the GEMM's bfloat16 logits: random rows, an
    exact tie (the first wins), a run of columns equal once their logits round to bfloat16, a part
    panel and k not a multiple of the int8 tiles' 64; every row decided by the int8 pass. With the
    panels prefetched 4 k-steps ahead (the default: k's 4 steps, so into the next pair), none, or
    more steps than k has (`pd_amx_prefetch`)."""
    n, k = 1003, 200
    torch.manual_seed(rows + 10 * threads)
    linear = nn.Linear(k, n, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(n, k) * 0.05)
        linear.weight[300] = linear.weight[7]
        for i in range(40):  # logits within a bfloat16 step of each other for x along w[5]
            linear.weight[600 + i] = linear.weight[5] * (1 + i * 2**-14)
        linear.weight[5] = linear.weight[5] * (1 + 2**-10)
    head = dense.PackedLinear(linear.bfloat16(), keep_weight=False, gemm=int8_gemm, small_rows=None)
    x = torch.randn(rows, k).bfloat16()
    w = head.weight if getattr(head, "weight", None) is not None else linear.weight
    if rows >= 6:
        x[0], x[1] = w[7].bfloat16() * 300, w[600].bfloat16() * 40
        x[2] = x[2] * 2**-100  # tiny: the flushed-subnormal term of the bound
    before, default = torch.get_num_threads(), KERNELS.amx_gemm.prefetch(prefetch)
    torch.set_num_threads(threads)
    try:
        fused = Bf16GreedyHead(head, int8=True)
        fused.MOST = 1.0  # a head this small: 16 rows' candidates may span over a quarter of its 63 panels
        tokens = fused(x)
        want = KERNELS.argmax(head(x))
    finally:
        torch.set_num_threads(before)
        KERNELS.amx_gemm.prefetch(default)
    assert fused.int8 is not None and fused.int8_calls == 1 and fused.undecided == 0
    assert tokens is not None and torch.equal(tokens, want)
    assert 0 < fused.reread < -(-n // 16)
    if rows >= 6:
        assert tokens[0] == 7


def test_the_int8_pass_leaves_what_it_does_not_bound_to_the_exact_head(int8_gemm):
    """A row of zeros (ties everywhere), a NaN (the logits), a window wider than `MOST` (the exact
    head, and after `TRIES` such steps no int8 copy), and a head with a bias (no int8 copy)."""
    torch.manual_seed(0)
    head = dense.PackedLinear(nn.Linear(96, 500, bias=False).bfloat16(), keep_weight=False, gemm=int8_gemm,
                              small_rows=None)
    assert Bf16GreedyHead(head).int8 is None  # a head this small keeps the exact head only (`INT8_BYTES`)
    fused = Bf16GreedyHead(head, int8=True)
    x = torch.randn(4, 96).bfloat16()
    x[1] = 0
    assert torch.equal(fused(x), KERNELS.argmax(head(x))) and fused.undecided == 1 and fused.full == 0
    x[2, 3] = float("nan")
    assert fused(x) is None and fused.full == 1
    wide = Bf16GreedyHead(head, int8=True)
    wide.MOST = 0.0  # every step's candidates are too many
    for _ in range(wide.TRIES):
        y = torch.randn(3, 96).bfloat16()
        assert torch.equal(wide(y), KERNELS.argmax(head(y)))
    assert wide.int8 is None and wide.undecided == wide.TRIES
    biased = dense.PackedLinear(nn.Linear(96, 500).bfloat16(), keep_weight=False, gemm=int8_gemm, small_rows=None)
    assert Bf16GreedyHead(biased, int8=True).int8 is None


def test_an_engine_whose_head_takes_the_int8_pass_gives_the_unfused_tokens(llama_dir, int8_gemm, monkeypatch):
    """Through a whole bfloat16 engine: with the int8 pass on every head size (a tiny model's head is far
    below `INT8_BYTES`), greedy steps go through it, and the tokens are those of an engine without the
    fused head (its bfloat16 logits and the argmax kernel)."""
    monkeypatch.setattr(Bf16GreedyHead, "INT8_BYTES", 0)
    monkeypatch.setattr(Bf16GreedyHead, "MOST", 1.0)  # a tiny head: a step's candidates may span most of its panels
    engine = LLMEngine(EngineConfig(model_path=llama_dir, num_blocks=256, dtype="bfloat16"))
    head = engine.runner.forward.greedy_head
    assert isinstance(head, Bf16GreedyHead) and head.int8 is not None
    prompts = [[11, 12, 13], list(range(40, 75)), [5] * 9]
    greedy = [SamplingParams(max_tokens=12, ignore_eos=True)] * 3
    got = _run(engine, prompts, greedy)
    assert head.int8_calls >= 11 and head.undecided < head.int8_calls  # the int8 pass decided steps
    off = LLMEngine(EngineConfig(model_path=llama_dir, num_blocks=256, dtype="bfloat16", greedy_head=False))
    assert got == _run(off, prompts, greedy)
