"""The Prometheus scrape port: the registry's WSGI app behind the metrics guard, on its own thread."""

from __future__ import annotations

import socket
import threading
from dataclasses import dataclass
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import prometheus_client

from router.frontdoor.access import Gate, Need, Verdict, is_loopback
from router.frontdoor.guards import Refusals


@dataclass(frozen=True)
class MetricsServer:
    """A running `/metrics` endpoint; `close()` stops it and joins its thread."""

    host: str
    port: int
    server: WSGIServer
    thread: threading.Thread

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


def guard_wsgi(app, gate: Gate, refusals: Refusals):
    """/metrics behind the gate as a STATUS read."""
    def guarded(environ, start_response):
        peer = environ.get("REMOTE_ADDR", "")
        verdict = gate.check(Need.STATUS, environ.get("HTTP_AUTHORIZATION"), lambda: is_loopback(peer))
        if verdict is Verdict.ALLOW:
            return app(environ, start_response)
        refusals.note("metrics", environ.get("PATH_INFO", ""), peer, verdict)
        status = "401 Unauthorized" if verdict is Verdict.UNAUTHENTICATED else "403 Forbidden"
        start_response(status, [("Content-Type", "text/plain"), ("WWW-Authenticate", "Bearer")])
        return [verdict.value.encode() + b"\n"]
    return guarded


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args) -> None:  # noqa: A002 (the base class's name)
        """Scrapes are not worth a line each."""


def start_metrics_server(registry, host: str, port: int, gate: Gate, refusals: Refusals,
                         tls=None) -> MetricsServer:
    """`/metrics` behind the gate, over TLS when `tls` (an ssl.SSLContext) is given."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    server_class = type("MetricsHTTPServer", (ThreadingMixIn, WSGIServer),
                        {"address_family": family, "daemon_threads": True})
    app = guard_wsgi(prometheus_client.make_wsgi_app(registry), gate, refusals)
    server = make_server(host, port, app, server_class=server_class, handler_class=_QuietHandler)
    if tls is not None:  # the handshake runs at accept; one that fails drops only that connection
        server.socket = tls.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, name="pdserve-metrics", daemon=True)
    thread.start()
    return MetricsServer(host, server.server_port, server, thread)
