"""The router's core, independent of gRPC: accept, run each request's life, scale, report.

`prepare` validates a request off the event loop (tokenizing can be slow) and returns its
`RequestLife`; `generate` is the async iterator of `Chunk`s for it. Each request runs as a
series of attempts (router/lifecycle/attempt.py); an attempt that fails in a way another worker may
not (a worker died, a transfer failed, a lease ended, a call timed out) moves the request —
prompt + tokens already streamed are prefilled again — up to `router.migration_limit` times,
so the client sees one uninterrupted stream. Cancelled or failed: every worker that may
hold state of the request gets an `abort` (with a deadline). Background watch: router/pools/monitor.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import itertools
import logging
import secrets
from collections.abc import AsyncIterator, Callable

from transformers import AutoConfig, AutoTokenizer

from protocol import clock
from protocol.deadline import within
from protocol.errors import InvalidRequest
from protocol.outputs import FinishReason
from protocol.sampling import SamplingParams
from protocol.validation import RequestValidator, validate_request_id
from router.autoscale.loop import Autoscaler
from router.config.schema import ClusterConfig
from router.lifecycle.admission import Admission
from router.lifecycle.attempt import Attempts
from router.lifecycle.intake import Intake
from router.lifecycle.life import Phase, RequestLife
from router.lifecycle.outcomes import CannotPlace, Chunk, Respin, Retry, Unavailable
from router.lifecycle.worker_calls import short
from router.observability.metrics import RouterMetrics
from router.observability.request_log import RequestLog
from router.pools.actors import Actors
from router.pools.manager import PoolManager
from router.pools.monitor import Monitor
from router.pools.worker_view import WorkerView

log = logging.getLogger(__name__)


class Router:
    def __init__(self, config: ClusterConfig, metrics: RouterMetrics | None = None, actors: Actors | None = None,
                 validator: RequestValidator | None = None, nonce: Callable[[], str] | None = None):
        """`actors` starts the workers (default: Ray actors); `validator` checks requests (default: the
        checkpoint's tokenizer and limits); `nonce` makes the unguessable part of attempt ids.
        `pdserve simulate` passes its own three (simulate/cluster.py)."""
        self.config = config
        self.metrics = metrics or RouterMetrics()
        if validator is None:
            hf = AutoConfig.from_pretrained(config.model.path)
            validator = RequestValidator(AutoTokenizer.from_pretrained(config.model.path), hf.vocab_size,
                                         config.model.max_model_len or hf.max_position_embeddings,
                                         config.router.max_prompt_bytes)
        self.validator = validator
        self.tokenizer = validator.tokenizer
        self._nonce = nonce or (lambda: secrets.token_hex(16))
        self.intake = Intake(self.validator, config.router.max_preparing, config.router.tokenizer_threads)
        self.pools = PoolManager(config, actors)
        self.request_log = RequestLog.open(config.router)  # None unless router.request_log is set
        self.admission = Admission(config.router.max_queue, self.metrics.set_router_queue)
        self.lives: dict[int, RequestLife] = {}
        self._client_ids: set[tuple[str, str]] = set()  # (caller, request id): each caller its own ids
        self.accepting = False
        self.started = False  # the pools started once: not accepting now means shutting down
        self.requests_total = 0
        self._keys = itertools.count()
        self.attempts = Attempts(config, self.pools, self.admission, self.metrics, lambda: self.accepting)
        self.monitor = Monitor(self.pools, self.metrics, config.router.call_timeout_s, config.router.unresponsive_s,
                               self._deliver, self._holding, self.admission.notify)
        self.pools.on_started = self.monitor.watch
        self.pools.on_drain_timeout = lambda w: self.monitor.move_requests(w, f"worker {w.name} is leaving")
        # the SLO planner (router/autoscale/), when router.autoscale.enabled; runs from start() to stop()
        self.autoscaler = Autoscaler(self) if config.router.autoscale.enabled else None

    # ---- lifecycle ------------------------------------------------------------------
    async def start(self) -> None:
        await self.pools.start()
        self.monitor.start()
        if self.autoscaler is not None:
            self.autoscaler.start()
        self.accepting = self.started = True

    async def stop(self, grace_s: float) -> None:
        """Stop accepting, let in-flight requests finish within `grace_s`, fail the rest, stop workers."""
        self.accepting = False
        deadline = clock.now() + grace_s
        while self.lives and clock.now() < deadline:
            await asyncio.sleep(0.05)
        for life in list(self.lives.values()):
            life.deliver(life.attempt_id, Unavailable("the server is shutting down"))
        if self.autoscaler is not None:
            self.autoscaler.stop()
        self.monitor.stop()
        await self.pools.stop_all()
        self.intake.shutdown()
        if self.request_log is not None:
            self.request_log.close()

    @property
    def serving(self) -> bool:
        """Every pool the mode needs has a ready worker (the health service says SERVING)."""
        pools = ("decode",) if self.config.mode == "colocated" else ("prefill", "decode")
        return self.accepting and all(self.pools.ready(p) for p in pools)

    # ---- request path -----------------------------------------------------------------
    def check_open(self) -> None:
        """Unavailable unless the router takes requests: before its pools have started, or once it is
        shutting down."""
        if not self.accepting:
            raise Unavailable("the server is shutting down" if self.started else "the server is starting")

    async def prepare(self, request_id: str, prompt: str | None, prompt_token_ids: list[int] | None,
                      sampling: SamplingParams, messages: list[dict] | None = None, caller: str = "",
                      add_special_tokens: bool | None = None) -> RequestLife:
        """Validate a request (raises InvalidRequest / Unavailable) and accept it. `messages`: a chat
        ([{"role": ..., "content": ...}]) rendered with the checkpoint's chat template. `caller`
        (router/frontdoor/access.py `caller_id`): the namespace of its request id, and with
        router.auth.isolate_prefix_cache of its prefix-cache blocks. `add_special_tokens`: see
        RequestValidator.prompt_ids (None: a text prompt gets its BOS, a chat not)."""
        self.check_open()
        validate_request_id(request_id)
        ids = await self.intake.prompt_ids(prompt, prompt_token_ids, messages, add_special_tokens)
        return self.accept(request_id, ids, sampling, caller)

    def accept(self, request_id: str, ids: list[int], sampling: SamplingParams, caller: str = "") -> RequestLife:
        """The request's life, once its prompt is token ids the validator passed (raises InvalidRequest)."""
        self._check_fits(len(ids), sampling)
        request_id = request_id or f"req-{self._nonce()}"  # unguessable
        if (caller, request_id) in self._client_ids:
            raise InvalidRequest(f"request id {request_id!r} is already in flight")
        return RequestLife(request_id, next(self._keys), ids, self._salted(sampling, caller), clock.now(),
                           caller=caller, nonce=self._nonce())

    def _salted(self, sampling: SamplingParams, caller: str) -> SamplingParams:
        """With isolate_prefix_cache, the caller's own cache: its salt folds in who it is."""
        if not (self.config.router.auth.isolate_prefix_cache and caller):
            return sampling
        salt = hashlib.sha256(f"{caller}\0{sampling.cache_salt}".encode("utf-8", "surrogatepass")).hexdigest()
        return dataclasses.replace(sampling, cache_salt=salt)

    def _check_fits(self, num_prompt_tokens: int, sampling: SamplingParams) -> None:
        """InvalidRequest now, unless some decode worker can hold prompt + max_tokens and (disaggregated)
        some prefill worker the prompt and its next token: pools may differ in size, and each
        stage is held to what it keeps."""
        decode = self.pools.ready("decode") or self.pools.live("decode")
        if not decode:
            raise Unavailable("the decode pool has no worker")
        bs = decode[0].info.block_size
        self.validator.check(num_prompt_tokens, sampling, max(w.info.num_blocks for w in decode), bs)
        prefill = (self.pools.ready("prefill") or self.pools.live("prefill")) if self.config.mode != "colocated" else []
        if prefill:
            self.validator.check(num_prompt_tokens, sampling, max(w.info.num_blocks for w in prefill), bs,
                                 num_prompt_tokens + 1)

    async def generate(self, life: RequestLife) -> AsyncIterator[Chunk]:
        """The request's chunks; it is tracked from the first iteration until the iterator ends."""
        if life.scoped_id in self._client_ids:
            raise InvalidRequest(f"request id {life.client_id!r} is already in flight")
        self._client_ids.add(life.scoped_id)
        self.lives[life.key] = life
        self.requests_total += 1
        recent = self.metrics.recent  # the autoscaler's window (None without one)
        if recent is not None:
            recent.arrived(len(life.prompt_token_ids), life.sampling.max_tokens, life.accepted)
        try:
            while True:
                try:
                    async for chunk in self.attempts.run(life):
                        if chunk.finish_reason is not None:
                            self._finished(life, chunk)
                        yield chunk
                    self._abort_all(life.release(), life.attempt_id)
                    return
                except Retry as e:
                    self._retry(life, e)
        except BaseException as e:  # failed, or cancelled by the client (GeneratorExit / CancelledError)
            if not life.ended:  # GeneratorExit and CancelledError are not Exceptions
                phase = Phase.FAILED if isinstance(e, Exception) else Phase.CANCELLED
                self._abort_all(life.end(phase), life.attempt_id)
                if phase is Phase.CANCELLED:  # "cancelled", as a client reads it; failures: pdserve_request_errors
                    self.metrics.observe_finish(FinishReason.ABORT.public, clock.now() - life.accepted)
            raise
        finally:
            self.lives.pop(life.key, None)
            self._client_ids.discard(life.scoped_id)
            self.admission.notify()

    def _finished(self, life: RequestLife, chunk: Chunk) -> None:
        if self.request_log is not None:
            self.request_log.write(life, chunk.finish_reason, chunk.usage)
        if self.metrics.recent is not None and chunk.usage is not None:
            self.metrics.recent.finished(chunk.usage.completion_tokens)

    def _retry(self, life: RequestLife, e: Retry) -> None:
        old = life.attempt_id
        if isinstance(e, Respin):
            self._abort_all(life.retry(str(e), migrated=False), old)
            log.info("request %s is placed again (attempt %d): %s", life.client_id, life.attempt, e)
            return
        if e.worker is not None:
            self.monitor.lost(e.worker, str(e))
        if e.failed_on is not None:
            life.failed_on.add(e.failed_on)
        self._abort_all(life.retry(str(e)), old)
        self.metrics.observe_migration()
        if life.migrations > self.config.router.migration_limit:
            raise Unavailable(f"the request failed on {life.migrations} workers; last failure: {e}")
        log.info("request %s moves (attempt %d after %d tokens): %s", life.client_id, life.attempt,
                 len(life.output_token_ids), e)

    def _abort_all(self, workers: list[WorkerView], attempt_id: str) -> None:
        for w in workers:
            w.release(attempt_id)
            if not w.stopped:
                self.monitor.spawn(self._abort(w, attempt_id))

    async def _abort(self, w: WorkerView, attempt_id: str) -> None:
        try:
            await within(w.actor.abort.remote(attempt_id), self.config.router.call_timeout_s)
        except Exception as e:  # a dead worker holds nothing; a hung one is replaced by the monitor
            log.warning("abort of %s on %s failed: %s", attempt_id, w.name, short(e))

    def _deliver(self, attempt_id: str, item) -> None:
        key = attempt_id.partition(".")[0]
        life = self.lives.get(int(key)) if key.isdigit() else None
        if life is not None:
            life.deliver(attempt_id, item)

    def _holding(self, w: WorkerView) -> list[RequestLife]:
        return [life for life in self.lives.values() if w in life.holders]

    # ---- admin ----------------------------------------------------------------------
    async def status(self) -> list[WorkerView]:
        await self.monitor.refresh()
        return [w for w in self.pools.all() if not w.stopped]

    async def scale(self, pool: str, replicas: int) -> tuple[list[str], list[str]]:
        if pool == "prefill" and self.config.mode == "colocated":
            raise InvalidRequest("colocated mode has no prefill pool; scale the decode pool")
        if replicas < 1:
            raise InvalidRequest(f"a pool needs at least 1 worker, got {replicas}")
        try:
            started, stopped = await self.pools.scale(pool, replicas)
        except CannotPlace:
            raise
        except Exception as e:  # a worker that would not start: the pool keeps trying (status shows it)
            raise Unavailable(f"scaling the {pool} pool failed: {short(e)}") from None
        for name in stopped:
            self.metrics.remove_worker(name)
        self.admission.notify()
        return started, stopped

    async def change_role(self, worker: str, to_pool: str) -> str:
        """The live worker named `worker` serves `to_pool` from now on, its weights kept loaded
        (PoolManager.change_role: drained first, nothing lost); returns its new name. Raises
        InvalidRequest for an unknown worker, CannotChangeRole where the pools forbid it."""
        w = next((w for w in self.pools.all() if w.name == worker and not w.stopped), None)
        if w is None:
            raise InvalidRequest(f"no live worker is named {worker!r}")
        view = await self.pools.change_role(w, to_pool)
        self.metrics.remove_worker(worker)
        self.admission.notify()
        return view.name

    @property
    def queue_length(self) -> int:
        return self.admission.waiting
