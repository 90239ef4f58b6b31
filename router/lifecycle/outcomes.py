"""What the router streams to a client, and the ways a request can fail.

`Chunk` is one streamed message's worth (new tokens, their text, and on the last one the
finish reason and usage). The exceptions map one-to-one to gRPC statuses in router/frontdoor/grpc_server.py;
`Retry` never reaches a client: it moves the request to another worker.
"""

from __future__ import annotations

from dataclasses import dataclass

from protocol.outputs import FinishReason, RequestOutput
from protocol.usage import Usage


class QueueFull(Exception):
    """The router's bounded queue is full, or the wait it predicts is over router.queue_timeout_s
    (RESOURCE_EXHAUSTED; HTTP 429). `retry_after_s`: when to try again, where it can say (the
    front doors send it as `Retry-After`)."""

    def __init__(self, message: str, retry_after_s: int | None = None):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class CannotPlace(Exception):
    """A scale Ray cannot place: not enough of a resource (RESOURCE_EXHAUSTED)."""


class CannotChangeRole(Exception):
    """A role change the pools do not allow: the worker is not ready, the last of its pool, or
    the pools place their workers differently (router/pools/manager.py `change_role`)."""


class Unavailable(Exception):
    """Shutting down, an empty pool, or failures beyond the migration limit (UNAVAILABLE)."""


class InternalError(Exception):
    """The engine failed on this request; retrying elsewhere would fail the same way (INTERNAL)."""


class Retry(Exception):
    """This attempt failed in a way another worker may not: place the request again.
    `worker` is set when that worker is dead or unresponsive (the pool replaces it); `failed_on`
    names a live worker whose work for the request failed (a failed step or call): the request
    goes elsewhere next while another worker can take it."""

    def __init__(self, reason: str, worker=None, failed_on: str | None = None):
        super().__init__(reason)
        self.worker = worker
        self.failed_on = failed_on


class Respin(Retry):
    """Place the request again under a new attempt id, though nothing failed: a prefill started
    during a reservation that then found no room (not a migration)."""


@dataclass
class Chunk:
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None = None
    usage: Usage | None = None  # on the last chunk


def merge_outputs(outputs: list[RequestOutput]) -> RequestOutput:
    if len(outputs) == 1:
        return outputs[0]
    last = outputs[-1]
    return RequestOutput(last.request_id, [t for o in outputs for t in o.token_ids], "".join(o.text for o in outputs),
                         last.finish_reason, last.num_prompt_tokens, last.num_output_tokens,
                         sum(o.kv_transfer_s for o in outputs), sum(o.kv_transfer_bytes for o in outputs),
                         num_cached_tokens=outputs[0].num_cached_tokens)
