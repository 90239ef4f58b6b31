"""Every served model family, token-exact against transformers' `generate` on a tiny random
checkpoint of its architecture (checkpoints/families.py): prompts longer than the sliding window,
block sizes the window does not divide, prefill chunks shorter than the window, prefix-cache hits
and a resume from outputs made elsewhere. A checkpoint needing what paged attention lacks is refused
at load with one line naming the feature."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import yaml

from checkpoints.families import FAMILIES, WINDOW, build_family_config
from cli.main import main as pdserve
from engine.config import EngineConfig
from engine.forward import features
from engine.llm_engine import LLMEngine
from engine.model_runner import probe_checkpoint
from protocol.sampling import SamplingParams
from sizing.memory import layer_windows
from tests.reference import hf_greedy, record_prefill_chunks

BLOCK, CHUNK = 4, 5  # the window (7) spans block boundaries; a 5-token chunk splits a window
SAMPLING = SamplingParams(max_tokens=12, ignore_eos=True)
_ENGINES: dict[str, LLMEngine] = {}


def _prompts(n: int, seed: int, lo: int = 2 * WINDOW, hi: int = 5 * WINDOW) -> list[list[int]]:
    rng = random.Random(f"families-{seed}")
    return [[rng.randrange(10, 2000) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _engine(family_dir, family: str) -> LLMEngine:
    """One engine per family for the module; each test leaves it idle with every block free."""
    if family not in _ENGINES:
        _ENGINES[family] = LLMEngine(EngineConfig(model_path=family_dir(family), dtype="float32", block_size=BLOCK, num_blocks=256,
                                                  chunk_size=CHUNK, max_num_batched_tokens=64))
    return _ENGINES[family]


def _run_to_end(engine: LLMEngine) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.token_ids)
    engine.check()
    assert engine.allocator.num_used == 0, "blocks leaked after every request finished"
    return out


@pytest.fixture(scope="module", autouse=True)
def _drop_engines():
    yield
    _ENGINES.clear()


@pytest.mark.parametrize("family", FAMILIES)
def test_the_probe_finds_each_layers_features(family_dir, family):
    engine = _engine(family_dir, family)
    config = build_family_config(family)
    features = engine.runner.layer_features
    types = getattr(config, "layer_types", None)
    if family in ("mistral", "phi3"):
        expected = [WINDOW] * 4
    elif types is not None and getattr(config, "sliding_window", None):
        expected = [WINDOW if t == "sliding_attention" else None for t in types]
    else:
        expected = [None] * 4
    assert [f.sliding_window for f in features] == expected
    assert {None, WINDOW} == set(expected) or family in ("llama", "olmo2", "granite", "mistral", "phi3")
    assert [f.softcap for f in features] == [3.0 if family == "gemma2" else None] * 4
    scale = {"gemma2": 24**-0.5, "gemma3": 24**-0.5, "granite": 0.2}.get(family, 16**-0.5)
    assert [f.scaling for f in features] == pytest.approx([scale] * 4)


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_and_chunked_prefill_match_generate(family_dir, family):
    engine = _engine(family_dir, family)
    prompts = _prompts(3, seed=1)
    chunks = record_prefill_chunks(engine)
    try:
        for i, p in enumerate(prompts):
            engine.add_request(f"b{i}", prompt_token_ids=p, sampling=SAMPLING)
        out = _run_to_end(engine)
    finally:
        del engine.scheduler.schedule
    assert [out[f"b{i}"] for i in range(3)] == [hf_greedy(family_dir(family), p, 12, ignore_eos=True) for p in prompts]
    assert all(len(chunks[f"b{i}"]) >= 3 and max(chunks[f"b{i}"]) == CHUNK for i in range(3))  # windows split


@pytest.mark.parametrize("family", FAMILIES)
def test_prefix_cache_hits_match_generate(family_dir, family):
    engine = _engine(family_dir, family)
    shared = _prompts(1, seed=2, lo=6 * BLOCK, hi=6 * BLOCK)[0]  # six full blocks, cached after the first
    tails = _prompts(2, seed=3, lo=3, hi=9)
    prompts = [shared + tail for tail in tails]
    before = engine.prefix_stats.hit_tokens
    got = [engine.generate([p], SAMPLING)[0] for p in prompts]
    assert engine.prefix_stats.hit_tokens - before == 6 * BLOCK  # the second prompt reused every shared block
    assert got == [hf_greedy(family_dir(family), p, 12, ignore_eos=True) for p in prompts]


@pytest.mark.parametrize("family", FAMILIES)
def test_resume_and_hand_off_continue_token_exact(family_dir, family):
    """A migration: the request continues from outputs made elsewhere (recomputing its KV), or
    from KV another request computed (a prefill-only request, KV copied into reserved blocks)."""
    engine = _engine(family_dir, family)
    prompt = _prompts(1, seed=4)[0]
    expected = hf_greedy(family_dir(family), prompt, 12, ignore_eos=True)
    engine.add_request("resumed", prompt_token_ids=prompt, sampling=SAMPLING, output_token_ids=expected[:5])
    assert _run_to_end(engine)["resumed"] == expected[5:]

    engine.add_request("pre", prompt_token_ids=prompt, sampling=SAMPLING, prefill_only=True)
    (prefilled,) = engine.step()
    dst, _ = engine.reserve("dec", len(prompt) + SAMPLING.max_tokens)
    n = engine.blocks_for(len(prompt))
    engine.runner.kv[dst[:n]] = engine.runner.kv[engine.requests["pre"].block_ids[:n]]
    engine.release("pre")
    engine.add_prefilled("dec", prompt, prefilled.token_ids, SAMPLING)
    assert prefilled.token_ids + _run_to_end(engine)["dec"] == expected


@pytest.fixture(scope="module")
def sinks_dir(tmp_path_factory) -> str:
    """A tiny random gpt-oss checkpoint: its attention passes sinks (`s_aux`) to the attention function."""
    from transformers import AutoModelForCausalLM, GptOssConfig

    config = GptOssConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=8, intermediate_size=32, num_local_experts=2,
                          num_experts_per_tok=1, sliding_window=4)
    path = tmp_path_factory.mktemp("gpt_oss")
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return str(path)


SINKS_REFUSAL = "gpt_oss checkpoints need attention sinks, which pdserve's paged attention does not serve"


def test_sinks_are_refused_at_load_naming_the_feature(sinks_dir):
    """Refused, never served wrongly: by the engine (a worker's load) and from config.json alone."""
    with pytest.raises(features.UnsupportedModel) as err:
        LLMEngine(EngineConfig(model_path=sinks_dir, num_blocks=8, dtype="float32"))
    assert str(err.value) == SINKS_REFUSAL
    with pytest.raises(features.UnsupportedModel, match=f"^{SINKS_REFUSAL}$"):
        probe_checkpoint(sinks_dir)


def test_serve_exits_2_with_one_line_naming_the_feature(sinks_dir, tmp_path, capsys, monkeypatch):
    """`pdserve serve` run by the console script's `main` in this process (a fresh interpreter
    costs 10 s or more here; tests/test_cli.py proves the process's exit status is main's). The
    refusal comes before Ray: a serve that got as far as starting it fails here instead."""
    import router.launch

    def reached_ray(cfg):
        raise AssertionError("serve went on to start Ray: the checkpoint was not refused")
    monkeypatch.setattr(router.launch, "init_ray", reached_ray)
    config = tmp_path / "cluster.yaml"
    config.write_text(yaml.safe_dump({"model": {"path": sinks_dir}}))
    capsys.readouterr()
    assert pdserve(["serve", "--config", str(config)]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"pdserve: error: model.path: {sinks_dir}: {SINKS_REFUSAL}"]


def test_the_meta_probe_and_the_plan_agree_with_the_loaded_model(family_dir):
    """What the router checks from config.json alone, and the windows `pdserve plan` reads from it,
    are what the workers' loaded models report."""
    for family in FAMILIES:
        loaded = _engine(family_dir, family).runner.layer_features
        assert list(probe_checkpoint(family_dir(family))) == loaded, family
        config = json.loads((Path(family_dir(family)) / "config.json").read_text())
        assert list(layer_windows(config, len(loaded))) == [f.sliding_window for f in loaded], family
