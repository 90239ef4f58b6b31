"""OpenAI-compatible HTTP front door over the same `Router` as gRPC, on the router's own loop.

POST /v1/completions and /v1/chat/completions (server-sent events, or one JSON body), GET
/v1/models and /health. A request becomes `Router.prepare` + `Router.generate`; refusals are
OpenAI error objects: 400 (a field refused, router/frontdoor/openai_request.py, or the
validator's sentence), 404 (a model not served), 429 (queue full, or a predicted wait over
router.queue_timeout_s, with a Retry-After header), 503 (no worker can serve;
every /v1 path while the router starts or shuts down), 500 (the engine failed on the request).
A client that goes away closes the request's generator, which aborts it on every worker. `OpenAIServer` runs
uvicorn as a task without signal handlers: the process's owner (serve_forever) keeps them; with
router.tls it is HTTPS, with router.auth a missing or wrong bearer token gets 401 from
router/frontdoor/guards.py before a request reaches the app. At most router.max_concurrent_calls
requests at once (503 beyond: router/frontdoor/http_conn.py's CallLimit); a request's body must arrive within
router.read_timeout_s (408); the connection's own deadlines and cap: router/frontdoor/http_conn.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import socket
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import uvicorn
from sse_starlette import EventSourceResponse
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from protocol.deadline import within
from protocol.errors import InvalidRequest
from protocol.limits import CHAT_MAX_TOKENS
from router.config.schema import TLSSection
from router.frontdoor.access import AmbiguousCredentials, Gate, caller_id, sole_authorization
from router.frontdoor.body_budget import BodyBudget, BodyCharge
from router.frontdoor.guards import HttpGuard, Refusals
from router.frontdoor.http_conn import CallLimit, ConnectionLimits, DeadlineProtocol, Server
from router.frontdoor.openai_reply import Reply, UsageSoFar, finish_reason, sse_json, usage_body
from router.frontdoor.openai_request import (
    SAMPLING_FIELDS,
    ApiError,
    Parsed,
    load_body,
    parse_request,
)
from router.frontdoor.public_errors import public_message
from router.frontdoor.tls import uvicorn_tls
from router.lifecycle.intake import SMALL_INPUT_BYTES
from router.lifecycle.life import RequestLife
from router.lifecycle.outcomes import CannotPlace, Chunk, InternalError, QueueFull, Unavailable
from router.lifecycle.service import Router

log = logging.getLogger(__name__)

STOP_GRACE_S = 2.0  # uvicorn's wait for open responses at stop (the router has ended them by then)
# status, OpenAI error type, error code, and the gRPC status name the error counter uses
_FAILURES: dict[type[Exception], tuple[int, str, str, str]] = {
    InvalidRequest: (400, "invalid_request_error", "invalid_request", "INVALID_ARGUMENT"),
    QueueFull: (429, "rate_limit_error", "queue_full", "RESOURCE_EXHAUSTED"),
    CannotPlace: (429, "rate_limit_error", "cannot_place", "RESOURCE_EXHAUSTED"),
    Unavailable: (503, "server_error", "unavailable", "UNAVAILABLE"),
    InternalError: (500, "server_error", "internal_error", "INTERNAL"),
}


def _api_error(e: Exception) -> ApiError:
    """A router refusal as the client sees it: its own bad input in full, the server's side
    without the cluster's insides (router/frontdoor/public_errors.py)."""
    status, kind, code, _ = _FAILURES[type(e)]
    first = str(e).split(" ", 1)[0]
    message = str(e) if isinstance(e, InvalidRequest) else public_message(str(e))
    return ApiError(status, message, first if first in SAMPLING_FIELDS else None, kind, code)


class ClientGone(Exception):
    """The HTTP client disconnected before the response started."""


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_gone(request: Request, work_coro) -> Any:
    """`work_coro`'s result, or ClientGone (and `work_coro` cancelled) if the client leaves first."""
    work, gone = asyncio.ensure_future(work_coro), asyncio.ensure_future(_until_disconnect(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (work, gone):
            task.cancel()
        await asyncio.gather(work, gone, return_exceptions=True)  # outcomes are read just below
    if work.cancelled():
        raise ClientGone()
    return work.result()


def _caller(request: Request) -> str:
    """`caller_id` of the request's one Authorization header; 401 for several (AmbiguousCredentials)."""
    try:
        return caller_id(sole_authorization(request.headers.getlist("authorization")))
    except AmbiguousCredentials as e:
        raise ApiError(401, str(e), code="invalid_api_key") from None


def max_body_bytes(max_prompt_bytes: int) -> int:
    """The largest body a request may have: its prompt as token ids in JSON text, and the rest."""
    return 4 * max_prompt_bytes + (64 << 10)


def _content_length(request: Request) -> int:
    """The body's declared size (0 when chunked or malformed: then only its read limits it)."""
    value = request.headers.get("content-length", "")
    return int(value) if value.isdigit() else 0


async def _collect(chunks: AsyncIterator[Chunk]) -> list[Chunk]:
    return [chunk async for chunk in chunks]


def _defect(e: Exception) -> ApiError:
    """What a client reads of a defect: its kind, never its text (it may hold internals)."""
    return ApiError(500, f"internal error ({type(e).__name__}); the server log has the details", kind="server_error")


class _Stream(EventSourceResponse):
    """Server-sent events that close the request's generator however the response ends."""

    def __init__(self, chunks, events: AsyncIterator[dict]):
        super().__init__(events, sep="\n")  # events end in "\n\n", as OpenAI's and vLLM's: clients split on it
        self.chunks = chunks

    async def __call__(self, scope, receive, send) -> None:
        async with contextlib.aclosing(self.chunks):
            await super().__call__(scope, receive, send)


class OpenAIApi:
    def __init__(self, router: Router):
        self.router = router
        self.model_id = Path(router.config.model.path).name
        self.created = int(time.time())
        self.max_body_bytes = max_body_bytes(router.config.router.max_prompt_bytes)
        self.bodies = BodyBudget(router.config.router.max_body_bytes_in_flight)

    def app(self) -> Starlette:
        routes = [Route("/v1/completions", self._open(self.completions), methods=["POST"]),
                  Route("/v1/chat/completions", self._open(self.chat), methods=["POST"]),
                  Route("/v1/models", self._open(self.models), methods=["GET"]),
                  Route("/health", self.health, methods=["GET"])]
        return Starlette(routes=routes, exception_handlers={HTTPException: self._http_error, Exception: self._bug})

    def _open(self, endpoint):
        """`endpoint`, answered with 503 instead while the router takes no requests: before its pools
        have started (so /v1/models is not 200 while /health is 503) and once it is shutting down."""
        async def gated(request: Request) -> Response:
            try:
                self.router.check_open()
            except Unavailable as e:
                return self._refusal(e)
            return await endpoint(request)
        return gated

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def models(self, request: Request) -> Response:
        card = {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "pdserve",
                "max_model_len": self.router.validator.max_model_len}
        return JSONResponse({"object": "list", "data": [card]})

    async def health(self, request: Request) -> Response:
        serving = self.router.serving
        return JSONResponse({"status": "serving" if serving else "not serving"}, 200 if serving else 503)

    async def _generate(self, request: Request, chat: bool) -> Response:
        reply = Reply(chat, f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", self.model_id)
        try:
            caller = _caller(request)
            self.router.intake.check_room(_content_length(request) > SMALL_INPUT_BYTES)
            parsed = await self._parsed(request, chat)
            life = await self._accept(reply.id, parsed, caller)
            chunks = self.router.generate(life)
            if not parsed.stream:
                async with contextlib.aclosing(chunks):
                    return self._whole(reply, await _unless_gone(request, _collect(chunks)))
            try:
                first = await _unless_gone(request, anext(chunks))
            except BaseException:
                await chunks.aclose()
                raise
            counter = UsageSoFar(len(life.prompt_token_ids)) if parsed.continuous_usage else None
            return _Stream(chunks, self._events(reply, first, chunks, parsed.include_usage, counter))
        except ApiError as e:
            self.router.metrics.observe_error("UNAUTHENTICATED" if e.status == 401 else "INVALID_ARGUMENT")
            return JSONResponse(e.body(), e.status)
        except tuple(_FAILURES) as e:
            return self._refusal(e)
        except ClientGone:
            return Response(status_code=499)  # nobody reads it; the request was cancelled

    def _refusal(self, e: Exception) -> JSONResponse:
        """The error object of a router refusal (a `_FAILURES` key), counted by its status."""
        self.router.metrics.observe_error(_FAILURES[type(e)][3])
        error = _api_error(e)
        retry_after = e.retry_after_s if isinstance(e, QueueFull) else None
        return JSONResponse(error.body(), error.status,
                            headers=None if retry_after is None else {"Retry-After": str(retry_after)})

    async def _parsed(self, request: Request, chat: bool) -> Parsed:
        """The body, read and parsed within its share of router.max_body_bytes_in_flight: its
        declared size is charged before a byte is read (429 when it does not fit), a chunked one as
        it arrives; 413 at once for a declared size over max_body_bytes."""
        declared = _content_length(request)
        if declared > self.max_body_bytes:
            raise ApiError(413, f"the request body is {declared} bytes; at most {self.max_body_bytes} are allowed")
        with self.bodies.held() as charge:
            charge.add(declared)
            return parse_request(await self._json(request, charge), chat, self.model_id)

    async def _json(self, request: Request, charge: BodyCharge) -> dict:
        """The body as JSON; 413 past max_body_bytes, 408 unless it all arrives within read_timeout_s
        (a client trickling a body would otherwise hold its connection and memory for ever)."""
        timeout_s = self.router.config.router.read_timeout_s
        try:
            async with asyncio.timeout(timeout_s):
                raw = await self._body(request, charge)
        except TimeoutError:
            raise ApiError(408, f"the request body did not arrive within {timeout_s:g} s") from None
        if len(raw) > SMALL_INPUT_BYTES:  # parsed on a thread: the loop keeps serving every few ms meanwhile
            return await asyncio.to_thread(load_body, raw)
        return load_body(raw)

    async def _body(self, request: Request, charge: BodyCharge) -> bytes:
        size, parts = 0, []
        async for part in request.stream():
            size += len(part)
            if size > self.max_body_bytes:
                raise ApiError(413, f"the request body is over {self.max_body_bytes} bytes")
            if size > charge.size:  # chunked, or more than declared: charged as it comes
                charge.add(size - charge.size)
            parts.append(part)
        return b"".join(parts)

    async def _accept(self, request_id: str, p: Parsed, caller: str) -> RequestLife:
        life = await self.router.prepare(request_id, p.prompt, p.prompt_ids, p.sampling, p.messages, caller,
                                         p.add_special_tokens)
        if not p.max_tokens_given:  # accepted with max_tokens 1; the default fits what is left
            decode = self.router.pools.ready("decode") or self.router.pools.live("decode")
            pool_tokens = max(w.info.num_blocks for w in decode) * decode[0].info.block_size
            room = min(self.router.validator.max_model_len, pool_tokens) - len(life.prompt_token_ids)
            life.sampling = dataclasses.replace(life.sampling, max_tokens=max(1, min(CHAT_MAX_TOKENS, room)))
        return life

    @staticmethod
    def _whole(reply: Reply, chunks: list[Chunk]) -> JSONResponse:
        text, ids = "".join(c.text for c in chunks), [t for c in chunks for t in c.token_ids]
        last = chunks[-1] if chunks else None
        choice = reply.choice(text, ids, finish_reason(last) if last else None, stream=False)
        return JSONResponse(reply.body([choice], usage_body(last), stream=False))

    async def _events(self, reply: Reply, chunk: Chunk | None, chunks, include_usage: bool,
                      so_far: UsageSoFar | None) -> AsyncIterator[dict]:
        """The stream's events; with `so_far` (continuous_usage_stats) each carries the usage so far."""
        first, last = True, chunk
        try:
            while chunk is not None:
                choice = reply.choice(chunk.text, chunk.token_ids, finish_reason(chunk), stream=True, first=first)
                usage = so_far.after(chunk) if so_far is not None else None
                yield {"data": sse_json(reply.body([choice], usage, stream=True))}
                first, last = False, chunk
                chunk = await anext(chunks, None)
        except tuple(_FAILURES) as e:  # after the 200: the error goes out as an event, as OpenAI's does
            self.router.metrics.observe_error(_FAILURES[type(e)][3])
            yield {"data": sse_json(_api_error(e).body())}
        except Exception as e:  # a defect after the 200: an error event too, and the stream ends cleanly
            log.exception("the stream of %s failed", reply.id)
            self.router.metrics.observe_error("INTERNAL")
            yield {"data": sse_json(_defect(e).body())}
        else:
            if include_usage:
                yield {"data": sse_json(reply.body([], usage_body(last), stream=True))}
        yield {"data": "[DONE]"}

    @staticmethod
    async def _http_error(request: Request, e: HTTPException) -> Response:
        return JSONResponse(ApiError(e.status_code, e.detail).body(), e.status_code)

    @staticmethod
    async def _bug(request: Request, e: Exception) -> Response:
        """A defect: the client gets an error object naming its kind, never the exception's text
        (it may hold internals); Starlette re-raises, so uvicorn logs the traceback."""
        return JSONResponse(_defect(e).body(), 500)


class OpenAIServer:
    """`OpenAIApi` served by uvicorn as a task on the running loop; `port` is the bound port.
    With a `gate` that has tokens every path but /health needs one; with `tls` it is HTTPS."""

    def __init__(self, router: Router, host: str, port: int, gate: Gate | None = None,
                 tls: TLSSection | None = None, refusals: Refusals | None = None):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.socket = socket.socket(family, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.socket.bind((host, port))
        except OSError as e:
            self.socket.close()
            raise OSError(f"cannot listen on {host}:{port} (router.http_port): {e.strerror}") from None
        self.port = self.socket.getsockname()[1]
        self.api = OpenAIApi(router)
        app = self.api.app()
        if gate is not None and gate.enabled:
            app = HttpGuard(app, gate, refusals or Refusals())
        app = CallLimit(app, router.config.router.max_concurrent_calls)
        r = router.config.router
        self.limits = ConnectionLimits(r.read_timeout_s, r.write_timeout_s, r.max_connections,
                                       r.max_connections_per_address)
        config = uvicorn.Config(app, lifespan="off", log_config=None, log_level="warning", access_log=False,
                                ws="none", timeout_graceful_shutdown=STOP_GRACE_S,
                                http=DeadlineProtocol.with_limits(self.limits), **uvicorn_tls(tls or TLSSection()))
        self.server = Server(config, handshake_timeout_s=r.read_timeout_s)
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self.server.serve(sockets=[self.socket]))
        while not self.server.started:
            if self._task.done():
                self._task.result()
                raise OSError("the HTTP server stopped while starting")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        if self._task is None:
            self.socket.close()
            return
        self.server.should_exit = True
        try:
            await within(self._task, STOP_GRACE_S + 3)
        except TimeoutError:
            log.warning("the HTTP server did not stop within %.0f s; cancelled", STOP_GRACE_S + 3)
        except Exception as e:  # it failed while serving; the rest of the cluster still stops
            log.error("the HTTP server failed: %s", e)
