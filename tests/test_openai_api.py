"""The OpenAI-compatible HTTP API end to end, with the official `openai` SDK as the client:
tokens identical to transformers and to the gRPC path, streaming and usage, the error status of
each refusal, a client that goes away frees every KV block, and shutdown answers 503 (SIGTERM to
`pdserve serve` with an HTTP stream in flight: tests/test_serve.py)."""

from __future__ import annotations

import json
import random
import shutil
import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import httpx2
import openai
import pytest
import ray
from transformers import AutoTokenizer

from router.config.loader import parse_config
from router.config.typed_yaml import ConfigError
from router.launch import LocalCluster
from tests.cluster_util import Client, cluster_config, faults, set_faults, wait_until
from tests.reference import hf_greedy

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
MODEL = "llama"  # the served model's id: its directory's name (conftest's llama_dir)
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Once upon a time"}]


pytestmark = pytest.mark.usefixtures("ray_instance")  # one local Ray for the module (conftest)


def _copy_model(src: str, dst: Path, chat_template: bool) -> str:
    """A copy of the tiny model with a chat template (the model's own, else CHAT_TEMPLATE) or without one."""
    shutil.copytree(src, dst)
    config_path = dst / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    if not chat_template:
        config.pop("chat_template", None)
        (dst / "chat_template.jinja").unlink(missing_ok=True)
    elif not AutoTokenizer.from_pretrained(str(dst)).chat_template:
        config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(config))
    return str(dst)


@pytest.fixture(scope="module")
def chat_dir(served) -> str:
    """The served tiny model; it has a chat template of its own."""
    assert AutoTokenizer.from_pretrained(served.cfg.model.path).chat_template
    return served.cfg.model.path


@pytest.fixture(scope="module")
def cluster(served):  # the session's default 1 + 1 cluster (conftest), its HTTP port on
    assert Path(served.cfg.model.path).name == MODEL  # the id /v1/models gives
    return served


@pytest.fixture(scope="module")
def client(cluster):
    with openai.OpenAI(base_url=cluster.http_url, api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def _prompt(seed: int, n: int = 20) -> list[int]:
    rng = random.Random(f"test_openai_api-{seed}")  # its own prompts: the shared clusters' caches hold others'
    return [rng.randrange(10, 2000) for _ in range(n)]


def _no_leaks(cluster: LocalCluster, within_s: float) -> None:
    """Within `within_s`, no request is in flight and every worker's KV pool is whole and unused."""
    deadline = time.monotonic() + within_s
    while True:
        counts = {w.name: ray.get(w.actor.check.remote()) for w in cluster.router.pools.all()}
        idle = not cluster.router.lives and all(c["used"] == 0 and c["free"] == c["total"] for c in counts.values())
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert idle, (len(cluster.router.lives), counts)


def _finished(cluster: LocalCluster, reason: str) -> float:
    return cluster.router.metrics.registry.get_sample_value("pdserve_requests_total", {"finish_reason": reason}) or 0


def test_http_port_is_validated():
    assert parse_config({}).router.http_port is None
    assert parse_config({"router": {"http_port": 0}}).router.http_port == 0
    with pytest.raises(ConfigError, match="router.http_port: must be a port number"):
        parse_config({"router": {"http_port": 70000}})


# ---- through a real cluster -------------------------------------------------------------------
def test_greedy_completion_is_transformers_token_for_token(client, chat_dir):
    prompt = _prompt(1)
    resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True})
    choice = resp.choices[0]
    assert choice.token_ids == hf_greedy(chat_dir, prompt, 12, ignore_eos=True)
    assert choice.text == AutoTokenizer.from_pretrained(chat_dir).decode(choice.token_ids)
    assert choice.finish_reason == "length" and resp.model == MODEL and resp.object == "text_completion"
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens, resp.usage.total_tokens) == (20, 12, 32)
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert again.choices[0].token_ids == choice.token_ids
    assert again.usage.prompt_tokens_details.cached_tokens == 16  # its one full block came from the prefix cache


def test_streaming_carries_the_same_tokens_and_usage_last(client):
    prompt = _prompt(2)
    args = {"model": MODEL, "max_tokens": 10, "temperature": 0, "extra_body": {"ignore_eos": True}}
    whole = client.completions.create(prompt=prompt, **args).choices[0]
    chunks = list(client.completions.create(prompt=prompt, stream=True, stream_options={"include_usage": True},
                                            **args))
    *token_chunks, usage_chunk = chunks
    assert [t for c in token_chunks for t in c.choices[0].token_ids] == whole.token_ids
    assert "".join(c.choices[0].text for c in token_chunks) == whole.text
    assert [c.choices[0].finish_reason for c in token_chunks][-2:] == [None, "length"]
    assert usage_chunk.choices == []
    assert (usage_chunk.usage.prompt_tokens, usage_chunk.usage.completion_tokens) == (20, 10)
    assert all(c.usage is None for c in token_chunks)


@pytest.mark.parametrize("chat", [False, True])
def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(client, chat):
    """vLLM's stream_options.continuous_usage_stats, as guidellm sends it with every request."""
    args = {"model": MODEL, "max_tokens": 6, "temperature": 0, "stream": True, "extra_body": {"ignore_eos": True},
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    create = client.chat.completions.create if chat else client.completions.create
    *chunks, last = list(create(messages=CHAT, **args) if chat else create(prompt=_prompt(7), **args))
    assert last.choices == [] and last.usage.completion_tokens == 6
    made = 0
    for chunk in chunks:
        made += len(chunk.choices[0].token_ids)
        assert (chunk.usage.prompt_tokens, chunk.usage.completion_tokens, chunk.usage.total_tokens) == (
            last.usage.prompt_tokens, made, last.usage.prompt_tokens + made)
    assert made == 6


def test_stream_events_end_in_a_blank_line_of_bare_newlines(cluster):
    """"\n\n" between events, as OpenAI and vLLM send them: `vllm bench serve` splits on it, and
    with "\r\n" line ends it failed every request whose events came several to a read."""
    body = {"model": MODEL, "prompt": _prompt(8), "max_tokens": 4, "stream": True, "ignore_eos": True}
    with httpx2.stream("POST", f"{cluster.http_url}/completions", json=body, timeout=120) as reply:
        raw = b"".join(reply.iter_raw())
    assert b"\r" not in raw and raw.endswith(b"data: [DONE]\n\n")
    assert raw.count(b"\n\n") == raw.count(b"data: ") >= 2  # each event, then [DONE]


def test_seed_reproduces_and_matches_the_grpc_path(client, cluster):
    prompt = _prompt(3)

    def sampled(seed: int) -> list[int]:  # temperature left out: OpenAI's default 1.0 samples
        return client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, seed=seed,
                                         extra_body={"ignore_eos": True}).choices[0].token_ids

    first = sampled(7)
    assert sampled(7) == first and sampled(8) != first
    grpc_client = Client(cluster.address)
    assert grpc_client.tokens(prompt, max_tokens=16, temperature=1.0, seed=7, ignore_eos=True)[0] == first
    grpc_client.close()


def test_chat_renders_the_template_and_streams_a_role_first(client, chat_dir):
    tok = AutoTokenizer.from_pretrained(chat_dir)
    rendered = tok.encode(tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False),
                          add_special_tokens=False)
    args = {"model": MODEL, "temperature": 0, "extra_body": {"ignore_eos": True}}
    resp = client.chat.completions.create(messages=CHAT, max_tokens=9, **args)
    assert resp.choices[0].token_ids == hf_greedy(chat_dir, rendered, 9, ignore_eos=True)
    assert resp.choices[0].message.role == "assistant" and resp.usage.prompt_tokens == len(rendered)
    chunks = list(client.chat.completions.create(messages=CHAT, max_completion_tokens=9, stream=True, **args))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].object == "chat.completion.chunk"
    assert "".join(c.choices[0].delta.content for c in chunks) == resp.choices[0].message.content
    default = client.chat.completions.create(messages=CHAT, **args)  # no max_tokens: up to 256
    assert default.usage.completion_tokens == 256 and default.choices[0].finish_reason == "length"


@pytest.mark.parametrize("args, status, message", [
    ({"prompt": [5, 6], "top_p": 2}, 400, "top_p must be in (0, 1], got 2"),
    ({"prompt": [5, 6], "n": 2}, 400, "n must be 1"),
    ({"prompt": ["a", "b"]}, 400, "one prompt per request"),
    ({"prompt": [5, 10**6]}, 400, "outside the vocabulary"),
    ({"prompt": [5], "max_tokens": 5000}, 400, "exceeds the model's context"),
    ({"prompt": [5], "temperature": -1, "stream": True}, 400, "temperature must be >= 0"),
    ({"prompt": [5], "logprobs": 0}, 400, "logprobs is not supported: pdserve accepts only null"),
    ({"prompt": [5], "extra_body": {"guided_json": {"type": "object"}}}, 400,
     '/v1/completions has no field "guided_json" in pdserve'),
])
def test_refusals_are_openai_error_objects(client, cluster, args, status, message):
    errors_before = cluster.router.metrics.registry.get_sample_value(
        "pdserve_request_errors_total", {"status": "INVALID_ARGUMENT"}) or 0
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, **args)
    assert err.value.status_code == status and message in err.value.body["message"]
    assert err.value.body["type"] == "invalid_request_error"
    assert cluster.router.metrics.registry.get_sample_value(
        "pdserve_request_errors_total", {"status": "INVALID_ARGUMENT"}) == errors_before + 1


@pytest.mark.parametrize("content", [5, True, 1.5, {"text": "hi"}, None, [{"type": "image_url"}]])
def test_a_chat_content_that_is_not_text_is_400_naming_the_field(client, content):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"},
                                                              {"role": "assistant", "content": content}])
    assert err.value.status_code == 400 and err.value.body["param"] == "messages[1].content"
    assert err.value.body["message"].startswith("messages[1].content")


def _get(url: str, data: bytes | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_models_health_and_malformed_bodies(client, cluster):
    assert [m.id for m in client.models.list().data] == [MODEL]
    root = cluster.http_url.removesuffix("/v1")
    assert _get(f"{root}/health") == (200, {"status": "serving"})
    status, body = _get(f"{cluster.http_url}/completions", b"{not json")
    assert status == 400 and "not valid JSON" in body["error"]["message"]
    status, body = _get(f"{cluster.http_url}/completions", b'{"prompt": ' + b"[" * 200_000)
    assert status == 400 and body["error"]["message"] == "the request body nests JSON more than 32 levels deep"
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gpt-4o", prompt=[5])
    assert err.value.body["code"] == "model_not_found"
    status, body = _get(f"{cluster.http_url}/nowhere")
    assert status == 404 and body["error"]["type"] == "invalid_request_error"


def test_a_client_that_leaves_mid_stream_frees_every_block(client, cluster):
    finished, cancelled = _finished(cluster, "length"), _finished(cluster, "cancelled")
    stream = client.completions.create(model=MODEL, prompt=_prompt(4), max_tokens=1900, stream=True,
                                       extra_body={"ignore_eos": True})
    for i, _chunk in enumerate(stream):
        if i == 3:
            break
    stream.close()
    # The deadline only bounds a hang; the finish counts prove it was a cancel, not a run to the end.
    _no_leaks(cluster, within_s=10.0)
    assert _finished(cluster, "length") == finished
    assert _finished(cluster, "cancelled") == cancelled + 1


def test_a_client_that_times_out_before_the_reply_frees_every_block(cluster):
    finished, cancelled = _finished(cluster, "length"), _finished(cluster, "cancelled")
    # slow steps: the 1900 tokens would take 38 s or more, so the reply cannot beat the client's
    # 3 s, and 3 s is ample for the request to be accepted first (the count below proves it was)
    with faults(cluster, step_delay_s=0.02):
        with openai.OpenAI(base_url=cluster.http_url, api_key="unused", max_retries=0, timeout=3) as impatient:
            with pytest.raises(openai.APITimeoutError):
                impatient.completions.create(model=MODEL, prompt=_prompt(5), max_tokens=1900, temperature=0,
                                             extra_body={"ignore_eos": True})
        _no_leaks(cluster, within_s=10.0)  # under CI load the disconnect can take a while to be noticed
    assert _finished(cluster, "length") == finished
    assert _finished(cluster, "cancelled") == cancelled + 1


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_queue_full_429_no_chat_template_400_shutting_down_503(llama_dir, tmp_path):
    # 8 blocks of 16 tokens: a 100-token prompt holds 7, so a second one waits and a third finds the queue full
    model = _copy_model(llama_dir, tmp_path / "plain", chat_template=False)
    cfg = cluster_config(model, kv_cache={"num_blocks": 8}, router={"max_queue": 1, "http_port": 0,
                                                                   "shutdown_grace_s": 30})
    cluster = LocalCluster(cfg).__enter__()
    stopper = threading.Thread(target=cluster.__exit__, args=(None, None, None))
    port = cluster.cluster.http_port
    client = openai.OpenAI(base_url=cluster.http_url, api_key="unused", max_retries=0, timeout=120)
    try:
        with pytest.raises(openai.BadRequestError, match="this model has no chat template"):
            client.chat.completions.create(model="plain", messages=CHAT)
        args = {"model": "plain", "max_tokens": 20, "stream": True, "extra_body": {"ignore_eos": True}}
        set_faults(cluster, step_delay_s=0.1)  # the first holds its blocks for 2 s or more
        first = iter(client.completions.create(prompt=[7] * 100, **args))  # answers once its first token is out
        second: list = []
        waiting = threading.Thread(target=lambda: second.extend(client.completions.create(prompt=[8] * 100, **args)))
        waiting.start()
        wait_until(lambda: cluster.router.queue_length == 1, 10, "the second request to queue")
        with pytest.raises(openai.RateLimitError) as err:
            client.completions.create(prompt=[9] * 100, **args)
        assert err.value.status_code == 429 and "queue is full" in err.value.body["message"]
        assert cluster.router.queue_length == 1  # refused while the first still held its blocks
        set_faults(cluster, step_delay_s=0.02)  # the next stream's 100 tokens: 2 s or more
        assert sum(len(c.choices[0].token_ids) for c in first) == 20
        waiting.join(60)
        assert sum(len(c.choices[0].token_ids) for c in second if c.choices) == 20

        prompt = _prompt(6, n=10)
        stream = iter(client.completions.create(prompt=prompt, model="plain", max_tokens=100, temperature=0,
                                                stream=True, extra_body={"ignore_eos": True}))
        got = list(next(stream).choices[0].token_ids)
        stopper.start()
        wait_until(lambda: not cluster.router.accepting, 5, "the shutdown to begin", every=0.01)
        with pytest.raises(openai.InternalServerError) as err:
            client.completions.create(model="plain", prompt=prompt, max_tokens=5)
        assert err.value.status_code == 503 and "shutting down" in err.value.body["message"]
        assert _get(f"http://127.0.0.1:{port}/health")[0] == 503
        assert len(cluster.router.lives) == 1, "the accepted request ended before the refusals"
        got += [t for chunk in stream for t in chunk.choices[0].token_ids]  # in flight: still completes
        assert got == hf_greedy(model, prompt, 100, ignore_eos=True)
    finally:
        if stopper.ident is None:
            cluster.__exit__(None, None, None)
        stopper.join(60)
        client.close()
    assert not stopper.is_alive() and not _port_open(port)
