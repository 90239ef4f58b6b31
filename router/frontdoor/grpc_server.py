"""gRPC front door (grpc.aio): Generation and Admin services over `Router`, plus the standard
health service and server reflection. Errors become statuses with a readable message:
INVALID_ARGUMENT (bad request), RESOURCE_EXHAUSTED (queue full, or a predicted wait over
router.queue_timeout_s with trailing metadata `retry-after`; a scale Ray cannot place),
UNAVAILABLE (shutting down, no worker can serve, failures beyond the migration limit),
INTERNAL (the engine failed on this request); a client that goes away cancels its request on
every worker. Health is SERVING only while every pool the mode needs has a ready worker, and
stays reachable without a token (load balancers); the rest is gated (router/frontdoor/guards.py)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc
from protocol import clock
from protocol.errors import InvalidRequest
from protocol.validation import check_message_count
from router.config.schema import TLSSection
from router.frontdoor.access import AmbiguousCredentials, Gate, caller_id
from router.frontdoor.grpc_convert import (
    autoscale_to_proto,
    pool_status_to_proto,
    sampling_from_proto,
    usage_to_proto,
)
from router.frontdoor.guards import GrpcGuard, Refusals, grpc_authorization, grpc_subject
from router.frontdoor.public_errors import public_message
from router.frontdoor.tls import grpc_server_credentials
from router.lifecycle.life import RequestLife
from router.lifecycle.outcomes import (
    CannotChangeRole,
    CannotPlace,
    Chunk,
    InternalError,
    QueueFull,
    Unavailable,
)
from router.lifecycle.service import Router
from router.lifecycle.worker_calls import CALL_FAILURES, short

log = logging.getLogger(__name__)

def max_message_bytes(max_prompt_bytes: int, max_model_len: int) -> int:
    """The largest GenerateRequest a request can need (gRPC's default is 4 MiB): its text, or its
    context as token ids (a varint of at most 5 bytes each), and the rest."""
    return max(max_prompt_bytes, 5 * max_model_len) + (64 << 10)


class WriteTimeout(Exception):
    """A streaming client took none of its response for router.write_timeout_s."""


# the gRPC status each refusal gets (simulate/run.py names refusals by it too)
STATUS = {InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT, QueueFull: grpc.StatusCode.RESOURCE_EXHAUSTED,
          CannotPlace: grpc.StatusCode.RESOURCE_EXHAUSTED, Unavailable: grpc.StatusCode.UNAVAILABLE,
          InternalError: grpc.StatusCode.INTERNAL, AmbiguousCredentials: grpc.StatusCode.UNAUTHENTICATED,
          WriteTimeout: grpc.StatusCode.DEADLINE_EXCEEDED}
HEALTH_EVERY_S = 0.25


def peer_address(peer: str) -> str:
    """The client's address in a gRPC peer string ("ipv4:1.2.3.4:5678", "ipv6:[::1]:5678"), without
    its port; a peer with no port (unix:...) is itself."""
    kind, _, rest = peer.partition(":")
    return rest.rsplit(":", 1)[0] if kind in ("ipv4", "ipv6") else peer


class GenerationService(pb_grpc.GenerationServicer):
    def __init__(self, router: Router):
        self.router = router
        self.by_address: collections.Counter[str] = collections.Counter()  # Generate calls running

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        address = peer_address(context.peer())
        try:
            with self._counted(address):
                await self._generate(request, context)
        except tuple(STATUS) as e:
            code = STATUS[type(e)]
            self.router.metrics.observe_error(code.name)
            if isinstance(e, QueueFull) and e.retry_after_s is not None:
                context.set_trailing_metadata((("retry-after", str(e.retry_after_s)),))
            await context.abort(code, str(e) if isinstance(e, InvalidRequest) else public_message(str(e)))

    @contextlib.contextmanager
    def _counted(self, address: str):
        """One more Generate call from `address`; QueueFull at router.max_connections_per_address."""
        limit = self.router.config.router.max_connections_per_address
        if self.by_address[address] >= limit:
            raise QueueFull(f"{limit} calls from your address are running (router.max_connections_per_address)")
        self.by_address[address] += 1
        try:
            yield
        finally:
            self.by_address[address] -= 1
            if not self.by_address[address]:
                del self.by_address[address]

    async def _generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        life = await self._prepare(request, context)
        async with contextlib.aclosing(self.router.generate(life)) as chunks:
            async for chunk in chunks:
                await self._write(context, self._response(life.client_id, chunk))

    async def _prepare(self, request: pb.GenerateRequest, context) -> RequestLife:
        if request.prompt and request.prompt_token_ids:
            raise InvalidRequest("give either prompt or prompt_token_ids, not both")
        check_message_count(len(request.messages))
        self.router.validator.check_prompt_length(len(request.prompt_token_ids))  # before list() copies them
        sampling = sampling_from_proto(request.sampling, request.cache_salt)
        messages = [{"role": m.role, "content": m.content} for m in request.messages]
        caller = caller_id(grpc_authorization(context.invocation_metadata()), grpc_subject(context))
        special = request.add_special_tokens if request.HasField("add_special_tokens") else None
        return await self.router.prepare(request.request_id, request.prompt or None,
                                         list(request.prompt_token_ids) or None, sampling,
                                         messages=messages or None, caller=caller, add_special_tokens=special)

    async def _write(self, context, message: pb.GenerateResponse) -> None:
        """One message out; a client that takes none of the stream for router.write_timeout_s (its
        flow-control window and gRPC's buffers full) ends the call: the request is cancelled."""
        timeout_s = self.router.config.router.write_timeout_s
        try:
            async with asyncio.timeout(timeout_s):
                await context.write(message)
        except TimeoutError:
            raise WriteTimeout(f"the client took none of the response for {timeout_s:g} s "
                               "(router.write_timeout_s); the request was cancelled") from None

    @staticmethod
    def _response(rid: str, chunk: Chunk) -> pb.GenerateResponse:
        finish = chunk.finish_reason.public if chunk.finish_reason is not None else ""
        msg = pb.GenerateResponse(request_id=rid, token_ids=chunk.token_ids, text=chunk.text, finish_reason=finish)
        if chunk.usage is not None:
            msg.usage.CopyFrom(usage_to_proto(chunk.usage))
        return msg


class AdminService(pb_grpc.AdminServicer):
    def __init__(self, router: Router):
        self.router = router

    async def Status(self, request, context) -> pb.StatusResponse:
        workers = await self.router.status()
        return pb.StatusResponse(
            mode=self.router.config.mode, model=self.router.config.model.path,
            workers=[self._worker(w) for w in workers], router_queue=self.router.queue_length,
            router_in_flight=len(self.router.lives), requests_total=self.router.requests_total,
            pools=[pool_status_to_proto(p) for p in self.router.pools.status()],
            autoscale=autoscale_to_proto(self.router.autoscaler, clock.now()))

    @staticmethod
    def _worker(w) -> pb.WorkerStatus:
        s = w.stats
        msg = pb.WorkerStatus(name=w.name, pool=w.info.pool, state=w.state.value, node_ip=w.info.node_ip,
                              kv_blocks_total=w.info.num_blocks, kernels=w.info.kernels)
        if s is not None:
            msg.running, msg.waiting, msg.channels, msg.requests_served = s.running, s.waiting, s.channels, s.served
            msg.kv_blocks_used, msg.kv_blocks_free = s.blocks_used, s.blocks_free
            msg.kv_blocks_cached = s.blocks_cached
            msg.prefix_query_tokens, msg.prefix_hit_tokens = s.prefix_query_tokens, s.prefix_hit_tokens
        return msg

    async def Scale(self, request: pb.ScaleRequest, context) -> pb.ScaleResponse:
        if request.pool not in ("prefill", "decode"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown pool {request.pool!r}: use prefill or decode")
        most = self.router.config.router.max_pool_replicas
        if request.replicas > most:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{request.replicas} replicas asked of the "
                                f"{request.pool} pool; at most {most} (router.max_pool_replicas)")
        try:
            started, stopped = await self.router.scale(request.pool, request.replicas)
        except tuple(STATUS) as e:
            await context.abort(STATUS[type(e)], str(e))
        return pb.ScaleResponse(pool=request.pool, replicas=request.replicas, started=started, stopped=stopped)

    async def ChangeRole(self, request: pb.ChangeRoleRequest, context) -> pb.ChangeRoleResponse:
        """`pdserve role`: PoolManager.change_role by a worker's name, its refusals as statuses."""
        if request.role not in ("prefill", "decode"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown role {request.role!r}: use prefill or decode")
        w = next((w for w in self.router.pools.all() if w.name == request.worker and not w.stopped), None)
        if w is None:
            live = ", ".join(w.name for w in self.router.pools.all() if not w.stopped) or "none"
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no live worker is named {request.worker!r} (live: {live})")
        if request.if_idle and (held := await self._held(w)):
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{w.name} holds {held}: not changed "
                                "(without if_idle it is drained first)")
        began = clock.now()
        try:
            name = await self.router.change_role(request.worker, request.role)
        except CannotChangeRole as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except InvalidRequest as e:  # it stopped meanwhile
            await context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        except CALL_FAILURES as e:
            await context.abort(grpc.StatusCode.ABORTED, f"the role change of {request.worker} failed on the worker "
                                f"({short(e)}); it was stopped and its pool starts a replacement")
        return pb.ChangeRoleResponse(worker=request.worker, new_name=name, role=request.role,
                                     seconds=clock.now() - began)

    async def _held(self, w) -> str:
        """What `w` holds now ('' when idle): the router's requests placed there, else its engine's
        running and waiting requests and KV blocks in use."""
        if w.inflight:
            return f"{len(w.inflight)} of the router's requests"
        try:
            stats = await self.router.pools.fetch_stats(w)
        except CALL_FAILURES as e:
            return f"an unknown load (its stats did not come: {short(e)})"
        return ", ".join(f"{n} {what}" for n, what in ((stats.running + stats.waiting, "engine requests"),
                                                       (stats.blocks_used, "KV blocks")) if n)


class RouterServer:
    """The grpc.aio server; `port` is the bound port (config port 0 = pick a free one). With a
    `gate` that has tokens every call passes router/frontdoor/guards.py's interceptor; with `tls` the port
    speaks only TLS (mutual when tls.client_ca_file). At most router.max_concurrent_calls calls run at
    once (grpc refuses more with RESOURCE_EXHAUSTED) over at most router.max_connections connections;
    a connection's handshake has read_timeout_s, and so has a connection with no call; a stream the
    client stops reading ends after write_timeout_s (DEADLINE_EXCEEDED, the request cancelled)."""

    def __init__(self, router: Router, host: str, port: int, gate: Gate | None = None,
                 tls: TLSSection | None = None, refusals: Refusals | None = None):
        self.router = router
        guard = [GrpcGuard(gate, refusals or Refusals())] if gate is not None and gate.enabled else []
        r = router.config.router
        options = [("grpc.so_reuseport", 0), ("grpc.server_handshake_timeout_ms", int(r.read_timeout_s * 1000)),
                   ("grpc.max_receive_message_length", max_message_bytes(r.max_prompt_bytes,
                                                                         router.validator.max_model_len)),
                   ("grpc.max_allowed_incoming_connections", r.max_connections),
                   # a connection with no call for read_timeout_s is closed (GOAWAY; a client's channel
                   # reconnects on its next call), and one whose peer stops answering pings during a
                   # call after write_timeout_s + write_timeout_s
                   ("grpc.max_connection_idle_ms", int(r.read_timeout_s * 1000)),
                   ("grpc.keepalive_time_ms", int(r.write_timeout_s * 1000)),
                   ("grpc.keepalive_timeout_ms", int(r.write_timeout_s * 1000))]
        self.server = grpc.aio.server(options=options, interceptors=guard, maximum_concurrent_rpcs=r.max_concurrent_calls)
        self.generation = GenerationService(router)
        pb_grpc.add_GenerationServicer_to_server(self.generation, self.server)
        pb_grpc.add_AdminServicer_to_server(AdminService(router), self.server)
        self.health = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        names = [pb.DESCRIPTOR.services_by_name[n].full_name for n in ("Generation", "Admin")]
        reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server)
        if tls is not None and tls.enabled:
            self.port = self.server.add_secure_port(f"{host}:{port}", grpc_server_credentials(tls))
        else:
            self.port = self.server.add_insecure_port(f"{host}:{port}")
        if self.port == 0:
            raise OSError(f"cannot listen on {host}:{port}")
        self.address = f"{host}:{self.port}"

    async def start(self) -> None:
        await self.server.start()

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", "pdserve.v1.Generation"):
            result = self.health.set(name, status)
            if result is not None:
                await result

    async def follow_health(self) -> None:
        """Keep the health status in step with `router.serving` (run as a task)."""
        serving = None
        while True:
            if self.router.serving != serving:
                serving = self.router.serving
                await self.set_serving(serving)
            await asyncio.sleep(HEALTH_EVERY_S)

    async def stop(self, grace_s: float) -> None:
        await self.server.stop(grace_s)
