"""The embedded tiny model: loads offline, is byte-deterministic, round-trips UTF-8, renders
chats with its template, and produces greedy output that depends on the prompt."""

from __future__ import annotations

import unicodedata
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from checkpoints.tiny import BOS_ID, EOS_ID, PAD_ID, build_config, ensure_model, make_tiny_model

ARCHS = ("llama", "qwen2")
MIXED = "Hello, wörld! naïve café — 東京で寿司を食べた。中文测试 한국어 Привет مرحبا 🚀👩‍💻🇯🇵\tx  y\n\n}"
PROMPTS = ("The quick brown fox", "Once upon a time", "def main():", "日本語のテキスト", "Hello, world! 🚀")


@pytest.fixture(scope="module")
def loaded(model_dirs):
    return {arch: (AutoTokenizer.from_pretrained(model_dirs[arch]),
                   AutoModelForCausalLM.from_pretrained(model_dirs[arch]).eval()) for arch in ARCHS}


@pytest.mark.parametrize("arch", ARCHS)
def test_loads_with_auto_classes_and_consistent_ids(loaded, arch):
    tokenizer, model = loaded[arch]
    config = model.config
    assert config.model_type == arch
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
            config.num_key_value_heads, config.intermediate_size) == (64, 2, 4, 2, 128)
    assert config.max_position_embeddings == 2048 and not config.tie_word_embeddings
    assert model.dtype == torch.float32
    assert len(tokenizer) == config.vocab_size == 2048
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == ("<|bos|>", "<|eos|>", "<|pad|>")
    ids = (BOS_ID, EOS_ID, PAD_ID)
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == ids
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == ids
    gen = model.generation_config
    assert (gen.bos_token_id, gen.eos_token_id, gen.pad_token_id) == ids
    has_qkv_bias = model.model.layers[0].self_attn.q_proj.bias is not None
    assert has_qkv_bias == (arch == "qwen2")


@pytest.mark.parametrize("arch", ARCHS)
def test_same_seed_gives_identical_bytes(model_dirs, tmp_path, arch):
    again = make_tiny_model(tmp_path / "again", arch=arch, size="tiny", seed=0)
    other = make_tiny_model(tmp_path / "other", arch=arch, size="tiny", seed=1)
    ref = Path(model_dirs[arch])
    for name in ("model.safetensors", "tokenizer.json", "chat_template.jinja", "config.json", "generation_config.json"):
        assert (again / name).read_bytes() == (ref / name).read_bytes(), name
    assert (other / "model.safetensors").read_bytes() != (ref / "model.safetensors").read_bytes()
    assert (other / "tokenizer.json").read_bytes() == (ref / "tokenizer.json").read_bytes()


@pytest.mark.parametrize("arch", ARCHS)
def test_utf8_round_trip_without_automatic_specials(loaded, arch):
    tokenizer, _ = loaded[arch]
    ids = tokenizer.encode(MIXED)
    assert tokenizer.decode(ids) == MIXED
    assert not {BOS_ID, EOS_ID, PAD_ID} & set(ids)
    assert len(ids) < len(MIXED.encode("utf-8"))  # merges learned, not just bytes
    assert tokenizer.decode([BOS_ID, *ids, EOS_ID], skip_special_tokens=True) == MIXED


@pytest.mark.parametrize("arch", ARCHS)
def test_chat_template_renders_each_turn_between_special_tokens(loaded, arch):
    tokenizer, _ = loaded[arch]
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"},
            {"role": "assistant", "content": "Hi!"}, {"role": "user", "content": "Bye"}]
    text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert text == ("<|bos|>system\nBe brief.<|eos|>\n<|bos|>user\nHello<|eos|>\n"
                    "<|bos|>assistant\nHi!<|eos|>\n<|bos|>user\nBye<|eos|>\n<|bos|>assistant\n")
    ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=False)
    assert ids == tokenizer.encode(text, add_special_tokens=False)
    assert (ids.count(BOS_ID), ids.count(EOS_ID), ids[0]) == (5, 4, BOS_ID)  # specials are single ids
    assert tokenizer.decode(ids) == text


def test_llama_round_trips_non_nfc_text_and_qwen2_normalizes_it(loaded):
    decomposed = "cafe\u0301 e\u0301te\u0301"
    llama_tok, _ = loaded["llama"]
    qwen_tok, _ = loaded["qwen2"]
    assert llama_tok.decode(llama_tok.encode(decomposed)) == decomposed
    assert qwen_tok.decode(qwen_tok.encode(decomposed)) == unicodedata.normalize("NFC", decomposed)


def _greedy(tokenizer, model, prompt: str, n: int = 30) -> list[int]:
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_output_is_varied_and_prompt_dependent(loaded, arch):
    tokenizer, model = loaded[arch]
    outputs = [_greedy(tokenizer, model, p) for p in PROMPTS]
    for out in outputs:
        assert len(out) == 30
        assert len(set(out)) >= 10, out
        assert not {BOS_ID, PAD_ID} & set(out), "BOS/PAD rows are muted in the LM head"
    assert len({tuple(out) for out in outputs}) == len(PROMPTS)
    assert len({out[0] for out in outputs}) >= 4


@pytest.mark.parametrize("arch", ARCHS)
def test_next_token_depends_on_context_not_just_last_token(loaded, arch):
    _, model = loaded[arch]
    generator = torch.Generator().manual_seed(0)
    a = torch.randint(3, 2048, (20, 12), generator=generator)
    b = torch.randint(3, 2048, (20, 12), generator=generator)
    b[:, -1] = a[:, -1]
    with torch.inference_mode():
        logits_a, logits_b = model(a).logits, model(b).logits  # [20, 12, V]
    same = logits_a[:, -1].argmax(-1) == logits_b[:, -1].argmax(-1)
    assert same.sum().item() <= 5
    muted = logits_a[..., [BOS_ID, PAD_ID]]
    assert (muted == 0).all() and (muted < logits_a.amax(-1, keepdim=True)).all()


def test_ensure_model_builds_once_and_survives_a_race(tmp_path):
    target = tmp_path / "shared" / "tiny"
    with ThreadPoolExecutor(max_workers=3) as pool:
        paths = list(pool.map(lambda _: ensure_model(target, arch="llama"), range(3)))
    assert paths == [target] * 3
    assert AutoTokenizer.from_pretrained(target).decode([BOS_ID]) == "<|bos|>"
    assert [p.name for p in target.parent.iterdir()] == ["tiny"]  # no staging dirs left
    mtime = (target / "model.safetensors").stat().st_mtime_ns
    assert ensure_model(target) == target
    assert (target / "model.safetensors").stat().st_mtime_ns == mtime


def test_ensure_model_refuses_a_foreign_non_empty_dir(tmp_path):
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("not a model")
    with pytest.raises(FileExistsError, match="no config.json"):
        ensure_model(tmp_path / "junk")


def test_bench_config_and_bad_choices():
    config = build_config("qwen2", "bench")
    assert (config.vocab_size, config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
            config.num_key_value_heads, config.intermediate_size, config.max_position_embeddings) == (
        32000, 512, 8, 8, 4, 1408, 4096)
    with pytest.raises(ValueError, match="unknown arch 'gpt2'"):
        make_tiny_model("unused", arch="gpt2")
    with pytest.raises(ValueError, match="unknown size 'huge'"):
        build_config("llama", "huge")
