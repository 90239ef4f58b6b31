"""Every router -> worker call goes through `call`: a deadline, and failures sorted by
`RAY_FAILURES`, the one table of what each Ray error (or a deadline) means for the worker and the
request (docs/architecture.md, "The request lifecycle under failure", shows it). The first row
whose class the error is an instance of decides, so every class comes before its bases.

For a request's call (`call`): INTERNAL -> `InternalError`; MIGRATE -> `Retry` (the request
moves); RETRY -> `Retry`, and w takes no new request for a while (the call may or may not have
run on w, so it is not sent again as it was); REPLACE -> `Retry(worker=w)`: the pool kills and
replaces w, and every request on it moves. The monitor's own calls: router/pools/monitor.py.
"""

from __future__ import annotations

import enum

import ray

from prefill_worker.errors import PrefillFailed
from protocol.deadline import within
from router.lifecycle.outcomes import InternalError, Retry
from router.pools.worker_view import WorkerView


class Outcome(enum.Enum):
    RETRY = "retry the call"            # a blip: the worker stays (suspected for a while)
    MIGRATE = "migrate the request"     # this call failed, not the worker
    REPLACE = "replace the worker"      # the worker is gone: killed, replaced, its requests move
    INTERNAL = "internal error"         # the same request fails on any worker: no retry


RAY_FAILURES: tuple[tuple[type[BaseException], Outcome], ...] = (
    # the engine failed on this request; Ray raises RayTaskError(PrefillFailed), an instance of both
    (PrefillFailed, Outcome.INTERNAL),
    # w's own code raised; a peer's death seen from inside w, RayTaskError(ActorDiedError), is not w's
    (ray.exceptions.RayTaskError, Outcome.MIGRATE),
    (ray.exceptions.ActorUnavailableError, Outcome.RETRY),  # a RayActorError, but transient: the actor lives
    (ray.exceptions.RayActorError, Outcome.REPLACE),  # ActorDiedError: the actor is dead
    (ray.exceptions.NodeDiedError, Outcome.REPLACE),  # its node is gone, and the actor with it
    (ray.exceptions.WorkerCrashedError, Outcome.REPLACE),  # its process died while running the call
    (ray.exceptions.OutOfMemoryError, Outcome.REPLACE),  # Ray's memory monitor killed its process
    (TimeoutError, Outcome.RETRY),  # no answer within the deadline (GetTimeoutError too)
    (ray.exceptions.TaskCancelledError, Outcome.MIGRATE),  # the call was cancelled, not the worker
    (ray.exceptions.ObjectLostError, Outcome.MIGRATE),  # the reply was lost (OwnerDiedError, ...)
    (ray.exceptions.RayError, Outcome.MIGRATE),  # any other: the request moves; stats judge the worker
)
CALL_FAILURES = (TimeoutError, ray.exceptions.RayError)  # what a worker call raises; every one has a row


def outcome(err: BaseException) -> Outcome:
    """The outcome of the first row of RAY_FAILURES that `err` (one of CALL_FAILURES) is an instance of."""
    return next(out for kind, out in RAY_FAILURES if isinstance(err, kind))


async def call(w: WorkerView, ref, timeout_s: float, what: str):
    """`ref`'s result within `timeout_s`; a failure raises `InternalError` or `Retry` (see above)."""
    try:
        return await within(ref, timeout_s)
    except CALL_FAILURES as e:
        raise failure(w, e, timeout_s, what) from None


def failure(w: WorkerView, err: BaseException, timeout_s: float, what: str) -> Exception:
    """What `call` raises when `what` on `w` failed with `err`; marks w suspect on a RETRY."""
    out = outcome(err)
    if out is Outcome.INTERNAL:
        return InternalError(str(_cause(err)))
    if out is Outcome.REPLACE:
        return Retry(f"{w.name} died during its {what}() call: {short(err)}", worker=w)
    if out is Outcome.RETRY:
        w.suspect()
        if isinstance(err, TimeoutError):
            return Retry(f"{what} on {w.name} timed out after {timeout_s:g} s")
    return Retry(f"{what} on {w.name} failed: {short(_cause(err))}", failed_on=w.name)


def _cause(err: BaseException) -> BaseException:
    """What the worker's own code raised, for a RayTaskError; else the error itself."""
    return err.cause if isinstance(err, ray.exceptions.RayTaskError) else err


def short(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[-1] if text else type(err).__name__
