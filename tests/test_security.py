"""Security end to end (docs/security.md): tokens, roles and mutual TLS on a real cluster's gRPC,
HTTP and metrics ports, token rotation in process (by SIGHUP to `pdserve serve`, and the CLI over
TLS: tests/test_serve.py), bench as a client, and the safe default of `pdserve serve`. KV channels
only their peer can join: tests/test_kv_channel_security.py.
Certificates: a throw-away CA, server and client certificate made with openssl for each run
(conftest's pki, tests/security_util.py)."""

from __future__ import annotations

import asyncio
import logging
import ssl
from pathlib import Path

import grpc
import httpx2
import openai
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from cli.main import main as pdserve
from client.credentials import Target
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
