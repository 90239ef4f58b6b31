"""The HTTP door's connections: uvicorn's h11 protocol with the deadlines and the cap uvicorn lacks.

Every connection, whatever it was answered, ends within a deadline of its last progress:
- its request head (request line and headers) must be complete within `read_timeout_s` of the
  connection's start or of the head's first byte (a client sending nothing, or a header a byte
  at a time, would otherwise hold its slot for ever; between requests on a keep-alive
  connection uvicorn's own idle timeout applies);
- a response sent before the request's body was read (401, /health, 404, 408, 413, ...) leaves
  the rest of the body `read_timeout_s` to arrive, counted from the response, not re-armed by
  each byte (nginx's lingering_time): one byte now and then no longer holds the slot;
- a response the client stops reading: once the transport's buffer is full, the client must
  take some of it within `write_timeout_s` (nginx's send_timeout), else the connection is
  aborted, which ends the request (its generator closes, its blocks are freed).
At most `max_connections` connections are open at once, at most `max_per_address` of them from one
client address (nginx's limit_conn); one more is closed as it opens; at most
`max_concurrent_calls` requests are in the app at once (`CallLimit`: 503 beyond). With TLS the
handshake must finish within `read_timeout_s` (asyncio's default is 60 s).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import functools

import h11
import uvicorn
from starlette.responses import JSONResponse
from uvicorn.protocols.http.h11_impl import H11Protocol


@dataclasses.dataclass
class ConnectionLimits:
    """One server's limits and its count of open connections (shared by all its connections)."""

    read_timeout_s: float
    write_timeout_s: float
    max_connections: int
    max_per_address: int
    open: int = 0
    refused: int = 0  # connections closed at once because `max_connections` were open
    by_address: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    refused_by_address: int = 0  # closed at once because their address had `max_per_address` open

    def admit(self, address: str) -> bool:
        """Count a connection from `address` in, unless a limit is reached (then count the refusal)."""
        if self.open >= self.max_connections:
            self.refused += 1
            return False
        if self.by_address[address] >= self.max_per_address:
            self.refused_by_address += 1
            return False
        self.open += 1
        self.by_address[address] += 1
        return True

    def release(self, address: str) -> None:
        self.open -= 1
        self.by_address[address] -= 1
        if not self.by_address[address]:
            del self.by_address[address]


class DeadlineProtocol(H11Protocol):
    limits: ConnectionLimits  # set by `with_limits`

    def connection_made(self, transport) -> None:
        self._read_timer: asyncio.TimerHandle | None = None
        self._write_timer: asyncio.TimerHandle | None = None
        self._address = _address(transport)
        self._counted = self.limits.admit(self._address)
        if not self._counted:
            transport.abort()
            return
        super().connection_made(transport)
        self._arm_read()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.transport.is_closing():
            return
        if self.conn.their_state is h11.IDLE:
            self._arm_read()  # (part of) a head is waiting: its deadline runs from its first byte
        elif not self._body_left_after_response():
            self._disarm_read()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._body_left_after_response() and not self.transport.is_closing():
            self._disarm_read()
            self._arm_read()  # the rest of the body, unread, from the response on

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_timer is None:
            self._write_timer = self.loop.call_later(self.limits.write_timeout_s, self._write_overdue)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._cancel_write_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._counted:
            return  # refused in connection_made: uvicorn never saw it
        self.limits.release(self._address)
        self._disarm_read()
        self._cancel_write_timer()
        super().connection_lost(exc)

    def _body_left_after_response(self) -> bool:
        """A response is complete while the client has not finished sending its request's body."""
        return (self.cycle is not None and self.cycle.response_complete
                and self.conn.their_state is h11.SEND_BODY)

    def _arm_read(self) -> None:
        if self._read_timer is None:
            self._read_timer = self.loop.call_later(self.limits.read_timeout_s, self._read_overdue)

    def _disarm_read(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _cancel_write_timer(self) -> None:
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def _read_overdue(self) -> None:
        self._read_timer = None
        waiting = self.conn.their_state is h11.IDLE or self._body_left_after_response()
        if waiting and not self.transport.is_closing():
            self.transport.close()

    def _write_overdue(self) -> None:
        """The client took nothing for write_timeout_s: abort (a close would wait for the buffer)."""
        self._write_timer = None
        self.transport.abort()

    @classmethod
    def with_limits(cls, limits: ConnectionLimits) -> type[DeadlineProtocol]:
        return type(cls.__name__, (cls,), {"limits": limits})


def _address(transport) -> str:
    """The client's address without its port ("" for a socket without one, e.g. a Unix socket)."""
    peer = transport.get_extra_info("peername")
    return str(peer[0]) if isinstance(peer, tuple) and peer else ""


class CallLimit:
    """ASGI middleware: at most `max_calls` HTTP requests in the app at once; one more gets 503 at
    once. It counts requests, not connections (uvicorn's limit_concurrency counts every open
    connection, so connections lingering after an early reply would refuse good requests)."""

    def __init__(self, app, max_calls: int):
        self.app, self.max_calls, self.calls = app, max_calls, 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.calls >= self.max_calls:
            return await _busy(self.calls)(scope, receive, send)
        self.calls += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.calls -= 1


def _busy(calls: int) -> JSONResponse:
    message = f"the server is already handling {calls} requests (router.max_concurrent_calls); retry later"
    body = {"error": {"message": message, "type": "server_error", "param": None, "code": "unavailable"}}
    return JSONResponse(body, 503, headers={"Retry-After": "1"})


class Server(uvicorn.Server):
    """uvicorn without its SIGINT/SIGTERM handlers (whoever owns the process keeps them), and with
    a TLS handshake deadline of `handshake_timeout_s` on its listening sockets."""

    def __init__(self, config: uvicorn.Config, handshake_timeout_s: float):
        super().__init__(config)
        self.handshake_timeout_s = handshake_timeout_s

    def capture_signals(self):
        return contextlib.nullcontext()

    async def startup(self, sockets=None) -> None:
        """uvicorn's startup, its `loop.create_server` given the handshake deadline (uvicorn has no
        setting for it); only while it starts, and only with TLS (asyncio refuses it without)."""
        if not self.config.loaded:
            self.config.load()
        if self.config.ssl is None:
            return await super().startup(sockets)
        loop = asyncio.get_running_loop()
        loop.create_server = functools.partial(loop.create_server, ssl_handshake_timeout=self.handshake_timeout_s)
        try:
            await super().startup(sockets)
        finally:
            del loop.create_server  # the loop's own method again
