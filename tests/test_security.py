"""Security end to end (docs/security.md): tokens, roles and mutual TLS on a real cluster's gRPC,
HTTP and metrics ports, token rotation in process (by SIGHUP to `pdserve serve`, and the CLI over
TLS: tests/test_serve.py), bench as a client, the safe default of `pdserve serve`, and KV channels
only their peer can join (a stranger on the store during a transfer changes nothing).
Certificates: a throw-away CA, server and client certificate made with openssl for each run
(conftest's pki, tests/security_util.py)."""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import httpx2
import openai
import pytest
import torch
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from cli.main import main as pdserve
from client.credentials import Target
from kv_transfer import HandshakeMismatch, KVReceiver, KVSender, KVTransferConfig, KVTransferError
from kv_transfer import sender as kv_sender
from kv_transfer.groups import gloo_group, join_store
from kv_transfer.handshake import new_secret, proof, proves, rendezvous_prefix
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc
from router.config.loader import load_config, parse_config
from router.config.typed_yaml import ConfigError
from router.frontdoor.access import Gate, Need, Verdict, grpc_peer_is_loopback
from router.frontdoor.guards import LOGGED_CHARS, HttpGuard, Refusals
from router.frontdoor.tls import exposure_refusal, open_gate
from router.launch import LocalCluster
from router.observability.metrics_server import guard_wsgi
from tests.cluster_util import cluster_config
from tests.kv_util import CONFIG, make_pool, wait_until
from tests.security_util import ADMIN, ROTATED, TRAFFIC, token_files

GENERATE = pb.GenerateRequest(prompt_token_ids=[5, 6, 7], sampling=pb.SamplingParams(max_tokens=3, ignore_eos=True))


# ---- one cluster with all of it (certificates: conftest's pki) --------------------------------
@pytest.fixture(scope="module")
def cluster(ray_instance, llama_dir, pki, tmp_path_factory):
    """Disaggregated 1 + 1 (the KV channel's secret on the way): mutual TLS, traffic and admin tokens."""
    traffic, admin = token_files(tmp_path_factory.mktemp("tokens"))
    tls = {"cert_file": str(pki / "server.pem"), "key_file": str(pki / "server.key"),
           "client_ca_file": str(pki / "ca.pem")}
    cfg = cluster_config(llama_dir, router={"http_port": 0, "metrics_port": 0, "tls": tls,
                                            "auth": {"tokens_file": str(traffic), "admin_tokens_file": str(admin)}})
    with LocalCluster(cfg) as c:
        c.traffic_file = traffic
        yield c


def _target(cluster, pki: Path, token: str | None = None, cert: bool = True) -> Target:
    mine = (str(pki / "client.pem"), str(pki / "client.key")) if cert else (None, None)
    return Target(cluster.address, token, str(pki / "ca.pem"), *mine)


def _rpc(target: Target, stub, method: str, request, stream: bool = False):
    channel = target.grpc_channel()
    try:
        call = getattr(stub(channel), method)(request, timeout=60, metadata=target.metadata)
        return list(call) if stream else call
    finally:
        channel.close()


def _generate(target: Target) -> list[int]:
    return [t for m in _rpc(target, pb_grpc.GenerationStub, "Generate", GENERATE, stream=True) for t in m.token_ids]


def _refused(fn, *args) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        fn(*args)
    return err.value.code(), err.value.details()


def _client_tls(pki: Path, cert: bool = True) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(pki / "ca.pem"))
    if cert:
        context.load_cert_chain(str(pki / "client.pem"), str(pki / "client.key"))
    return context


# ---- the front doors ---------------------------------------------------------------------------
def test_grpc_traffic_and_admin_tokens(cluster, pki, caplog):
    caplog.set_level(logging.INFO)
    assert len(_generate(_target(cluster, pki, TRAFFIC))) == 3
    assert len(_generate(_target(cluster, pki, ADMIN))) == 3  # an admin token serves traffic too
    for token in (None, "w" * 24, TRAFFIC[:-1]):  # none, a wrong one, a prefix of a good one
        assert _refused(_generate, _target(cluster, pki, token)) == (
            grpc.StatusCode.UNAUTHENTICATED, "missing or invalid token")
    scale = pb.ScaleRequest(pool="decode", replicas=1)
    assert _refused(lambda: _rpc(_target(cluster, pki, TRAFFIC), pb_grpc.AdminStub, "Scale", scale)) == (
        grpc.StatusCode.PERMISSION_DENIED, "this call needs an admin token or an admin client certificate")
    assert _refused(lambda: _rpc(_target(cluster, pki), pb_grpc.AdminStub, "Scale", scale))[0] == \
        grpc.StatusCode.UNAUTHENTICATED
    assert _rpc(_target(cluster, pki, ADMIN), pb_grpc.AdminStub, "Scale", scale).replicas == 1
    # from loopback (status_access: loopback) status, health and reflection need no token
    anonymous = _target(cluster, pki)
    assert _rpc(anonymous, pb_grpc.AdminStub, "Status", pb.StatusRequest()).mode == "disaggregated"
    health = _rpc(anonymous, health_pb2_grpc.HealthStub, "Check", health_pb2.HealthCheckRequest())
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    listed = _rpc(anonymous, reflection_pb2_grpc.ServerReflectionStub, "ServerReflectionInfo",
                  iter([reflection_pb2.ServerReflectionRequest(list_services="")]), stream=True)
    assert "pdserve.v1.Admin" in {s.name for s in listed[0].list_services_response.service}
    assert "auth: refused gRPC /pdserve.v1.Generation/Generate" in caplog.text
    assert not any(t in caplog.text for t in (TRAFFIC, ADMIN, TRAFFIC[:-1]))  # never a token in a log line


def test_http_tokens_the_way_the_openai_sdk_sends_them(cluster, pki):
    def client(api_key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=cluster.http_url, api_key=api_key, max_retries=0, timeout=60,
                             http_client=openai.DefaultHttpx2Client(verify=_client_tls(pki)))

    assert cluster.http_url.startswith("https://")
    with client(TRAFFIC) as c:
        done = c.completions.create(model="llama", prompt=[5, 6, 7], max_tokens=3, extra_body={"ignore_eos": True})
        assert done.usage.completion_tokens == 3
    with client("w" * 24) as c, pytest.raises(openai.AuthenticationError) as err:
        c.models.list()
    assert err.value.status_code == 401
    with httpx2.Client(verify=_client_tls(pki)) as http:
        bare = http.get(f"{cluster.http_url}/models")  # no Authorization header at all
        assert bare.status_code == 401 and bare.headers["www-authenticate"] == "Bearer"
        assert bare.json()["error"] == {"message": "missing or invalid token", "type": "invalid_request_error",
                                        "param": None, "code": "invalid_api_key"}
        assert http.get(cluster.http_url.removesuffix("/v1") + "/health").status_code == 200  # load balancers
        metrics = http.get(f"https://127.0.0.1:{cluster.cluster.metrics_port}/metrics")  # loopback: no token
        assert metrics.status_code == 200 and "pdserve_ttft_seconds" in metrics.text


def test_a_call_with_two_authorization_values_is_refused_on_both_doors(cluster, pki):
    # the gate would check one value while the caller's namespace (request ids, cache salt) came from the other
    channel = _target(cluster, pki).grpc_channel()
    try:
        two = (("authorization", f"Bearer {TRAFFIC}"), ("authorization", f"Bearer {ADMIN}"))
        call = pb_grpc.GenerationStub(channel).Generate(GENERATE, timeout=60, metadata=two)
        assert _refused(list, call) == (grpc.StatusCode.UNAUTHENTICATED,
                                        "more than one authorization value: send exactly one")
    finally:
        channel.close()
    with httpx2.Client(verify=_client_tls(pki)) as http:
        headers = [("Authorization", f"Bearer {TRAFFIC}"), ("Authorization", "Bearer w")]
        refused = http.post(f"{cluster.http_url}/completions", json={"prompt": [5]}, headers=headers)
        assert refused.status_code == 401
        assert refused.json()["error"]["message"] == "more than one authorization value: send exactly one"


def test_mutual_tls_refuses_a_client_without_a_certificate_and_plaintext(cluster, pki):
    for target in (_target(cluster, pki, TRAFFIC, cert=False), Target(cluster.address, TRAFFIC)):
        assert _refused(_generate, target)[0] == grpc.StatusCode.UNAVAILABLE
    with httpx2.Client(verify=_client_tls(pki, cert=False)) as http, pytest.raises(httpx2.TransportError):
        http.get(f"{cluster.http_url}/models", headers={"Authorization": f"Bearer {TRAFFIC}"})
    with httpx2.Client() as http, pytest.raises(httpx2.TransportError):
        http.get(cluster.http_url.replace("https://", "http://") + "/models")


def test_bench_over_tls_with_a_token(cluster, pki, tmp_path, capsys):
    creds = ["--token", TRAFFIC, "--ca-file", str(pki / "ca.pem"), "--cert-file", str(pki / "client.pem"),
             "--key-file", str(pki / "client.key")]
    run = ["--preset", "steady", "--num-requests", "2", "--rate", "20", "--input-len", "8", "--output-len", "2",
           "--no-progress", "--out", str(tmp_path)]
    assert pdserve(["bench", "--router", cluster.address, *creds, *run]) == 0
    assert pdserve(["bench", "--endpoint", f"openai:{cluster.http_url}", *creds, *run]) == 0
    out = capsys.readouterr().out
    assert "== router: 2 requests, 0 failed" in out and "== endpoint: 2 requests, 0 failed" in out


def test_a_rotated_token_is_refused_after_reload(cluster, pki):
    before = cluster.traffic_file.read_text()
    try:
        cluster.traffic_file.write_text(f"{ROTATED}\n")
        assert cluster.reload_tokens()
        assert _refused(lambda: _generate(_target(cluster, pki, TRAFFIC)))[0] == grpc.StatusCode.UNAUTHENTICATED
        assert len(_generate(_target(cluster, pki, ROTATED))) == 3
        cluster.traffic_file.write_text("# emptied by mistake\n")
        assert not cluster.reload_tokens()  # a file without tokens: the ones in use stay
        assert len(_generate(_target(cluster, pki, ROTATED))) == 3
    finally:
        cluster.traffic_file.write_text(before)
        cluster.reload_tokens()


# ---- the rules, without servers ------------------------------------------------------------------
def test_gate_decisions(tmp_path):
    gate = Gate(*map(str, token_files(tmp_path)))
    local, remote = (lambda: True), (lambda: False)
    for need in (Need.TRAFFIC, Need.ADMIN, Need.STATUS):
        assert gate.check(need, None, remote) is Verdict.UNAUTHENTICATED
        assert gate.check(need, f"Bearer {TRAFFIC}x", remote) is Verdict.UNAUTHENTICATED
        assert gate.check(need, f"bearer {ADMIN}", remote) is Verdict.ALLOW  # the scheme is case-insensitive
    assert gate.check(Need.TRAFFIC, f"Bearer {TRAFFIC}") is Verdict.ALLOW
    assert gate.check(Need.ADMIN, f"Bearer {TRAFFIC}") is Verdict.DENIED
    assert gate.check(Need.STATUS, f"Bearer {TRAFFIC}", remote) is Verdict.DENIED  # status_access: loopback
    assert gate.check(Need.STATUS, None, local) is Verdict.ALLOW
    assert gate.check(Need.OPEN, None, remote) is Verdict.ALLOW
    assert gate.check(Need.TRAFFIC, TRAFFIC) is Verdict.UNAUTHENTICATED  # no scheme: not a bearer token
    for access, traffic_verdict in (("admin", Verdict.DENIED), ("traffic", Verdict.ALLOW)):
        strict = Gate(gate.files[0], gate.files[1], access)
        assert strict.check(Need.STATUS, None, local) is Verdict.UNAUTHENTICATED
        assert strict.check(Need.STATUS, f"Bearer {TRAFFIC}", local) is traffic_verdict
    assert Gate().check(Need.ADMIN, None) is Verdict.ALLOW  # no token files: no gate
    assert [grpc_peer_is_loopback(p) for p in ("ipv4:127.0.0.1:5", "ipv6:[::1]:5", "ipv6:%5B::1%5D:5",
                                               "ipv4:10.1.2.3:5", "unix:/tmp/s")] == [True, True, True, False, False]


def test_metrics_need_an_admin_token_from_elsewhere(tmp_path):
    app = guard_wsgi(lambda environ, start: (start("200 OK", []), [b"metrics"])[1],
                     Gate(*map(str, token_files(tmp_path))), Refusals())
    statuses = []

    def get(peer: str, token: str | None = None) -> str:
        environ = {"REMOTE_ADDR": peer, "PATH_INFO": "/metrics"} | ({"HTTP_AUTHORIZATION": f"Bearer {token}"}
                                                                     if token else {})
        app(environ, lambda status, headers: statuses.append(status))
        return statuses[-1]

    assert [get("10.0.0.9"), get("10.0.0.9", TRAFFIC), get("10.0.0.9", ADMIN), get("127.0.0.1")] == [
        "401 Unauthorized", "403 Forbidden", "200 OK", "200 OK"]


def test_a_refused_path_is_logged_escaped_on_one_line(tmp_path, caplog):
    """uvicorn hands the app the path percent-decoded: %0A is a newline that would forge a log line."""
    async def app(scope, receive, send):
        raise AssertionError("a refused request reached the app")

    guard = HttpGuard(app, Gate(*map(str, token_files(tmp_path))), Refusals())
    head = "/v1/models\n2026-01-01 WARNING auth: refused nothing\x1b[2J\u202e"
    forged = head + "x" * 300
    scope = {"type": "http", "path": forged, "headers": [], "client": ("10.0.0.9", 5)}
    sent = []

    async def send(message):
        sent.append(message)
    with caplog.at_level(logging.WARNING, logger="router.frontdoor.guards"):
        asyncio.run(guard(scope, None, send))
    assert sent[0]["status"] == 401
    [line] = [r.getMessage() for r in caplog.records]
    assert line == ("auth: refused HTTP /v1/models\\n2026-01-01 WARNING auth: refused nothing\\x1b[2J\\u202e"
                    + "x" * (LOGGED_CHARS - len(head)) + "... from 10.0.0.9:5: missing or invalid token")


@pytest.mark.parametrize("content, message", [
    ("short\n", "line 1: a token is at least 16 printable ASCII characters without spaces"),
    ("# nothing\n\n", "no tokens (one per line)"),
    ("ok-token-0123456789\nwith a space inside it\n", "line 2: a token is at least 16"),
])
def test_token_files_are_checked_at_load_and_never_echoed(tmp_path, content, message):
    (tmp_path / "tokens.txt").write_text(content)
    (tmp_path / "cluster.yaml").write_text(yaml.safe_dump({"router": {"auth": {"tokens_file": "tokens.txt"}}}))
    with pytest.raises(ConfigError) as err:
        load_config(tmp_path / "cluster.yaml")  # relative to the config file, not the cwd
    assert f"router.auth.tokens_file: {tmp_path}/tokens.txt: {message}" in str(err.value)
    assert all(line.strip() not in str(err.value) for line in content.splitlines() if line.strip())


def test_tls_files_are_checked_at_load(pki):
    def refused(tls: dict) -> str:
        with pytest.raises(ConfigError) as err:
            parse_config({"router": {"tls": tls}}, base_dir=pki)
        return str(err.value)

    assert "router.tls.key_file: TLS needs both cert_file and key_file" in refused({"cert_file": "server.pem"})
    assert "router.tls.cert_file: not a PEM certificate chain whose key is router.tls.key_file" in refused(
        {"cert_file": "server.pem", "key_file": "client.key"})
    assert "router.tls.client_ca_file: mutual TLS needs cert_file" in refused({"client_ca_file": "ca.pem"})
    assert f"router.tls.client_ca_file: {pki}/absent.pem: cannot read" in refused(
        {"cert_file": "server.pem", "key_file": "server.key", "client_ca_file": "absent.pem"})


def test_no_open_listener_beyond_loopback_without_insecure(llama_dir, tmp_path, capsys, caplog, pki):
    wide = cluster_config(llama_dir, router={"host": "0.0.0.0"})
    assert exposure_refusal(cluster_config(llama_dir)) is None
    assert "router.host 0.0.0.0 listens beyond loopback without authentication" in exposure_refusal(wide)
    with pytest.raises(ConfigError, match="or pass --insecure"):
        open_gate(wide, insecure=False)  # what LocalCluster and `pdserve serve` run before listening
    open_gate(wide, insecure=True)
    assert "serving it anyway (--insecure)" in caplog.text
    mtls = {"cert_file": str(pki / "server.pem"), "key_file": str(pki / "server.key"), "client_ca_file": str(pki / "ca.pem")}
    assert exposure_refusal(cluster_config(llama_dir, router={"host": "0.0.0.0", "tls": mtls})) is None
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump({"model": {"path": llama_dir}, "router": {"host": "0.0.0.0"}}))
    assert pdserve(["serve", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "without authentication" in err and "--insecure" in err


# ---- KV channels -----------------------------------------------------------------------------------
class _Owner:
    def __init__(self, reserved: dict[str, list[int]], resolve_delay_s: float = 0.0):
        self.reserved, self.resolve_delay_s, self.completed = reserved, resolve_delay_s, []
        self.gate: threading.Event | None = None  # when set: resolve waits for it instead

    def resolve(self, request_id: str, num_blocks: int, first_block: int = 0) -> list[int] | None:
        if self.gate is not None:
            self.gate.wait(60)
        else:
            time.sleep(self.resolve_delay_s)
        return self.reserved.get(request_id)

    def complete(self, request_id: str, blocks: list[int], error) -> None:
        self.completed.append((request_id, blocks, error))


@pytest.fixture
def pair(request):
    """(owner, src, dst, receiver, sender): 20 reserved blocks, a 1 s resolve (a transfer stays in
    flight); the channel's config is CONFIG unless the test is parametrized with another."""
    config = getattr(request, "param", CONFIG)
    owner = _Owner({"r": list(range(20, 40))}, resolve_delay_s=1.0)
    src, dst = make_pool(64, torch.float32, seed=0), make_pool(64, torch.float32)
    receiver = KVReceiver(dst, "127.0.0.1", config, owner.resolve, owner.complete)
    sender = KVSender(src, config)
    yield owner, src, dst, receiver, sender
    sender.shutdown()
    receiver.shutdown()


def test_handshake_proofs():
    secret, other, nonce = new_secret(), new_secret(), os.urandom(16)
    assert proves(secret, b"sender", nonce, proof(secret, b"sender", nonce))
    assert not proves(secret, b"sender", nonce, proof(other, b"sender", nonce))
    assert not proves(secret, b"receiver", nonce, proof(secret, b"sender", nonce))  # a Hello's proof is no Verdict's
    assert not proves(secret, b"sender", os.urandom(16), proof(secret, b"sender", nonce))
    assert not any(proves(secret, b"sender", nonce, bad) for bad in (None, 7, "", secret.hex()))
    assert rendezvous_prefix(secret) != rendezvous_prefix(other) and secret.hex() not in rendezvous_prefix(secret)


def test_a_stranger_who_joins_first_does_not_take_the_channel(pair):
    owner, src, dst, receiver, sender = pair
    host, port, secret = receiver.open_channel("p")
    store = join_store(host, port, 2.0)
    store.set("sender_joined", "1")  # what a sender without the secret would write
    failed = []
    thread = threading.Thread(target=lambda: _try(failed, lambda: gloo_group(store, 1, "127.0.0.1", 2.0)))
    thread.start()
    wrong = KVSender(src, KVTransferConfig(timeout_s=1.5, heartbeat_s=0.5, staging_bytes=64 << 10))
    with pytest.raises(KVTransferError):  # another secret: another rendezvous, nobody there
        wrong.connect("d", host, port, new_secret())
    wrong.shutdown()
    thread.join()
    assert failed, "a stranger built a gloo group with the receiver"
    sender.connect("d", host, port, secret)  # the peer still gets the channel it was sent to
    assert sender.send("d", "r", list(range(20))).result(20).dst_block_ids == list(range(20, 40))
    assert torch.equal(dst[20:40], src[:20])


def _try(failures: list, fn) -> None:
    try:
        fn()
    except (RuntimeError, ValueError) as e:
        failures.append(e)


def test_a_stranger_without_the_secret_is_refused_and_a_running_transfer_goes_on(pair, monkeypatch, caplog):
    owner, src, dst, receiver, sender = pair
    sender.connect("d", *receiver.open_channel("p"))
    running = sender.send("d", "r", list(range(20)))  # in flight for the next second
    host, port, secret = receiver.open_channel("q")
    # a stranger that won the race to the rendezvous keys (it listed the store's keys): it has the
    # prefix, not the secret; the Hello's proof gives it away before anything else is read
    monkeypatch.setattr(kv_sender, "rendezvous_prefix", lambda _: rendezvous_prefix(secret))
    stranger = KVSender(make_pool(64, torch.float32, seed=9), CONFIG)
    with pytest.raises(HandshakeMismatch, match="refused by the receiver: not authenticated"):
        stranger.connect("d", host, port, new_secret())
    stranger.shutdown()
    wait_until(lambda: "did not prove the channel secret" in caplog.text, 5, "the refusal in the log")
    assert running.result(20).dst_block_ids == list(range(20, 40))
    assert torch.equal(dst[20:40], src[:20])
    assert [(r, b, e) for r, b, e in owner.completed] == [("r", list(range(20, 40)), None)]
    wait_until(lambda: receiver.num_channels == 1, 5, "the refused rendezvous to close")


STRANGER = """
import socket, sys
from datetime import timedelta
import torch, torch.distributed as dist
host, port = sys.argv[1], int(sys.argv[2])
store = dist.TCPStore(host, port, None, False, timedelta(seconds=3))
print("joined", flush=True)
sys.stdin.readline()
keys = store.list_keys()
for key in keys:  # spoil every key but the receiver's own gloo address
    if not key.endswith("/0/0"):
        store.set(key, b"garbage")
store.set("sender_joined", "1")
for prefix in {key.split("/")[0] for key in keys if "/" in key}:  # then join its gloo pair as rank 1
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timedelta(seconds=2)
    options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    try:
        group = dist.ProcessGroupGloo(dist.PrefixStore("control/", dist.PrefixStore(prefix, store)), 1, 2, options)
        for tag in (1, 2, 3, 4, 5):  # every tag the channel uses, junk frames
            group.send([torch.full((512,), 7, dtype=torch.uint8)], 0, tag).wait(timedelta(seconds=1))
    except RuntimeError:
        pass
with socket.create_connection((host, port)) as raw:
    raw.sendall(b"\\xff" * 4096)
print("done", flush=True)
"""


PATIENT = KVTransferConfig(timeout_s=30.0, heartbeat_s=0.5, staging_bytes=64 << 10)


@pytest.mark.parametrize("pair", [PATIENT], indirect=True, ids=["30s-timeout"])
def test_a_stranger_process_on_the_store_during_a_transfer_changes_nothing(pair):
    """The transfer's blocks are resolved only once the stranger has done all its mischief, so
    every step of it happens while the transfer is in flight; then the payload lands at once
    (a stall would wait for the channel's 30 s timeout)."""
    owner, src, dst, receiver, sender = pair
    owner.gate = threading.Event()
    host, port, secret = receiver.open_channel("p")
    sender.connect("d", host, port, secret)
    stranger = subprocess.Popen([sys.executable, "-c", STRANGER, host, str(port)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert stranger.stdout.readline() == "joined\n"
        running = sender.send("d", "r", list(range(20)))  # held at its resolve until the gate opens
        stranger.stdin.write("go\n")
        stranger.stdin.flush()
        assert stranger.communicate(timeout=30)[0] == "done\n"
        assert not running.done(), "the transfer ended before the stranger was done"
        opened = time.monotonic()
        owner.gate.set()
        assert running.result(20).dst_block_ids == list(range(20, 40))
        assert time.monotonic() - opened < PATIENT.timeout_s / 6, "the transfer stalled"
    finally:
        stranger.kill()
    owner.gate = None
    assert torch.equal(dst[20:40], src[:20])
    owner.resolve_delay_s = 0.0
    dst[20:40] = 0
    assert sender.send("d", "r", list(range(20, 40))).result(10).dst_block_ids == list(range(20, 40))
    assert torch.equal(dst[20:40], src[20:40])
    assert [e for _, _, e in owner.completed] == [None, None] and receiver.num_channels == 1
