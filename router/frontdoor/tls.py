"""The router's listeners, secured as the config says: TLS material and the safe-default rule.

Every front-door listener (gRPC `router.port`, HTTP `router.http_port`, Prometheus
`router.metrics_port`) binds `router.host` and gets the same TLS (`router.tls`) and the same
token gate (router/frontdoor/access.py). The rule (`exposure_refusal`): a router that listens beyond loopback
needs authentication, tokens or mutual TLS, unless its owner says --insecure; tokens without TLS
beyond loopback are allowed (a TLS-terminating proxy in front) but warned about.
"""

from __future__ import annotations

import logging
import ssl
from pathlib import Path

import grpc

from router.config.schema import ClusterConfig, TLSSection
from router.config.typed_yaml import ConfigError
from router.frontdoor.access import Gate, TokenFileError, is_loopback

log = logging.getLogger(__name__)


def listens_beyond_loopback(host: str) -> bool:
    return not (host == "localhost" or is_loopback(host))


def exposure_refusal(cfg: ClusterConfig) -> str | None:
    """Why this config must not start without --insecure; None when it may."""
    r = cfg.router
    if not listens_beyond_loopback(r.host) or r.auth.enabled or r.tls.client_ca_file is not None:
        return None
    return (f"router.host {r.host} listens beyond loopback without authentication: set router.auth.tokens_file "
            "(or router.tls.client_ca_file for mutual TLS), or bind 127.0.0.1")


def open_gate(cfg: ClusterConfig, insecure: bool) -> Gate:
    """The token gate of a router about to listen; ConfigError when the config breaks the rule."""
    refusal = exposure_refusal(cfg)
    if refusal is not None and not insecure:
        raise ConfigError(f"{refusal}; or pass --insecure to serve it open anyway")
    for warning in (refusal and f"{refusal}: serving it anyway (--insecure)", plaintext_warning(cfg)):
        if warning:
            log.warning("%s", warning)
    try:
        return Gate.from_config(cfg.router)
    except TokenFileError as e:  # checked at load; changed since
        raise ConfigError(f"router.auth: {e}") from None


def plaintext_warning(cfg: ClusterConfig) -> str | None:
    r = cfg.router
    if listens_beyond_loopback(r.host) and r.auth.enabled and not r.tls.enabled:
        return (f"router.host {r.host}: tokens travel in plaintext beyond loopback; set router.tls, or keep "
                "this port reachable only by a TLS-terminating proxy (docs/security.md)")
    return None


def describe(cfg: ClusterConfig) -> str:
    """For the ready line: "TLS, mutual TLS, tokens" or "no TLS, no tokens"."""
    r = cfg.router
    parts = ["mutual TLS" if r.tls.client_ca_file else "TLS" if r.tls.enabled else "no TLS",
             "tokens" if r.auth.enabled else "no tokens"]
    return ", ".join(parts)


def server_ssl_context(tls: TLSSection) -> ssl.SSLContext:
    """For the metrics port (the HTTP port's uvicorn builds its own from the same files)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(tls.cert_file, tls.key_file)
    if tls.client_ca_file is not None:
        context.load_verify_locations(tls.client_ca_file)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def grpc_server_credentials(tls: TLSSection) -> grpc.ServerCredentials:
    ca = Path(tls.client_ca_file).read_bytes() if tls.client_ca_file else None
    pair = (Path(tls.key_file).read_bytes(), Path(tls.cert_file).read_bytes())
    return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)


def uvicorn_tls(tls: TLSSection) -> dict:
    """uvicorn.Config keywords for TLS (none when off)."""
    if not tls.enabled:
        return {}
    return {"ssl_certfile": tls.cert_file, "ssl_keyfile": tls.key_file, "ssl_ca_certs": tls.client_ca_file,
            "ssl_cert_reqs": ssl.CERT_REQUIRED if tls.client_ca_file else ssl.CERT_NONE}
