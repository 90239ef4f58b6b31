"""Maps the public gRPC messages (proto/pdserve.proto) onto the router's internal types and back.

Presence matters on the way in: an unset optional field takes the documented default, a set one
is passed through as given, so `SamplingParams.validate` refuses an explicit out-of-range value
(max_tokens 0, top_p 0) instead of it silently becoming the default.
"""

from __future__ import annotations

from typing import Any, Protocol

from proto import pdserve_pb2 as pb
from protocol.sampling import SamplingParams

_DEFAULTS = SamplingParams()  # the documented defaults: max_tokens 16, greedy, top_p 1, top_k off


class PoolView(Protocol):
    pool: str
    target: int
    ready: int
    starting: int
    restarts: int
    last_failure: str
    last_failure_age_s: float


def _given(s: pb.SamplingParams, name: str) -> Any:
    return getattr(s, name) if s.HasField(name) else getattr(_DEFAULTS, name)


def sampling_from_proto(s: pb.SamplingParams) -> SamplingParams:
    return SamplingParams(
        max_tokens=_given(s, "max_tokens"), temperature=_given(s, "temperature"), top_p=_given(s, "top_p"),
        top_k=_given(s, "top_k"), seed=_given(s, "seed"), stop=tuple(s.stop),
        stop_token_ids=tuple(s.stop_token_ids), ignore_eos=s.ignore_eos)


def usage_to_proto(u: dict) -> pb.Usage:
    return pb.Usage(prompt_tokens=u.get("prompt_tokens", 0), completion_tokens=u.get("completion_tokens", 0),
                    ttft_ms=u.get("ttft_ms", 0.0), queue_ms=u.get("queue_ms", 0.0),
                    prefill_worker=u.get("prefill_worker", ""), decode_worker=u.get("decode_worker", ""),
                    prefill_ms=u.get("prefill_ms", 0.0), kv_transfer_ms=u.get("kv_transfer_ms", 0.0),
                    kv_transfer_bytes=u.get("kv_transfer_bytes", 0), migrations=u.get("migrations", 0),
                    cached_tokens=u.get("cached_tokens", 0), kv_cached_blocks=u.get("kv_cached_blocks", 0),
                    kv_wait_ms=u.get("kv_wait_ms", 0.0), prefill_queue_ms=u.get("prefill_queue_ms", 0.0),
                    prefill_compute_ms=u.get("prefill_compute_ms", 0.0), token_steps=u.get("token_steps", ""))


def pool_status_to_proto(p: PoolView) -> pb.PoolStatus:
    return pb.PoolStatus(pool=p.pool, target=p.target, ready=p.ready, starting=p.starting, restarts=p.restarts,
                         last_failure=p.last_failure, last_failure_age_s=p.last_failure_age_s)
