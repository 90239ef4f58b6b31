"""Hostile clients at both front doors of a real cluster (issue 46): every connection ends
within a deadline of its last progress whatever it was answered, a stream its client stops
reading is cancelled after router.write_timeout_s with its KV blocks freed, each door caps its
connections. The cluster's deadlines are short (1 s) so that each attack plays out quickly; the
checks are ordered by events (a connection closed, the request counted cancelled), and the
generous waits only bound a hang.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import socket
import time

import grpc
import pytest
import ray
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc
from router.launch import LocalCluster
from tests.cluster_util import cluster_config, faults, wait_until

pytestmark = pytest.mark.second_ray  # clusters of its own, mostly waiting: conftest's xdist groups

DEADLINE_S = 1.0
HANG_S = 30.0  # only bounds a hang: every wait below ends on an event
MAX_BODY = 4 * (1 << 20) + (64 << 10)  # the largest body at the default router.max_prompt_bytes (1 MiB)
BODY_BUDGET = MAX_BODY  # bytes of bodies in flight: exactly one maximal body


@pytest.fixture(scope="module")
def cluster(ray_instance, llama_dir):
    cfg = cluster_config(llama_dir, router={"http_port": 0, "read_timeout_s": DEADLINE_S,
                                            "write_timeout_s": DEADLINE_S, "max_connections": 16,
                                            "max_concurrent_calls": 4,
                                            "max_body_bytes_in_flight": BODY_BUDGET})
    with LocalCluster(cfg) as c:
        yield c


def _port(cluster) -> int:
    return int(cluster.http_url.rsplit(":", 1)[1].split("/", 1)[0])


def _finished(cluster, reason: str) -> float:
    return cluster.router.metrics.registry.get_sample_value("pdserve_requests_total", {"finish_reason": reason}) or 0


def _idle(cluster) -> bool:
    """No request in flight and every worker's KV pool whole and unused."""
    counts = [ray.get(w.actor.check.remote()) for w in cluster.router.pools.all()]
    return not cluster.router.lives and all(c["used"] == 0 and c["free"] == c["total"] for c in counts)


async def _reply_then_trickle(port: int, head: bytes) -> tuple[bytes, float]:
    """Send `head`, read the reply the server sends before reading the body, send one byte of the
    body, go silent; returns the status line and the seconds from the byte until the server closed."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head)
        status = await asyncio.wait_for(reader.readline(), HANG_S)
        await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HANG_S)
        writer.write(b"x")
        await writer.drain()
        sent = time.monotonic()
        while await asyncio.wait_for(reader.read(65536), HANG_S):  # the reply's body, then EOF
            pass
        return status, time.monotonic() - sent
    finally:
        writer.close()


@pytest.mark.parametrize("head", [
    b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: 999999999\r\n\r\n",
    b"GET /v1/models HTTP/1.1\r\nHost: x\r\nContent-Length: 999999999\r\n\r\n",
    b"GET /nowhere HTTP/1.1\r\nHost: x\r\nContent-Length: 999999999\r\n\r\n",
    b"PUT /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 999999999\r\n\r\n",  # 405
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 999999999\r\n\r\n",  # 413
])
def test_a_reply_sent_before_the_body_leaves_no_connection_held(cluster, head):
    status, closed_after_s = asyncio.run(_reply_then_trickle(_port(cluster), head))
    assert status.startswith(b"HTTP/1.1 ")
    assert closed_after_s < HANG_S  # closed by the server (a hang fails in wait_for above)


def _stop_reading_a_stream(cluster) -> socket.socket:
    """A streaming completion whose client reads the response head, then nothing. Loopback's
    buffers would take a whole tiny-model generation (MBs), so both ends' kernel buffers are made
    small, as on a slow link: 4 KiB to receive, and 4 KiB to send on the connections the HTTP
    port accepts from now on (they inherit it from the listening socket). Then the server's
    buffers fill within the first few hundred tokens."""
    cluster.cluster.http.socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", _port(cluster)))
    body = (b'{"model": "llama", "prompt": [5, 6, 7], "max_tokens": 1900, "stream": true, "ignore_eos": true, '
            b'"temperature": 0}')
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    assert sock.recv(12) == b"HTTP/1.1 200"
    return sock


def test_a_stream_the_client_stops_reading_is_cancelled_and_frees_its_blocks(cluster):
    cancelled, finished = _finished(cluster, "cancelled"), _finished(cluster, "length")
    with faults(cluster, step_delay_s=0.01):  # a token an event (a fast engine sends tokens in bunches)
        sock = _stop_reading_a_stream(cluster)
        _wait_cancelled(cluster, cancelled, sock)
    assert _finished(cluster, "length") == finished  # cancelled, not run to its end


def _wait_cancelled(cluster, cancelled: float, sock: socket.socket) -> None:
    try:
        wait_until(lambda: _finished(cluster, "cancelled") == cancelled + 1, HANG_S, "the request to be cancelled")
        wait_until(lambda: _idle(cluster), HANG_S, "every block to be free")
    finally:
        sock.close()


def test_a_grpc_stream_the_client_stops_reading_ends_deadline_exceeded(cluster):
    cancelled = _finished(cluster, "cancelled")
    # a small flow-control window, so that the server's writes stop being taken within ~100 tokens
    options = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]
    request = pb.GenerateRequest(prompt_token_ids=[5, 6, 7], sampling=pb.SamplingParams(max_tokens=1900,
                                                                                         ignore_eos=True))
    with faults(cluster, step_delay_s=0.01), grpc.insecure_channel(cluster.address, options=options) as channel:
        call = pb_grpc.GenerationStub(channel).Generate(request, timeout=120)
        next(call)  # the stream has begun; now read nothing
        wait_until(lambda: _finished(cluster, "cancelled") == cancelled + 1, HANG_S, "the request to be cancelled")
        wait_until(lambda: _idle(cluster), HANG_S, "every block to be free")
        with pytest.raises(grpc.RpcError) as err:
            for _ in call:
                pass
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "router.write_timeout_s" in err.value.details()


def test_connections_beyond_the_cap_are_closed_and_a_good_client_is_served_after(cluster):
    held = [socket.create_connection(("127.0.0.1", _port(cluster))) for _ in range(16)]
    try:
        extra = socket.create_connection(("127.0.0.1", _port(cluster)))
        extra.settimeout(HANG_S)
        assert extra.recv(1) == b""  # closed as it opened: no slot for it
        extra.close()
    finally:
        for s in held:
            s.close()
    wait_until(lambda: cluster.cluster.http.limits.open == 0, HANG_S, "the held connections to close")
    with socket.create_connection(("127.0.0.1", _port(cluster))) as good:
        good.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert good.recv(12) == b"HTTP/1.1 200"


@pytest.fixture(scope="module")
def tls_cluster(ray_instance, llama_dir, pki):
    """Over TLS, at most 16 connections a door (and the default 1024 calls)."""
    tls = {"cert_file": str(pki / "server.pem"), "key_file": str(pki / "server.key")}
    cfg = cluster_config(llama_dir, router={"http_port": 0, "read_timeout_s": DEADLINE_S, "tls": tls,
                                            "max_connections": 16})
    with LocalCluster(cfg) as c:
        yield c


@pytest.mark.parametrize("door", ["http", "grpc"])
def test_a_tls_handshake_that_never_comes_is_cut_at_the_read_deadline(tls_cluster, door):
    port = _port(tls_cluster) if door == "http" else int(tls_cluster.address.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as silent:  # connects, never says hello
        silent.settimeout(HANG_S)
        started = time.monotonic()
        assert silent.recv(1) == b""  # closed by the server, well before asyncio's 60 s
        assert time.monotonic() - started >= DEADLINE_S * 0.9


def test_scale_is_bounded_by_config(cluster):
    """One coroutine per replica asked, with num_cpus 0 nothing else bounds it: max_pool_replicas does."""
    with grpc.insecure_channel(cluster.address) as channel:
        with pytest.raises(grpc.RpcError) as err:
            pb_grpc.AdminStub(channel).Scale(pb.ScaleRequest(pool="decode", replicas=10**6), timeout=HANG_S)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == ("1000000 replicas asked of the decode pool; at most 64 "
                                   "(router.max_pool_replicas)")
    assert len(cluster.router.pools.live("decode")) == 1


def _reply(sock: socket.socket) -> bytes:
    """One whole HTTP response (head and its Content-Length of body) from `sock`."""
    sock.settimeout(HANG_S)
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.lower().split(b"\r\n") if line.startswith(b"content-length")))
    while len(body) < length:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body


def _head(path: str, length: int) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


def test_bodies_in_flight_are_bounded_before_a_byte_of_them_is_read(cluster):
    bodies = cluster.cluster.http.api.bodies
    with socket.create_connection(("127.0.0.1", _port(cluster))) as big:
        big.sendall(_head("/v1/completions", MAX_BODY - 1000) + b'{"prompt": [')  # then it trickles
        wait_until(lambda: bodies.in_flight == MAX_BODY - 1000, HANG_S, "the big body to be charged")
        with socket.create_connection(("127.0.0.1", _port(cluster))) as second:
            second.sendall(_head("/v1/completions", 2000))  # its head only: refused before its body
            reply = _reply(second)
        assert reply.startswith(b"HTTP/1.1 429") and b"retry-after: 1" in reply.lower()
        assert b"router.max_body_bytes_in_flight" in reply
        with socket.create_connection(("127.0.0.1", _port(cluster))) as small:  # what is left fits
            body = b'{"prompt": [5, 6], "max_tokens": 2}'
            small.sendall(_head("/v1/completions", len(body)) + body)
            small.settimeout(HANG_S)
            assert small.recv(12) == b"HTTP/1.1 200"
    wait_until(lambda: bodies.in_flight == 0, HANG_S, "the big body's charge to be given back")
    assert bodies.peak <= BODY_BUDGET


def test_a_declared_body_over_the_limit_is_413_before_it_is_read(cluster):
    with socket.create_connection(("127.0.0.1", _port(cluster))) as client:
        client.sendall(_head("/v1/chat/completions", MAX_BODY + 1))
        reply = _reply(client)
    assert reply.startswith(b"HTTP/1.1 413")
    assert f"the request body is {MAX_BODY + 1} bytes; at most {MAX_BODY} are allowed".encode() in reply


def test_a_grpc_message_bigger_than_any_request_needs_is_refused_before_it_is_parsed(cluster):
    ids = [300] * 600_000  # 2 bytes each: 1.2 MB, over what a request can need (1 MiB of text + 64 KiB)
    request = pb.GenerateRequest(prompt_token_ids=ids, sampling=pb.SamplingParams(max_tokens=1))
    with grpc.insecure_channel(cluster.address) as channel:
        with pytest.raises(grpc.RpcError) as err:
            list(pb_grpc.GenerationStub(channel).Generate(request, timeout=HANG_S))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    fits = pb.GenerateRequest(prompt_token_ids=[300] * 3000, sampling=pb.SamplingParams(max_tokens=1))
    with grpc.insecure_channel(cluster.address) as channel:
        with pytest.raises(grpc.RpcError) as err:  # within the message limit, over the context: counted first
            list(pb_grpc.GenerationStub(channel).Generate(fits, timeout=HANG_S))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt_token_ids has 3000 tokens; the model's context is" in err.value.details()


def test_a_server_side_failure_names_no_worker_or_address_to_the_client(cluster):
    internal = re.compile(r"\b(prefill|decode)-\d+\b|\b\d{1,3}(\.\d{1,3}){3}\b")
    fresh = [random.Random(f"doors-{i}").sample(range(10, 2000), 40) for i in range(2)]  # nothing cached: KV moves
    request = pb.GenerateRequest(prompt_token_ids=fresh[0], sampling=pb.SamplingParams(max_tokens=4))
    with faults(cluster, fail_steps=100):  # every step fails, naming nobody: the request moves, then gives up
        with grpc.insecure_channel(cluster.address) as channel, pytest.raises(grpc.RpcError) as err:
            list(pb_grpc.GenerationStub(channel).Generate(request, timeout=120))
    with faults(cluster, fail_steps=1, fail_culprit="longest"):
        with socket.create_connection(("127.0.0.1", _port(cluster))) as http:
            body = json.dumps({"prompt": fresh[1], "max_tokens": 4}).encode()
            http.sendall(_head("/v1/completions", len(body)) + body)
            reply = _reply(http).decode()
    details = err.value.details()
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "injected step failure" in details
    assert re.search(r"on a (prefill|decode) worker", details) and not internal.search(details), details
    assert reply.startswith("HTTP/1.1 500") and "injected step failure" in reply
    assert not internal.search(reply.partition("\r\n\r\n")[2]), reply
    wait_until(lambda: _idle(cluster), HANG_S, "every block to be free")


def test_requests_beyond_max_concurrent_calls_get_503_and_lingering_connections_do_not_count(cluster):
    port = _port(cluster)
    lingering = []
    for _ in range(6):  # each answered early (health), its body left unsent: held until the deadline
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: 999999999\r\n\r\n")
        assert _reply(sock).startswith(b"HTTP/1.1 200")
        lingering.append(sock)
    busy = []
    try:
        for _ in range(4):  # four requests in the app, each waiting for the rest of its body
            sock = socket.create_connection(("127.0.0.1", port))
            sock.sendall(_head("/v1/completions", 100) + b'{"prompt": [')
            busy.append(sock)
        wait_until(lambda: cluster.cluster.http.api.bodies.in_flight == 400, HANG_S, "four bodies in flight")
        with socket.create_connection(("127.0.0.1", port)) as fifth:
            fifth.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
            reply = _reply(fifth)
        assert reply.startswith(b"HTTP/1.1 503") and b"router.max_concurrent_calls" in reply
    finally:
        for sock in busy + lingering:
            sock.close()
    wait_until(lambda: cluster.cluster.http.api.bodies.in_flight == 0, HANG_S, "the bodies to be given back")
    with socket.create_connection(("127.0.0.1", port)) as good:
        good.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _reply(good).startswith(b"HTTP/1.1 200")


def test_grpc_connections_beyond_the_cap_are_refused(tls_cluster, pki):
    """16 connections each holding a health Watch (a call in flight: not idle), then a 17th."""
    creds = grpc.ssl_channel_credentials((pki / "ca.pem").read_bytes())
    channels = [grpc.secure_channel(tls_cluster.address, creds, options=[("grpc.use_local_subchannel_pool", 1)])
                for _ in range(17)]
    watches = []
    try:
        for channel in channels[:16]:
            watches.append(health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=HANG_S))
            assert next(watches[-1]).status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as err:
            health_pb2_grpc.HealthStub(channels[16]).Check(health_pb2.HealthCheckRequest(), timeout=HANG_S)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        for watch in watches:
            watch.cancel()
        for channel in channels:
            channel.close()
