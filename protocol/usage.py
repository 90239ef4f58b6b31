"""`Usage`: what one request used and where its time went, as the router reports it to clients.

The router fills one per request across its attempts (router/lifecycle/attempt.py) and hands a
finished copy to the front door with the last chunk. The fields are those of the public
`pdserve.Usage` message (proto/pdserve.proto), which router/frontdoor/grpc_convert.py maps field
for field; the OpenAI front door maps it onto OpenAI's usage object; the request log writes its
figures. Times are milliseconds; the split of the time to the first token is docs/metrics.md's
"Bottlenecks". Not frozen: the router adds to it as the request goes, a field at a time (slots:
a misspelt field is an error, not a new key). A report only: no decision reads it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft_ms: float = 0.0  # router-side: accepted -> first token ready
    queue_ms: float = 0.0  # in the router's queue, every attempt's wait
    prefill_worker: str = ""  # of the last attempt
    decode_worker: str = ""
    prefill_ms: float = 0.0  # worker-side, arrival -> first token, summed over the attempts' prefills
    kv_transfer_ms: float = 0.0  # the KV's landing time on the decode worker, summed over its pieces
    kv_transfer_bytes: int = 0
    migrations: int = 0  # moves to another worker after a failure
    cached_tokens: int = 0  # context tokens whose KV the prefix cache supplied (not computed again)
    kv_cached_blocks: int = 0  # leading KV blocks the decode worker already held (not sent)
    kv_wait_ms: float = 0.0  # the time to the first token: waiting for KV capacity,
    prefill_queue_ms: float = 0.0  # for a prefill slot or behind other prompts,
    prefill_compute_ms: float = 0.0  # computing the prompt
    token_steps: str = ""  # one protocol.telemetry.TokenKind letter per output token
