"""The Prometheus scrape port: the registry's WSGI app behind the metrics guard, on its own thread.

One thread accepts and never touches a client: each connection gets its own thread, which does
the TLS handshake (when the port has TLS) and reads the request, every socket operation within
`io_timeout_s`. At most `max_connections` are open at once (one more is closed at once), and the
accepting thread shuts down any connection older than `connection_deadline_s` (`ConnectionLimits`),
so an idle or trickling client holds one slot for a bounded time and never blocks a scrape or
`close()`.
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading
import time
from dataclasses import dataclass, field
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

import prometheus_client

from router.frontdoor.access import Gate, Need, Verdict, is_loopback
from router.frontdoor.guards import Refusals

log = logging.getLogger(__name__)
CLOSE_DEADLINE_S = 5.0
# How often the accepting loop wakes when no one connects: to end connections past their deadline
# and to notice `close()`, which waits for it (socketserver's default, 0.5 s, made every router
# stop half a second longer).
ACCEPT_POLL_S = 0.05


@dataclass(frozen=True)
class ConnectionLimits:
    io_timeout_s: float = 5.0  # the TLS handshake and each read or write of one connection
    connection_deadline_s: float = 30.0  # a connection's whole life, however slowly its client trickles
    max_connections: int = 32


@dataclass(eq=False)
class _Connection:
    sock: socket.socket
    opened: float = field(default_factory=time.monotonic)


class _Connections:
    """The open connections: at most `limit`; each can be shut down from another thread, which
    wakes its own thread out of any read, write or handshake."""

    def __init__(self, limit: int):
        self._limit = limit
        self._lock = threading.Lock()
        self._open: dict[_Connection, threading.Thread | None] = {}
        self._closed = False

    def admit(self, sock: socket.socket) -> _Connection | None:
        """A slot for a new connection; None when all are taken or the port is closing."""
        with self._lock:
            if self._closed or len(self._open) >= self._limit:
                return None
            conn = _Connection(sock)
            self._open[conn] = None
            return conn

    def started(self, conn: _Connection, thread: threading.Thread) -> None:
        with self._lock:
            if conn in self._open:
                self._open[conn] = thread

    def wrap(self, conn: _Connection, tls: ssl.SSLContext) -> None:
        """Swap the plain socket for a TLS one whose handshake is left to the caller."""
        with self._lock:  # a shutdown in between would meet a detached socket
            conn.sock = tls.wrap_socket(conn.sock, server_side=True, do_handshake_on_connect=False)

    def leave(self, conn: _Connection) -> None:
        with self._lock:
            self._open.pop(conn, None)

    def shut_older_than(self, deadline_s: float) -> None:
        cutoff = time.monotonic() - deadline_s
        with self._lock:
            for conn in self._open:
                if conn.opened < cutoff:
                    _shut(conn.sock)

    def shut_all(self) -> list[threading.Thread]:
        """Refuse new connections, shut every open one; their threads, to join."""
        with self._lock:
            self._closed = True
            for conn in self._open:
                _shut(conn.sock)
            return [t for t in self._open.values() if t is not None]


def _shut(sock: socket.socket) -> None:
    """Both directions closed: the connection's thread wakes with an error or an end of stream."""
    try:
        socket.socket.shutdown(sock, socket.SHUT_RDWR)  # the TCP socket, even under TLS
    except OSError:
        pass  # already gone


class _MetricsHTTPServer(WSGIServer):
    """A WSGI server that hands every accepted socket to its own thread at once (TLS included)."""

    def __init__(self, address, handler, tls: ssl.SSLContext | None, limits: ConnectionLimits):
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.tls = tls
        self.limits = limits
        self.connections = _Connections(limits.max_connections)
        super().__init__(address, handler)

    def process_request(self, request, client_address) -> None:
        """On the accepting thread: take a slot or close the connection, never read from it."""
        conn = self.connections.admit(request)
        if conn is None:
            self.shutdown_request(request)
            return
        thread = threading.Thread(target=self._serve, args=(conn, client_address), name="pdserve-metrics-conn",
                                  daemon=True)
        self.connections.started(conn, thread)
        thread.start()

    def _serve(self, conn: _Connection, client_address) -> None:
        """On the connection's thread: handshake, one request, close; any socket error drops only it."""
        try:
            conn.sock.settimeout(self.limits.io_timeout_s)  # the handler keeps it (its `timeout` is None)
            if self.tls is not None:
                self.connections.wrap(conn, self.tls)
                conn.sock.do_handshake()
            self.finish_request(conn.sock, client_address)
        except Exception:  # noqa: BLE001 - one client's failure must not reach the port
            self.handle_error(conn.sock, client_address)
        finally:
            self.connections.leave(conn)
            self.shutdown_request(conn.sock)

    def service_actions(self) -> None:
        """Each turn of the accepting loop: connections past their deadline are shut down."""
        self.connections.shut_older_than(self.limits.connection_deadline_s)

    def handle_error(self, request, client_address) -> None:
        """A client that timed out, reset or failed its handshake is not worth a traceback."""
        log.debug("metrics connection from %s dropped", client_address, exc_info=True)


@dataclass(frozen=True)
class MetricsServer:
    """A running `/metrics` endpoint; `close()` stops it and joins its threads within a deadline."""

    host: str
    port: int
    server: _MetricsHTTPServer
    thread: threading.Thread

    def close(self, deadline_s: float = CLOSE_DEADLINE_S) -> None:
        """Stop accepting, shut every open connection, join the threads; returns within
        `deadline_s` (plus one accept-loop turn) whatever the clients do."""
        until = time.monotonic() + deadline_s
        self.server.shutdown()  # the accepting loop blocks on nothing: it ends within its poll interval
        threads = self.server.connections.shut_all()
        self.server.server_close()
        for thread in [self.thread, *threads]:
            thread.join(timeout=max(0.0, until - time.monotonic()))


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
                         tls: ssl.SSLContext | None = None, limits: ConnectionLimits = ConnectionLimits()) -> MetricsServer:
    """`/metrics` behind the gate, over TLS when `tls` is given, serving on its own thread."""
    server = _MetricsHTTPServer((host, port), _QuietHandler, tls, limits)
    server.set_app(guard_wsgi(prometheus_client.make_wsgi_app(registry), gate, refusals))
    thread = threading.Thread(target=server.serve_forever, args=(ACCEPT_POLL_S,), name="pdserve-metrics", daemon=True)
    thread.start()
    return MetricsServer(host, server.server_port, server, thread)
