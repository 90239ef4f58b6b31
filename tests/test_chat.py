"""Chat over gRPC on the tiny model: `messages` are rendered with the checkpoint's chat template
(exactly the ids of transformers' `apply_chat_template`), bad chats get INVALID_ARGUMENT, and
`pdserve generate --chat` / `pdserve chat` work end to end (chat keeps the conversation, drops a
failed turn, and says so)."""

from __future__ import annotations

import io
import sys

import grpc
import pytest
from transformers import AutoTokenizer

from cli.main import main as pdserve
from client import chat, grpc_client
from proto import pdserve_pb2 as pb
from tests.cluster_util import Client, free_port
from tests.reference import hf_greedy

HELLO = {"role": "user", "content": "Hello there"}
MORE = {"role": "user", "content": "Tell me more about the sea"}


@pytest.fixture(scope="module")
def cluster(served):  # the session's default 1 + 1 cluster (conftest)
    return served


@pytest.fixture(scope="module")
def client(cluster):
    c = Client(cluster.address)
    yield c
    c.close()


def _chat(client: Client, messages: list[dict], **fields) -> list[pb.GenerateResponse]:
    request = pb.GenerateRequest(messages=[pb.ChatMessage(**m) for m in messages], **fields)
    return list(client.gen.Generate(request, timeout=120))


def _reply(client: Client, messages: list[dict], max_tokens: int) -> str:
    return "".join(msg.text for msg in _chat(client, messages, sampling=pb.SamplingParams(max_tokens=max_tokens)))


def test_messages_are_rendered_with_the_chat_template(client, llama_dir):
    messages = [{"role": "system", "content": "Be brief."}, HELLO, {"role": "assistant", "content": "Hi!"}, MORE]
    ids = AutoTokenizer.from_pretrained(llama_dir).apply_chat_template(messages, add_generation_prompt=True,
                                                                       return_dict=False)
    stream = _chat(client, messages, sampling=pb.SamplingParams(max_tokens=12, ignore_eos=True))
    assert stream[-1].usage.prompt_tokens == len(ids)
    assert [t for msg in stream for t in msg.token_ids] == hf_greedy(llama_dir, ids, 12, ignore_eos=True)


@pytest.mark.parametrize("messages, fields, message", [
    ([HELLO], {"prompt": "Once upon a time"}, "give either messages or a prompt / prompt_token_ids, not both"),
    ([HELLO], {"prompt_token_ids": [5, 6, 7]}, "give either messages or a prompt / prompt_token_ids, not both"),
    ([{"role": "robot", "content": "beep"}], {}, "messages[0].role must be one of system, user, assistant, "
                                                 "got 'robot'"),
    ([HELLO, {"role": "", "content": "who?"}], {}, "messages[1].role must be one of"),
    ([{"role": "user", "content": ""}] * 1025, {}, "1025 messages given; at most 1024 are allowed"),
])
def test_bad_chats_are_invalid_argument(client, messages, fields, message):
    with pytest.raises(grpc.RpcError) as err:
        _chat(client, messages, **fields)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details()


def test_generate_chat_sends_one_user_message(cluster, client, capsys):
    expected = _reply(client, [HELLO], max_tokens=8)
    assert pdserve(["generate", "--chat", HELLO["content"], "--max-tokens", "8", "--router", cluster.address]) == 0
    assert capsys.readouterr().out == expected + "\n"


def test_chat_with_piped_stdin_keeps_the_conversation(cluster, client, capsys, monkeypatch):
    """`pdserve chat` with its stdin piped (not a terminal), run by the console script's `main` in
    this process: a fresh interpreter costs 10 s or more here."""
    first = _reply(client, [HELLO], max_tokens=8)
    second = _reply(client, [HELLO, {"role": "assistant", "content": first}, MORE], max_tokens=8)
    assert first and second != _reply(client, [MORE], max_tokens=8), "the second turn sees the first"
    monkeypatch.setattr(sys, "stdin", io.StringIO(f"{HELLO['content']}\n\n{MORE['content']}\n/exit\nnever sent\n"))
    capsys.readouterr()
    assert pdserve(["chat", "--max-tokens", "8", "--router", cluster.address]) == 0
    assert capsys.readouterr().out == f"{first}\n{second}\n"


def test_chat_prints_a_failed_turn_and_leaves_it_out(cluster, client):
    huge = "x" * (cluster.cfg.router.max_prompt_bytes + 1)
    out, err = io.StringIO(), io.StringIO()
    sampling = {"max_tokens": 8}
    status = chat.run(cluster.address, sampling, stdin=io.StringIO(f"{huge}\n{HELLO['content']}\n"), stdout=out,
                      stderr=err)
    assert status == 0
    assert err.getvalue().startswith("pdserve: INVALID_ARGUMENT: the messages are ")
    assert out.getvalue() == "\n" + _reply(client, [HELLO], max_tokens=8) + "\n"  # as if the first never was


def test_chat_with_no_router_is_a_clear_error(capsys, monkeypatch):
    monkeypatch.setattr(grpc_client, "CONNECT_TIMEOUT_S", 0.5)  # nothing listens: no need to wait 5 s
    assert pdserve(["chat", "--router", f"127.0.0.1:{free_port()}"]) == 1
    assert "cannot reach a pdserve router" in capsys.readouterr().err
