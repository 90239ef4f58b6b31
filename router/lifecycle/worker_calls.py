"""Every router -> worker call goes through `call`: a deadline, and failures sorted by what
the request should do next.

  timed out                     Retry (the worker is skipped for a while)
  the actor died                Retry(worker=w): the pool replaces w, the request moves
                                (a RayActorError raised inside w, about a peer, is not w's death)
  the engine failed on it       InternalError: the same request would fail anywhere
  any other remote exception    Retry (e.g. a reservation that ended before `start`)
"""

from __future__ import annotations

import ray

from prefill_worker.worker import PrefillFailed
from protocol.deadline import within
from router.lifecycle.outcomes import InternalError, Retry
from router.pools.worker_view import WorkerView


async def call(w: WorkerView, ref, timeout_s: float, what: str):
    try:
        return await within(ref, timeout_s)
    except TimeoutError:
        w.suspect()
        raise Retry(f"{what} on {w.name} timed out after {timeout_s:g} s") from None
    except ray.exceptions.RayTaskError as e:  # first: a peer's death seen from inside w is not w's
        cause = getattr(e, "cause", None)
        if isinstance(cause, PrefillFailed):
            raise InternalError(str(cause)) from None
        raise Retry(f"{what} on {w.name} failed: {short(cause or e)}") from None
    except ray.exceptions.RayActorError as e:
        raise Retry(f"{w.name} died during its {what}() call: {short(e)}", worker=w) from None


def short(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[-1] if text else type(err).__name__
