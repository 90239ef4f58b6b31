"""Replays a `Workload` against a running router over gRPC (grpc.aio) and times every token.

Each request is sent at its arrival offset (or as soon as a concurrency slot frees; see
bench/dispatch.py), with ignore_eos, greedy sampling and its exact `max_tokens`; the
arrival time and token count of every streamed message is recorded. A router that does not
accept a connection within the timeout raises `RouterUnreachable` before anything is sent. A
`Target` (client/credentials.py) adds TLS and the bearer token to the channel and every call.
"""

from __future__ import annotations

import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict

from bench.dispatch import PROGRESS_EVERY_S, Progress, dispatch
from bench.errors import RouterUnreachable
from bench.metrics import RequestRecord
from bench.workload import RequestSpec, Workload
from client.credentials import Target, as_target
from proto import pdserve_pb2, pdserve_pb2_grpc
from protocol.deadline import within

_CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 * 1024 * 1024)]


async def wait_for_router(channel: grpc.aio.Channel, address: str, timeout_s: float) -> None:
    """Raises `RouterUnreachable` unless the channel is ready within `timeout_s`."""
    try:
        await within(channel.channel_ready(), timeout_s)
    except TimeoutError as err:
        raise RouterUnreachable(
            f"router {address} not reachable within {timeout_s:g} s (is `pdserve serve` up?)"
        ) from err


async def replay(address: Target | str, workload: Workload, arrangement: str, *, connect_timeout_s: float = 10.0,
                 show_progress: bool = True, progress_every_s: float = PROGRESS_EVERY_S) -> list[RequestRecord]:
    """Sends every request of `workload` to the router at `address` (with its TLS and token); one record each."""
    target = as_target(address)
    async with target.aio_channel(options=_CHANNEL_OPTIONS) as channel:
        await wait_for_router(channel, str(target), connect_timeout_s)
        stub = pdserve_pb2_grpc.GenerationStub(channel)
        progress = Progress(len(workload.requests), arrangement, sys.stderr if show_progress else None,
                            progress_every_s)
        run = _Run(stub, arrangement, uuid.uuid4().hex[:8], time.perf_counter(), target.metadata)
        return await dispatch(workload, run.send, run.now, progress)


async def fetch_status(address: Target | str, timeout_s: float = 5.0) -> dict[str, Any]:
    """The router's Admin/Status as a dict (mode, model, workers) for the report."""
    target = as_target(address)
    async with target.aio_channel() as channel:
        stub = pdserve_pb2_grpc.AdminStub(channel)
        try:
            reply = await stub.Status(pdserve_pb2.StatusRequest(), timeout=timeout_s, metadata=target.metadata)
        except grpc.aio.AioRpcError as err:
            return {"error": f"{err.code().name}: {err.details()}"}
        return MessageToDict(reply, preserving_proto_field_name=True,
                             always_print_fields_with_no_presence=True)


@dataclass
class _Run:
    """One replay: request ids are `<spec id>-<run nonce>`, times relative to `t0`."""

    stub: pdserve_pb2_grpc.GenerationStub
    arrangement: str
    nonce: str
    t0: float
    metadata: tuple[tuple[str, str], ...] = ()  # the bearer token, if any

    def now(self) -> float:
        return time.perf_counter() - self.t0

    async def send(self, spec: RequestSpec) -> RequestRecord:
        """Streams one request; a gRPC error is recorded, never raised."""
        request = _request(spec, f"{spec.request_id}-{self.nonce}")
        times: list[float] = []
        counts: list[int] = []
        finish, error, usage = "", None, {}
        send_s = self.now()
        try:
            async for message in self.stub.Generate(request, metadata=self.metadata):
                arrived = self.now()
                if message.token_ids:
                    times.append(arrived)
                    counts.append(len(message.token_ids))
                finish = message.finish_reason or finish
                if message.HasField("usage"):
                    usage = _usage_dict(message.usage)
        except grpc.aio.AioRpcError as err:
            error = f"{err.code().name}: {err.details()}"
        return RequestRecord(spec.request_id, self.arrangement, send_s, tuple(times),
                             tuple(counts), spec.num_prompt_tokens, spec.max_tokens,
                             finish, error, usage)


def _usage_dict(usage: pdserve_pb2.Usage) -> dict[str, Any]:
    """Every Usage field, zeros included (a 0 ms queue is a measurement, not a gap)."""
    return {f.name: getattr(usage, f.name) for f in usage.DESCRIPTOR.fields}


def _request(spec: RequestSpec, request_id: str) -> pdserve_pb2.GenerateRequest:
    # set, not left to the server's defaults: the bench measures greedy runs of exact length
    sampling = pdserve_pb2.SamplingParams(max_tokens=spec.max_tokens, temperature=0.0,
                                          ignore_eos=True)
    return pdserve_pb2.GenerateRequest(request_id=request_id,
                                       prompt_token_ids=spec.prompt_token_ids, sampling=sampling)
