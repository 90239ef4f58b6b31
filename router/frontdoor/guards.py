"""The token gate (router/frontdoor/access.py) in front of each listener: gRPC, HTTP and /metrics.

gRPC: a server interceptor maps the method to what it needs (health OPEN, Generation TRAFFIC,
Admin/Status and reflection STATUS, every other method, Admin/Scale included, ADMIN: a method
added later is admin-only until someone decides otherwise). Traffic is decided in the
interceptor, and an allowed call gets its own handler back untouched: the generation path pays
one SHA-256 and a few compare_digest calls, nothing per message. STATUS and ADMIN are decided
inside the handler, where the peer's address and client certificate (an admin subject) are known.
Refusals: UNAUTHENTICATED / PERMISSION_DENIED (HTTP 401 / 403) with a fixed sentence.
HTTP: every path but /health needs a traffic token. /metrics: STATUS.
"""

from __future__ import annotations

import inspect
import logging
import threading
import time

import grpc
from starlette.responses import JSONResponse

from router.frontdoor.access import (
    AmbiguousCredentials,
    Gate,
    Need,
    Verdict,
    grpc_peer_is_loopback,
    sole_authorization,
)

log = logging.getLogger(__name__)

_GRPC_NEEDS = (("/grpc.health.v1.Health/", Need.OPEN), ("/pdserve.v1.Generation/", Need.TRAFFIC),
               ("/pdserve.v1.Admin/Status", Need.STATUS), ("/grpc.reflection.", Need.STATUS))
_GRPC_CODES = {Verdict.UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
               Verdict.AMBIGUOUS: grpc.StatusCode.UNAUTHENTICATED,
               Verdict.DENIED: grpc.StatusCode.PERMISSION_DENIED}
_HTTP_OPEN = frozenset({"/health"})
_KINDS = {"unary_unary": grpc.unary_unary_rpc_method_handler, "unary_stream": grpc.unary_stream_rpc_method_handler,
          "stream_unary": grpc.stream_unary_rpc_method_handler,
          "stream_stream": grpc.stream_stream_rpc_method_handler}
LOG_EVERY_S = 60.0
LOGGED_CHARS = 200  # of a path or peer in a log line


class Refusals:
    """Logs refused calls without letting a flood of them flood the log: the first at once, then
    at most one line per LOG_EVERY_S with the count. Never the token; the path and the peer
    escaped (a percent-encoded newline in a path would otherwise forge a log line)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._quiet_until, self._suppressed = 0.0, 0

    def note(self, door: str, what: str, peer: str, verdict: Verdict) -> None:
        with self._lock:
            now = time.monotonic()
            if now < self._quiet_until:
                self._suppressed += 1
                return
            suppressed, self._suppressed, self._quiet_until = self._suppressed, 0, now + LOG_EVERY_S
        more = f" ({suppressed} more refusals since the last line)" if suppressed else ""
        log.warning("auth: refused %s %s from %s: %s%s", door, loggable(what), loggable(peer), verdict.value, more)


def loggable(text: str) -> str:
    """`text` as one line of a log: control characters, backslashes and non-ASCII escaped as Python
    writes them (\\n, \\x1b, \\u202e), cut after LOGGED_CHARS characters."""
    cut = "..." if len(text) > LOGGED_CHARS else ""
    return text[:LOGGED_CHARS].encode("unicode_escape").decode("ascii") + cut


def grpc_need(method: str) -> Need:
    return next((need for prefix, need in _GRPC_NEEDS if method.startswith(prefix)), Need.ADMIN)


def grpc_authorization(metadata) -> str | bytes | None:
    """The call's one `authorization` metadata value; AmbiguousCredentials when it has several."""
    return sole_authorization([value for key, value in metadata or () if key == "authorization"])


def grpc_subject(context) -> str | None:
    """The subject of the client certificate the peer showed (mutual TLS), as gRPC writes it
    ("CN=ops,O=acme"); None without one."""
    values = context.auth_context().get("x509_subject") or ()
    return values[0].decode("utf-8", "replace") if values else None


class GrpcGuard(grpc.aio.ServerInterceptor):
    def __init__(self, gate: Gate, refusals: Refusals):
        self.gate, self.refusals = gate, refusals

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        need = grpc_need(details.method)
        if handler is None or need is Need.OPEN or not self.gate.enabled:
            return handler
        try:
            authorization = grpc_authorization(details.invocation_metadata)
        except AmbiguousCredentials:
            return _checked(handler, lambda context: self._verdict(details.method, context, Verdict.AMBIGUOUS))
        if need is not Need.TRAFFIC:
            return _checked(handler, lambda context: self._verdict(details.method, context, self.gate.check(
                need, authorization, lambda: grpc_peer_is_loopback(context.peer()), lambda: grpc_subject(context))))
        verdict = self.gate.check(need, authorization)
        if verdict is Verdict.ALLOW:
            return handler
        return _checked(handler, lambda context: self._verdict(details.method, context, verdict))

    def _verdict(self, method: str, context, verdict: Verdict) -> Verdict:
        if verdict is not Verdict.ALLOW:
            self.refusals.note("gRPC", method, context.peer(), verdict)
        return verdict


def _checked(handler: grpc.RpcMethodHandler, decide) -> grpc.RpcMethodHandler:
    """`handler` of the same kind whose behaviour first asks decide(context) and aborts unless ALLOW."""
    kind = next(k for k in _KINDS if getattr(handler, k) is not None)
    behavior = getattr(handler, kind)

    async def enforce(context) -> None:
        verdict = decide(context)
        if verdict is not Verdict.ALLOW:
            await context.abort(_GRPC_CODES[verdict], verdict.value)

    if inspect.isasyncgenfunction(behavior):
        async def checked(request, context):
            await enforce(context)
            async for item in behavior(request, context):
                yield item
    else:
        async def checked(request, context):
            await enforce(context)
            result = behavior(request, context)
            return await result if inspect.isawaitable(result) else result
    return _KINDS[kind](checked, request_deserializer=handler.request_deserializer,
                        response_serializer=handler.response_serializer)


def _error(verdict: Verdict) -> JSONResponse:
    """OpenAI's shape for a bad API key: what the openai SDK turns into AuthenticationError."""
    status, code = (403, "permission_denied") if verdict is Verdict.DENIED else (401, "invalid_api_key")
    body = {"error": {"message": verdict.value, "type": "invalid_request_error", "param": None, "code": code}}
    return JSONResponse(body, status, headers={"WWW-Authenticate": "Bearer"})


class HttpGuard:
    """ASGI middleware: every path but /health needs a traffic (or admin) token."""

    def __init__(self, app, gate: Gate, refusals: Refusals):
        self.app, self.gate, self.refusals = app, gate, refusals

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in _HTTP_OPEN:
            try:
                authorization = sole_authorization([v for k, v in scope["headers"] if k == b"authorization"])
                verdict = self.gate.check(Need.TRAFFIC, authorization)
            except AmbiguousCredentials:
                verdict = Verdict.AMBIGUOUS
            if verdict is not Verdict.ALLOW:
                peer = scope.get("client") or ("?", 0)
                self.refusals.note("HTTP", scope["path"], f"{peer[0]}:{peer[1]}", verdict)
                return await _error(verdict)(scope, receive, send)
        await self.app(scope, receive, send)


