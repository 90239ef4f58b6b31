"""Maps the public gRPC messages (proto/pdserve.proto) onto the router's internal types and back.

Presence matters on the way in: an unset optional field takes the documented default, a set one
is passed through as given, so `SamplingParams.validate` refuses an explicit out-of-range value
(max_tokens 0, top_p 0) instead of it silently becoming the default.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

from proto import pdserve_pb2 as pb
from protocol.sampling import SamplingParams
from protocol.usage import Usage

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


def sampling_from_proto(s: pb.SamplingParams, cache_salt: str = "") -> SamplingParams:
    """`cache_salt`: the GenerateRequest's (it travels with the sampling params inside pdserve)."""
    return SamplingParams(
        max_tokens=_given(s, "max_tokens"), temperature=_given(s, "temperature"), top_p=_given(s, "top_p"),
        top_k=_given(s, "top_k"), seed=_given(s, "seed"), stop=tuple(s.stop),
        stop_token_ids=tuple(s.stop_token_ids), ignore_eos=s.ignore_eos, cache_salt=cache_salt)


def usage_to_proto(u: Usage) -> pb.Usage:
    """Field for field: `Usage` has the proto's fields by name (tests/test_proto.py checks every one)."""
    return pb.Usage(**dataclasses.asdict(u))


def autoscale_to_proto(autoscaler, now: float) -> pb.AutoscaleStatus:
    """The autoscaler's last decision and its next evaluation (`autoscaler` None: off)."""
    if autoscaler is None:
        return pb.AutoscaleStatus(enabled=False)
    msg = pb.AutoscaleStatus(enabled=True, last_decision_age_s=-1.0, scaling_actions=autoscaler.scaling_actions,
                             next_evaluation_in_s=max(0.0, (autoscaler.next_at or now) - now))
    if autoscaler.decisions:
        last = autoscaler.decisions[-1]
        msg.last_decision_age_s, msg.reason = now - last.at, last.reason
        msg.pools.extend(pb.AutoscalePool(pool=p.pool, desired=p.desired, actual=p.actual, cause=p.cause)
                         for p in last.pools.values())
    return msg


def pool_status_to_proto(p: PoolView) -> pb.PoolStatus:
    return pb.PoolStatus(pool=p.pool, target=p.target, ready=p.ready, starting=p.starting, restarts=p.restarts,
                         last_failure=p.last_failure, last_failure_age_s=p.last_failure_age_s)
