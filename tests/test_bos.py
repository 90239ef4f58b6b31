"""Text prompts tokenized as the model expects: a completion's or a gRPC text prompt gets the
tokenizer's BOS, as transformers' `tokenizer(text)` and vLLM give it, a chat rendered by a
template that writes the BOS gets no second one, and `add_special_tokens` on both doors means
what vLLM means by it. The BOS-needing families' tokenizers (Llama 3, Gemma, Mistral) put the
BOS on in their tokenizer.json post-processor; these tests build both of its forms on the tiny
model's vocabulary (the real ones are not reachable offline): Llama 3's byte-level BPE keeps a
ByteLevel step before the template, Gemma's and Mistral's SentencePiece-BPE have the template alone.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import grpc
import openai
import pytest
from transformers import AutoTokenizer

from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc
from protocol.validation import RequestValidator
from router.launch import LocalCluster
from tests.cluster_util import cluster_config
from tests.reference import hf_greedy

TEXT = "Once upon a time there was"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Once upon a time"}]


def _template(bos_id: int) -> dict:
    bos, seq = {"SpecialToken": {"id": "<|bos|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}
    return {"type": "TemplateProcessing", "single": [bos, seq],
            "pair": [bos, seq, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<|bos|>": {"id": "<|bos|>", "ids": [bos_id], "tokens": ["<|bos|>"]}}}


def bos_model(src: str, dst: Path, style: str) -> str:
    """A copy of the tiny model whose tokenizer adds its BOS to every text, in `style`: "llama3"
    (ByteLevel then the template, as Llama 3's tokenizer.json) or "gemma" (the template alone, as
    Gemma's and Mistral's)."""
    shutil.copytree(src, dst)
    path = dst / "tokenizer.json"
    spec = json.loads(path.read_text())
    bos_id = next(t["id"] for t in spec["added_tokens"] if t["content"] == "<|bos|>")
    template = _template(bos_id)
    spec["post_processor"] = ({"type": "Sequence", "processors": [spec["post_processor"], template]}
                              if style == "llama3" else template)
    path.write_text(json.dumps(spec))
    return str(dst)


@pytest.fixture(scope="module", params=["llama3", "gemma"])
def bos_dir(request, llama_dir, tmp_path_factory) -> str:
    return bos_model(llama_dir, tmp_path_factory.mktemp("bos") / request.param, request.param)


def _validator(path: str) -> RequestValidator:
    return RequestValidator(AutoTokenizer.from_pretrained(path), 2048, 2048)


def test_a_text_prompt_gets_the_bos_transformers_gives_it(bos_dir):
    tokenizer, validator = AutoTokenizer.from_pretrained(bos_dir), _validator(bos_dir)
    expected = tokenizer(TEXT).input_ids
    assert expected[0] == tokenizer.bos_token_id and expected[1:] == tokenizer.encode(TEXT, add_special_tokens=False)
    assert validator.prompt_ids(TEXT, None) == expected
    assert validator.prompt_ids(TEXT, None, add_special_tokens=True) == expected
    assert validator.prompt_ids(TEXT, None, add_special_tokens=False) == expected[1:]
    assert validator.prompt_ids(None, [5, 6]) == [5, 6]  # token ids are taken as given


def test_a_chat_whose_template_writes_the_bos_gets_no_second_one(bos_dir):
    tokenizer, validator = AutoTokenizer.from_pretrained(bos_dir), _validator(bos_dir)
    rendered = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    ids = validator.prompt_ids(None, None, CHAT)
    assert ids == tokenizer.encode(rendered, add_special_tokens=False)
    assert ids[0] == tokenizer.bos_token_id != ids[1]
    # add_special_tokens: true on a chat means what it means in vLLM: the tokenizer's BOS as well
    assert validator.prompt_ids(None, None, CHAT, add_special_tokens=True) == tokenizer(rendered).input_ids


# ---- through both doors of a cluster serving a Llama 3-style tokenizer ---------------------------
@pytest.fixture(scope="module")
def cluster(ray_instance, llama_dir, tmp_path_factory):
    path = bos_model(llama_dir, tmp_path_factory.mktemp("served") / "llama3", "llama3")
    with LocalCluster(cluster_config(path, router={"http_port": 0})) as c:
        yield c


def _grpc_tokens(cluster, add_special_tokens: bool | None) -> list[int]:
    request = pb.GenerateRequest(prompt=TEXT, sampling=pb.SamplingParams(max_tokens=6, ignore_eos=True))
    if add_special_tokens is not None:
        request.add_special_tokens = add_special_tokens
    with grpc.insecure_channel(cluster.address) as channel:
        return [t for m in pb_grpc.GenerationStub(channel).Generate(request, timeout=120) for t in m.token_ids]


def test_both_doors_generate_what_transformers_generates_from_tokenizer_text(cluster):
    path = cluster.cfg.model.path
    with_bos = AutoTokenizer.from_pretrained(path)(TEXT).input_ids
    reference = {True: hf_greedy(path, with_bos, 6, ignore_eos=True),
                 False: hf_greedy(path, with_bos[1:], 6, ignore_eos=True)}
    assert reference[True] != reference[False]  # the BOS changes what the model says
    with openai.OpenAI(base_url=cluster.http_url, api_key="unused", max_retries=0, timeout=120) as client:
        for flag in (None, True, False):
            extra = {"ignore_eos": True} | ({} if flag is None else {"add_special_tokens": flag})
            done = client.completions.create(model="llama3", prompt=TEXT, max_tokens=6, temperature=0,
                                             extra_body=extra)
            assert done.choices[0].token_ids == reference[flag is not False]
            assert done.usage.prompt_tokens == len(with_bos) - (flag is False)
    for flag in (None, True, False):
        assert _grpc_tokens(cluster, flag) == reference[flag is not False]
