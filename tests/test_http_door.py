"""The HTTP door's refusals and failures through the real app, a real Intake and a real cluster
(issue 46's test audit; tests/test_openai_request.py covers the error mapping over a stand-in):
a full intake refuses before a byte of the body is read (429, and RESOURCE_EXHAUSTED on gRPC), a
chunked body over the limit is 413, an unexpected exception before the first event is a 500 and
after it an error event that ends the stream cleanly, a client that leaves while its request is
queued, and a shutdown while one is queued, end it with exact statuses and no block held; and
router.max_connections_per_address holds on both doors.

One cluster for the module: 8 KV blocks (a 100-token prompt holds 7, so a second one queues),
a queue of one, one request in intake at a time, two connections (HTTP) or calls (gRPC) per
client address. The shutdown test stops it, so it runs last.
"""

from __future__ import annotations

import json
import socket
import threading

import grpc
import pytest

from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc
from router.launch import LocalCluster
from tests.cluster_util import cluster_config, set_faults, wait_until, whole

pytestmark = [pytest.mark.usefixtures("ray_instance"), pytest.mark.second_ray]  # conftest: its xdist group
HANG_S = 60  # bounds a hang only: every wait ends on an event
BUG = "internal error (RuntimeError); the server log has the details"


@pytest.fixture(scope="module")
def cluster(ray_instance, llama_dir):
    cfg = cluster_config(llama_dir, kv_cache={"num_blocks": 8},
                         router={"http_port": 0, "max_queue": 1, "max_preparing": 1, "shutdown_grace_s": 1,
                                 "max_prompt_bytes": 4096, "max_connections_per_address": 2})
    c = LocalCluster(cfg).__enter__()
    yield c
    if c._thread.is_alive():
        c.__exit__(None, None, None)


def _port(cluster) -> int:
    return cluster.cluster.http_port


def _head(path: str, length: int | None = None, chunked: bool = False) -> bytes:
    size = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {length}"
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\n"
            f"{size}\r\n\r\n").encode()


def _read(sock: socket.socket) -> bytes:
    """Everything until the server closes, or one whole Content-Length reply."""
    sock.settimeout(HANG_S)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
        head, sep, body = data.partition(b"\r\n\r\n")
        length = [int(line.split(b":")[1]) for line in head.lower().split(b"\r\n") if line.startswith(b"content-length")]
        if sep and length and len(body) >= length[0]:
            break
    return data


def _post(cluster, body: dict) -> tuple[int, bytes]:
    payload = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", _port(cluster))) as sock:
        sock.sendall(_head("/v1/completions", len(payload)) + payload)
        reply = _read(sock)
    return int(reply.split(b" ", 2)[1]), reply


def _events(reply: bytes) -> list:
    """The JSON data events of an SSE reply (chunked transfer: data lines are whole)."""
    return [json.loads(line[6:]) if line != b"data: [DONE]" else "[DONE]"
            for line in reply.split(b"\n") if line.startswith(b"data: ")]


def test_a_full_intake_refuses_before_the_body_is_read(cluster):
    """One request waits in intake (its tokenizing lane is held): the next big one is refused 429
    from its head alone (none of its body sent, nothing charged), a gRPC call RESOURCE_EXHAUSTED;
    the waiting one is served once the lane is free."""
    intake, bodies = cluster.router.intake, cluster.cluster.http.api.bodies
    release = threading.Event()
    intake._small.submit(release.wait, HANG_S)  # the small lane's one thread, held
    waiting: list = []
    first = threading.Thread(target=lambda: waiting.append(_post(cluster, {"prompt": "hello", "max_tokens": 2})))
    first.start()
    try:
        wait_until(lambda: intake.preparing == 1, HANG_S, "a request to wait in intake")
        with socket.create_connection(("127.0.0.1", _port(cluster))) as sock:
            sock.sendall(_head("/v1/completions", 100_000))  # a large body, never sent
            reply = _read(sock)
        assert reply.startswith(b"HTTP/1.1 429"), reply
        assert b"the router is already preparing 1 requests (router.max_preparing)" in reply
        assert bodies.in_flight == 0  # charged nothing: refused from the head
        with grpc.insecure_channel(cluster.address) as channel, pytest.raises(grpc.RpcError) as err:
            list(pb_grpc.GenerationStub(channel).Generate(pb.GenerateRequest(prompt="hi"), timeout=HANG_S))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "already preparing 1 requests" in err.value.details()
    finally:
        release.set()
        first.join(HANG_S)
    assert waiting[0][0] == 200, waiting
    wait_until(lambda: whole(cluster), HANG_S, "no request, no block held")


def test_a_chunked_body_over_the_limit_is_413(cluster):
    limit = cluster.cluster.http.api.max_body_bytes
    piece = b'{"prompt": "' + b"a" * limit
    with socket.create_connection(("127.0.0.1", _port(cluster))) as sock:
        sock.sendall(_head("/v1/completions", chunked=True) + f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
        reply = _read(sock)
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    assert f"the request body is over {limit} bytes".encode() in reply
    assert cluster.cluster.http.api.bodies.in_flight == 0


@pytest.fixture
def broken_chunk(cluster, monkeypatch):
    """Makes the router's `attempts.tokens.chunk` raise a RuntimeError (a defect) at its call number `fail_at`."""
    real, calls = cluster.router.attempts.tokens.chunk, {"n": 0, "fail_at": 0}

    def chunk(life, out):
        calls["n"] += 1
        if calls["n"] == calls["fail_at"]:
            raise RuntimeError("a defect, with internals: decode-0 at 10.0.0.1:1234")
        return real(life, out)
    monkeypatch.setattr(cluster.router.attempts.tokens, "chunk", chunk)
    return calls


@pytest.mark.parametrize("stream", [False, True])
def test_an_unexpected_exception_before_the_first_event_is_a_500(cluster, broken_chunk, stream):
    broken_chunk["fail_at"] = 1
    status, reply = _post(cluster, {"prompt": [5, 6, 7], "max_tokens": 4, "stream": stream})
    assert status == 500, reply
    body = json.loads(reply.partition(b"\r\n\r\n")[2])
    assert body["error"] == {"message": BUG, "type": "server_error", "param": None, "code": None}
    wait_until(lambda: whole(cluster), HANG_S, "the request to end and its blocks to be freed")


def test_an_unexpected_exception_after_the_first_event_ends_the_stream_cleanly(cluster, broken_chunk):
    broken_chunk["fail_at"] = 2
    status, reply = _post(cluster, {"prompt": [5, 6, 7], "max_tokens": 8, "stream": True, "ignore_eos": True})
    events = _events(reply)
    assert status == 200 and len(events) == 3, reply
    assert len(events[0]["choices"][0]["token_ids"]) == 1
    assert events[1] == {"error": {"message": BUG, "type": "server_error", "param": None, "code": None}}
    assert events[2] == "[DONE]" and reply.endswith(b"0\r\n\r\n")  # the chunked body ends: a clean end
    wait_until(lambda: whole(cluster), HANG_S, "the request to end and its blocks to be freed")


def _hold_the_pool(cluster) -> tuple[threading.Thread, list]:
    """A slow stream (0.2 s a step) of 100 prompt + 20 tokens: it holds all 8 blocks for 4 s or
    more, so another 100-token prompt queues; returns once it decodes."""
    out: list = []
    set_faults(cluster, step_delay_s=0.2)
    t = threading.Thread(target=lambda: out.append(_post(cluster, {"prompt": [7] * 100, "max_tokens": 20,
                                                                   "stream": True, "ignore_eos": True})))
    t.start()

    def decoding() -> bool:
        assert not out, out  # it ended before it decoded: refused
        return any(life.output_token_ids for life in cluster.router.lives.values())
    wait_until(decoding, HANG_S, "the first request to decode")
    return t, out


def _finished(cluster, reason: str) -> float:
    return cluster.router.metrics.registry.get_sample_value("pdserve_requests_total", {"finish_reason": reason}) or 0


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_while_queued_ends_its_request(cluster, stream):
    holder, held = _hold_the_pool(cluster)
    cancelled = _finished(cluster, "cancelled")
    try:
        payload = json.dumps({"prompt": [8] * 100, "max_tokens": 4, "stream": stream}).encode()
        sock = socket.create_connection(("127.0.0.1", _port(cluster)))
        sock.sendall(_head("/v1/completions", len(payload)) + payload)
        wait_until(lambda: cluster.router.queue_length == 1, HANG_S, "the second request to queue")
        sock.close()  # the client leaves
        wait_until(lambda: cluster.router.queue_length == 0 and len(cluster.router.lives) == 1, HANG_S,
                   "the queued request to end")
        assert _finished(cluster, "cancelled") == cancelled + 1
    finally:
        set_faults(cluster)
        holder.join(HANG_S)
    assert held[0][0] == 200 and _events(held[0][1])[-1] == "[DONE]"
    wait_until(lambda: whole(cluster), HANG_S, "no request, no block held")


def test_one_address_gets_at_most_its_share_of_connections(cluster):
    """Two idle connections from 127.0.0.1 are its share: a third is closed as it opens, while one
    from 127.0.0.2 (another address of the same host) is served."""
    limits = cluster.cluster.http.limits
    held = [socket.create_connection(("127.0.0.1", _port(cluster))) for _ in range(2)]
    try:
        wait_until(lambda: limits.by_address["127.0.0.1"] == 2, HANG_S, "two connections counted")
        refused = limits.refused_by_address
        with socket.create_connection(("127.0.0.1", _port(cluster))) as third:
            third.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            third.settimeout(HANG_S)
            try:
                assert third.recv(65536) == b""  # closed unanswered
            except ConnectionResetError:
                pass
        assert limits.refused_by_address == refused + 1
        with socket.create_connection(("127.0.0.1", _port(cluster)), source_address=("127.0.0.2", 0)) as other:
            other.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert _read(other).startswith(b"HTTP/1.1 200")
    finally:
        for sock in held:
            sock.close()
    wait_until(lambda: not limits.by_address, HANG_S, "every connection to be counted out")


def test_one_address_gets_at_most_its_share_of_grpc_calls(cluster):
    """Two slow streams from this address run; a third call is RESOURCE_EXHAUSTED naming the key;
    once they end, calls are served again."""
    service_calls = cluster.cluster.server.generation.by_address
    set_faults(cluster, step_delay_s=0.2)
    channel = grpc.insecure_channel(cluster.address)
    stub = pb_grpc.GenerationStub(channel)
    streams = []
    try:
        for i in range(2):  # one after the other: intake takes one request at a time
            streams.append(stub.Generate(pb.GenerateRequest(prompt_token_ids=[5, 6, 7 + i], sampling=pb.SamplingParams(
                max_tokens=12, ignore_eos=True)), timeout=HANG_S))
            next(streams[-1])
        assert sum(service_calls.values()) == 2
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(pb.GenerateRequest(prompt_token_ids=[9]), timeout=HANG_S))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "2 calls from your address are running (router.max_connections_per_address)" in err.value.details()
    finally:
        set_faults(cluster)
        for stream in streams:
            assert len([t for msg in stream for t in msg.token_ids]) == 11  # the rest of each
    assert len(list(stub.Generate(pb.GenerateRequest(prompt_token_ids=[9], sampling=pb.SamplingParams(
        max_tokens=1)), timeout=HANG_S))) == 1
    channel.close()
    wait_until(lambda: not service_calls and whole(cluster), HANG_S, "no call, no request, no block held")


def test_a_shutdown_while_a_request_is_queued_refuses_it_503(cluster):
    """The last test: it stops the cluster. The queued request gets 503 "shutting down" once the
    grace (1 s) is over; the stream in flight ends with that error event and [DONE]."""
    holder, held = _hold_the_pool(cluster)
    queued: list = []
    second = threading.Thread(target=lambda: queued.append(_post(cluster, {"prompt": [8] * 100, "max_tokens": 4})))
    second.start()
    wait_until(lambda: cluster.router.queue_length == 1, HANG_S, "the second request to queue")
    cluster.__exit__(None, None, None)
    second.join(HANG_S)
    holder.join(HANG_S)
    status, reply = queued[0]
    assert status == 503, reply
    assert json.loads(reply.partition(b"\r\n\r\n")[2])["error"] == {
        "message": "the server is shutting down", "type": "server_error", "param": None, "code": "unavailable"}
    events = _events(held[0][1])
    assert events[-2]["error"]["message"] == "the server is shutting down" and events[-1] == "[DONE]"
    assert not cluster.router.lives
