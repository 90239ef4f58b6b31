"""A small synchronous gRPC client for the CLI (generate, chat, status, scale, role).

Each call takes a router address or a `Target` (client/credentials.py: TLS and a bearer token).
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc

from client.credentials import Target, as_target
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc

CONNECT_TIMEOUT_S = 5.0  # how long a call waits for the router's channel to be ready


class RouterError(Exception):
    """An RPC failed; the message says which status and why, for a person."""


def _channel(target: Target) -> grpc.Channel:
    channel = target.grpc_channel()
    try:
        grpc.channel_ready_future(channel).result(timeout=CONNECT_TIMEOUT_S)
    except grpc.FutureTimeoutError:
        hint = ("the TLS handshake may have failed: check --ca-file, and --cert-file/--key-file for mutual TLS"
                if target.secure else "a router with TLS needs --ca-file or --tls")
        raise RouterError(f"cannot reach a pdserve router at {target} (is `pdserve serve` running? {hint})") from None
    return channel


def check_reachable(target: Target | str) -> None:
    """RouterError, naming the address, when no router answers there."""
    _channel(as_target(target)).close()


def _error(e: grpc.RpcError) -> RouterError:
    hint = {grpc.StatusCode.UNAUTHENTICATED: " (give --token or set PDSERVE_TOKEN)",
            grpc.StatusCode.PERMISSION_DENIED: " (an admin token: router.auth.admin_tokens_file)"}.get(e.code(), "")
    return RouterError(f"{e.code().name}: {e.details()}{hint}")


def _call(fn):
    try:
        return fn()
    except grpc.RpcError as e:
        raise _error(e) from None


def generate(target: Target | str, prompt: str = "", *, messages: list[dict] | None = None,
             **sampling) -> Iterator[pb.GenerateResponse]:
    """Stream one completion of `prompt`, or the reply to a chat (`messages`: [{"role", "content"}]).
    A sampling value of None is left unset, so the server applies its documented default."""
    params = pb.SamplingParams(**{name: value for name, value in sampling.items() if value is not None})
    chat = [pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages or ()]
    target = as_target(target)
    channel = _channel(target)
    stream = pb_grpc.GenerationStub(channel).Generate(pb.GenerateRequest(prompt=prompt, messages=chat,
                                                                         sampling=params), metadata=target.metadata)
    try:
        yield from stream
    except grpc.RpcError as e:
        raise _error(e) from None
    finally:
        channel.close()  # a caller that stopped early (Ctrl-C) cancels the request on the server


def status(target: Target | str) -> pb.StatusResponse:
    target = as_target(target)
    stub = pb_grpc.AdminStub(_channel(target))
    return _call(lambda: stub.Status(pb.StatusRequest(), timeout=30, metadata=target.metadata))


def scale(target: Target | str, pool: str, replicas: int) -> pb.ScaleResponse:
    target = as_target(target)
    stub = pb_grpc.AdminStub(_channel(target))
    return _call(lambda: stub.Scale(pb.ScaleRequest(pool=pool, replicas=replicas), timeout=600,
                                    metadata=target.metadata))


def change_role(target: Target | str, worker: str, role: str, if_idle: bool = False) -> pb.ChangeRoleResponse:
    """`worker` serves the `role` pool from now on, its weights kept (drained first, unless
    `if_idle`: then refused while it holds anything)."""
    target = as_target(target)
    stub = pb_grpc.AdminStub(_channel(target))
    return _call(lambda: stub.ChangeRole(pb.ChangeRoleRequest(worker=worker, role=role, if_idle=if_idle), timeout=900,
                                         metadata=target.metadata))


def _hit_rate(w: pb.WorkerStatus) -> str:
    """Prompt tokens found in the worker's prefix cache, of those it looked up."""
    return f"{100 * w.prefix_hit_tokens / w.prefix_query_tokens:.0f}%" if w.prefix_query_tokens else "-"


def _autoscale_line(a: pb.AutoscaleStatus) -> str:
    """The autoscaler's last decision, why, and when it decides next ('' when it is off)."""
    if not a.enabled:
        return ""
    if a.last_decision_age_s < 0:
        return f"\nautoscale: no decision yet; first evaluation in {a.next_evaluation_in_s:.0f} s"
    sizes = ", ".join(f"{p.pool} {p.actual} ready -> {p.desired} ({p.cause})" for p in a.pools)
    return (f"\nautoscale: last decision {a.last_decision_age_s:.0f} s ago, next in {a.next_evaluation_in_s:.0f} s, "
            f"{a.scaling_actions} scaling actions so far: {sizes}\nautoscale reason: {a.reason}")


def format_status(s: pb.StatusResponse) -> str:
    head = f"mode {s.mode}  model {s.model}\nrouter: {s.router_in_flight} in flight, {s.router_queue} queued, " \
           f"{s.requests_total} requests accepted so far"
    cols = ("WORKER", "POOL", "STATE", "RUNNING", "WAITING", "KV USED", "KV FREE", "KV TOTAL", "KV CACHED",
            "PREFIX HIT", "CHANNELS", "SERVED", "NODE", "KERNELS")
    rows = [cols] + [(w.name, w.pool, w.state, w.running, w.waiting, w.kv_blocks_used, w.kv_blocks_free,
                      w.kv_blocks_total, w.kv_blocks_cached, _hit_rate(w), w.channels, w.requests_served, w.node_ip,
                      w.kernels or "-")
                     for w in s.workers]
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(cols))]
    lines = ["  ".join(str(v).ljust(w) for v, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    for p in s.pools:  # above the table, which scripts read to its end
        head += f"\n{p.pool} pool: {p.ready}/{p.target} ready, {p.starting} starting, {p.restarts} restarts"
        if p.last_failure:
            head += f"; last failure {p.last_failure_age_s:.0f} s ago: {p.last_failure}"
    head += _autoscale_line(s.autoscale)
    nodes: dict[str, list[str]] = {}  # which workers run where (the Ray node IP each reported)
    for w in s.workers:
        nodes.setdefault(w.node_ip, []).append(w.name)
    head += "".join(f"\nnode {ip}: {', '.join(names)}" for ip, names in sorted(nodes.items()))
    return head + "\n" + "\n".join(lines)
