"""Callers kept apart on one real cluster (docs/security.md, "Tenants"): the prefix cache is shared
only under equal `cache_salt`s and, with router.auth.isolate_prefix_cache, never across tokens;
request ids are per caller; and with mutual TLS an admin is an admin token or a certificate whose
subject is on router.auth.admin_subjects, also on a front door without token files.
Certificates: conftest's pki (tests/security_util.py)."""

from __future__ import annotations

import random
from pathlib import Path

import grpc
import httpx2
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from client.credentials import Target
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc
from protocol.block_hash import block_hashes, salt_root
from protocol.errors import InvalidRequest
from protocol.sampling import SamplingParams
from router.config.loader import parse_config
from router.config.schema import TLSSection
from router.config.typed_yaml import ConfigError
from router.frontdoor.access import Gate, Need, Verdict, caller_id
from router.frontdoor.grpc_server import RouterServer
from router.frontdoor.guards import Refusals
from router.launch import LocalCluster
from tests.cluster_util import cluster_config, faults, wait_until, whole
from tests.reference import hf_greedy
from tests.security_util import ADMIN, ADMIN_SUBJECT, ROTATED, TRAFFIC, token_files

pytestmark = pytest.mark.usefixtures("ray_instance")
BS = 16


@pytest.fixture(scope="module")
def tls(pki) -> TLSSection:
    return TLSSection(str(pki / "server.pem"), str(pki / "server.key"), str(pki / "ca.pem"))


@pytest.fixture(scope="module")
def cluster(ray_instance, llama_dir, pki, tls, tmp_path_factory):
    """1 + 1 behind mutual TLS and tokens, each token its own prefix cache, admin.pem an admin."""
    traffic, admin = token_files(tmp_path_factory.mktemp("tokens"))
    auth = {"tokens_file": str(traffic), "admin_tokens_file": str(admin), "admin_subjects": [ADMIN_SUBJECT],
            "isolate_prefix_cache": True}
    cfg = cluster_config(llama_dir, router={"http_port": 0, "tls": vars(tls), "auth": auth})
    with LocalCluster(cfg) as c:
        yield c


@pytest.fixture(scope="module")
def certs_only(cluster, tls):
    """A second gRPC front door on the same router with mutual TLS and no token files; status and
    reflection need an admin too (status_access: admin)."""
    gate = Gate(status_access="admin", mutual_tls=True, admin_subjects=(ADMIN_SUBJECT,))

    async def start() -> RouterServer:  # on the router's loop, where grpc.aio serves it
        server = RouterServer(cluster.router, "127.0.0.1", 0, gate, tls, Refusals())
        await server.start()
        return server

    server = cluster.call(start())
    yield server
    cluster.call(server.stop(1.0))


def _target(address: str, pki: Path, token: str | None = None, cert: str = "client") -> Target:
    return Target(address, token, str(pki / "ca.pem"), str(pki / f"{cert}.pem"), str(pki / f"{cert}.key"))


def _stream(target: Target, request: pb.GenerateRequest) -> list[pb.GenerateResponse]:
    channel = target.grpc_channel()
    try:
        return list(pb_grpc.GenerationStub(channel).Generate(request, timeout=60, metadata=target.metadata))
    finally:
        channel.close()


def _call(target: Target, stub, method: str, request, stream: bool = False):
    channel = target.grpc_channel()
    try:
        call = getattr(stub(channel), method)(request, timeout=60, metadata=target.metadata)
        return list(call) if stream else call
    finally:
        channel.close()


def _refused(fn) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        fn()
    return err.value.code(), err.value.details()


def _prompt(seed: int) -> list[int]:
    rng = random.Random(f"test_tenants-{seed}")  # its own prompts: nothing else caches them
    return [rng.randrange(10, 2000) for _ in range(5 * BS + 7)]


def _run(target: Target, prompt: list[int], salt: str = "") -> tuple[list[int], pb.Usage]:
    request = pb.GenerateRequest(prompt_token_ids=prompt, cache_salt=salt,
                                 sampling=pb.SamplingParams(max_tokens=4, ignore_eos=True))
    messages = _stream(target, request)
    return [t for m in messages for t in m.token_ids], messages[-1].usage


def _cached(usage: pb.Usage) -> tuple[int, int]:
    """(prompt tokens the prefill worker's cache held, leading blocks the decode worker held)."""
    return usage.cached_tokens, usage.kv_cached_blocks


def test_a_prefix_is_shared_only_under_the_same_salt(cluster, pki, llama_dir):
    me, prompt = _target(cluster.address, pki, TRAFFIC), _prompt(1)
    expected = hf_greedy(llama_dir, prompt, 4, ignore_eos=True)
    runs = [_run(me, prompt, salt) for salt in ("tenant-a", "tenant-b", "", "tenant-a")]
    assert [tokens for tokens, _ in runs] == [expected] * 4
    assert [_cached(u) for _, u in runs] == [(0, 0), (0, 0), (0, 0), (5 * BS, 5)]
    wait_until(lambda: whole(cluster), 30, "no block held after the salted requests")


def test_isolate_prefix_cache_keeps_tokens_apart_on_both_doors(cluster, pki, llama_dir):
    prompt = _prompt(2)
    traffic, admin = _target(cluster.address, pki, TRAFFIC), _target(cluster.address, pki, ADMIN)
    assert _cached(_run(traffic, prompt)[1]) == (0, 0)
    assert _cached(_run(admin, prompt)[1]) == (0, 0)  # another token: its own cache, though unsalted
    assert _cached(_run(traffic, prompt)[1]) == (5 * BS, 5)
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "cache_salt": "x"}
    with httpx2.Client(verify=_target(cluster.address, pki).ssl_context()) as http:
        def http_cached(token: str) -> int:
            reply = http.post(f"{cluster.http_url}/completions", json=body, timeout=60,
                              headers={"Authorization": f"Bearer {token}"})
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["token_ids"] == hf_greedy(llama_dir, prompt, 4, ignore_eos=True)
            return reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

        assert [http_cached(TRAFFIC), http_cached(ADMIN), http_cached(TRAFFIC)] == [0, 0, 5 * BS]
    wait_until(lambda: whole(cluster), 30, "no block held after the isolated requests")


def test_request_ids_are_per_caller(cluster, pki):
    def request(max_tokens: int) -> pb.GenerateRequest:
        return pb.GenerateRequest(request_id="my-request", prompt_token_ids=[5, 6, 7],
                                  sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True))

    traffic, admin = _target(cluster.address, pki, TRAFFIC), _target(cluster.address, pki, ADMIN)
    channel = traffic.grpc_channel()
    try:
        with faults(cluster, step_delay_s=0.05):
            held = pb_grpc.GenerationStub(channel).Generate(request(500), timeout=60, metadata=traffic.metadata)
            assert next(held).request_id == "my-request"  # in flight under TRAFFIC's id
            assert sum(len(m.token_ids) for m in _stream(admin, request(3))) == 3  # the same id, another caller
            assert _refused(lambda: _stream(traffic, request(3))) == (
                grpc.StatusCode.INVALID_ARGUMENT, "request id 'my-request' is already in flight")
            held.cancel()
    finally:
        channel.close()
    wait_until(lambda: whole(cluster), 30, "no block held after the id test")


def test_an_admin_certificate_administers_beside_tokens(cluster, pki):
    scale = pb.ScaleRequest(pool="decode", replicas=1)
    assert _refused(lambda: _call(_target(cluster.address, pki, TRAFFIC), pb_grpc.AdminStub, "Scale", scale)) == (
        grpc.StatusCode.PERMISSION_DENIED, "this call needs an admin token or an admin client certificate")
    assert _call(_target(cluster.address, pki, TRAFFIC, cert="admin"), pb_grpc.AdminStub, "Scale",
                 scale).replicas == 1


def test_mutual_tls_alone_still_needs_an_admin_identity(certs_only, pki):
    client, admin = _target(certs_only.address, pki), _target(certs_only.address, pki, cert="admin")
    generated = _stream(client, pb.GenerateRequest(prompt_token_ids=[5, 6, 7],
                                                   sampling=pb.SamplingParams(max_tokens=3, ignore_eos=True)))
    assert sum(len(m.token_ids) for m in generated) == 3  # any certificate the CA signed: traffic
    denied = (grpc.StatusCode.PERMISSION_DENIED, "this call needs an admin token or an admin client certificate")
    scale = pb.ScaleRequest(pool="decode", replicas=1)
    assert _refused(lambda: _call(client, pb_grpc.AdminStub, "Scale", scale)) == denied
    assert _refused(lambda: _call(client, pb_grpc.AdminStub, "Status", pb.StatusRequest())) == denied
    listing = iter([reflection_pb2.ServerReflectionRequest(list_services="")])
    assert _refused(lambda: _call(client, reflection_pb2_grpc.ServerReflectionStub, "ServerReflectionInfo",
                                  listing, stream=True)) == denied
    assert _call(admin, pb_grpc.AdminStub, "Scale", scale).replicas == 1
    assert _call(admin, pb_grpc.AdminStub, "Status", pb.StatusRequest()).mode == "disaggregated"


# ---- the rules, without servers ------------------------------------------------------------------
def test_a_salt_changes_every_block_hash_and_no_salt_is_the_shared_root():
    tokens = list(range(3 * BS + 5))
    shared = block_hashes(tokens, BS)
    assert block_hashes(tokens, BS, salt_root("")) == shared
    salted = [block_hashes(tokens, BS, salt_root(s)) for s in ("a", "b", "a")]
    assert salted[0] == salted[2] and len(salted[0]) == 3
    assert not set(salted[0]) & set(salted[1]) and not set(salted[0]) & set(shared)
    with pytest.raises(InvalidRequest, match="cache_salt is 257 characters; at most 256 are allowed"):
        SamplingParams(cache_salt="s" * 257).validate()


def test_an_admin_certificate_without_tokens(tmp_path):
    gate = Gate(status_access="loopback", mutual_tls=True, admin_subjects=("CN=ops",))
    ops, other, local, remote = (lambda: "CN=ops"), (lambda: "CN=app"), (lambda: True), (lambda: False)
    assert gate.check(Need.TRAFFIC, None, remote, other) is Verdict.ALLOW  # the handshake admitted it
    assert gate.check(Need.ADMIN, None, remote, other) is Verdict.DENIED
    assert gate.check(Need.ADMIN, f"Bearer {ADMIN}", remote, other) is Verdict.DENIED  # no token files: no tokens
    assert gate.check(Need.ADMIN, None, remote, ops) is Verdict.ALLOW
    assert gate.check(Need.STATUS, None, remote, other) is Verdict.DENIED
    assert gate.check(Need.STATUS, None, local, other) is Verdict.ALLOW  # status_access: loopback
    tokens = Gate(*map(str, token_files(tmp_path)), mutual_tls=True, admin_subjects=("CN=ops",))
    assert tokens.check(Need.ADMIN, f"Bearer {TRAFFIC}", remote, ops) is Verdict.ALLOW
    assert tokens.check(Need.ADMIN, f"Bearer {TRAFFIC}", remote, other) is Verdict.DENIED
    assert caller_id(f"Bearer {TRAFFIC}", "CN=ops") == caller_id(f"Bearer {TRAFFIC}") != caller_id(f"Bearer {ADMIN}")
    assert TRAFFIC not in caller_id(f"Bearer {TRAFFIC}")
    assert (caller_id(None, "CN=ops"), caller_id(None)) == ("cert:CN=ops", "")


def test_caller_options_need_a_way_to_tell_callers_apart(pki):
    def refused(auth: dict) -> str:
        with pytest.raises(ConfigError) as err:
            parse_config({"router": {"auth": auth}}, base_dir=pki)
        return str(err.value)

    assert "router.auth.admin_subjects: certificate subjects need mutual TLS" in refused(
        {"admin_subjects": ["CN=ops"]})
    assert "router.auth.isolate_prefix_cache: callers are told apart by their token or client certificate" in \
        refused({"isolate_prefix_cache": True})
    assert "router.auth.admin_subjects: expected a list of strings, got [1]" in refused({"admin_subjects": [1]})
    mtls = {"cert_file": "server.pem", "key_file": "server.key", "client_ca_file": "ca.pem"}
    with pytest.raises(ConfigError, match="the HTTP door tells callers apart by token only"):
        parse_config({"router": {"tls": mtls, "http_port": 0, "auth": {"isolate_prefix_cache": True}}}, base_dir=pki)
    assert parse_config({"router": {"tls": mtls, "auth": {"isolate_prefix_cache": True}}}, base_dir=pki)


def test_several_tenants_tokens_isolate_their_caches_by_default(tmp_path):
    traffic, admin = token_files(tmp_path)  # one token each: two callers
    auth = {"tokens_file": str(traffic)}
    assert parse_config({"router": {"auth": auth}}).router.auth.isolate_prefix_cache is False  # one caller
    both = auth | {"admin_tokens_file": str(admin)}
    assert parse_config({"router": {"auth": both}}).router.auth.isolate_prefix_cache is True
    two = tmp_path / "two.txt"
    two.write_text(f"{TRAFFIC}\n{ROTATED}\n")
    assert parse_config({"router": {"auth": {"tokens_file": str(two)}}}).router.auth.isolate_prefix_cache is True
    shared = {"tokens_file": str(two), "isolate_prefix_cache": False}  # said outright: they may share
    assert parse_config({"router": {"auth": shared}}).router.auth.isolate_prefix_cache is False
    assert parse_config({}).router.auth.isolate_prefix_cache is False
