"""A small synchronous gRPC client for the CLI (generate, chat, status, scale)."""

from __future__ import annotations

from collections.abc import Iterator

import grpc

from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc


class RouterError(Exception):
    """An RPC failed; the message says which status and why, for a person."""


def _channel(address: str) -> grpc.Channel:
    channel = grpc.insecure_channel(address)
    try:
        grpc.channel_ready_future(channel).result(timeout=5)
    except grpc.FutureTimeoutError:
        raise RouterError(f"cannot reach a pdserve router at {address} (is `pdserve serve` running?)") from None
    return channel


def check_reachable(address: str) -> None:
    """RouterError, naming the address, when no router answers there."""
    _channel(address).close()


def _call(fn):
    try:
        return fn()
    except grpc.RpcError as e:
        raise RouterError(f"{e.code().name}: {e.details()}") from None


def generate(address: str, prompt: str = "", *, messages: list[dict] | None = None,
             **sampling) -> Iterator[pb.GenerateResponse]:
    """Stream one completion of `prompt`, or the reply to a chat (`messages`: [{"role", "content"}]).
    A sampling value of None is left unset, so the server applies its documented default."""
    params = pb.SamplingParams(**{name: value for name, value in sampling.items() if value is not None})
    chat = [pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages or ()]
    channel = _channel(address)
    stream = pb_grpc.GenerationStub(channel).Generate(pb.GenerateRequest(prompt=prompt, messages=chat,
                                                                         sampling=params))
    try:
        yield from stream
    except grpc.RpcError as e:
        raise RouterError(f"{e.code().name}: {e.details()}") from None
    finally:
        channel.close()  # a caller that stopped early (Ctrl-C) cancels the request on the server


def status(address: str) -> pb.StatusResponse:
    stub = pb_grpc.AdminStub(_channel(address))
    return _call(lambda: stub.Status(pb.StatusRequest(), timeout=30))


def scale(address: str, pool: str, replicas: int) -> pb.ScaleResponse:
    stub = pb_grpc.AdminStub(_channel(address))
    return _call(lambda: stub.Scale(pb.ScaleRequest(pool=pool, replicas=replicas), timeout=600))


def format_status(s: pb.StatusResponse) -> str:
    head = f"mode {s.mode}  model {s.model}\nrouter: {s.router_in_flight} in flight, {s.router_queue} queued, " \
           f"{s.requests_total} requests accepted so far"
    cols = ("WORKER", "POOL", "STATE", "RUNNING", "WAITING", "KV USED", "KV FREE", "KV TOTAL", "CHANNELS", "SERVED", "NODE")
    rows = [cols] + [(w.name, w.pool, w.state, w.running, w.waiting, w.kv_blocks_used, w.kv_blocks_free,
                      w.kv_blocks_total, w.channels, w.requests_served, w.node_ip) for w in s.workers]
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(cols))]
    lines = ["  ".join(str(v).ljust(w) for v, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    for p in s.pools:  # above the table, which scripts read to its end
        head += f"\n{p.pool} pool: {p.ready}/{p.target} ready, {p.starting} starting, {p.restarts} restarts"
        if p.last_failure:
            head += f"; last failure {p.last_failure_age_s:.0f} s ago: {p.last_failure}"
    return head + "\n" + "\n".join(lines)
