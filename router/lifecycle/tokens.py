"""The tokens of an attempt on its decode (or colocated) worker, as the client's chunks: `stream`
reads the attempt's events until it finishes, `chunk` turns worker outputs into one chunk and
observes TTFT, ITL, finishes and transfers on the way (router/lifecycle/attempt.py places and
hands off; this follows what comes back).
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

from protocol import clock
from protocol.deadline import within
from protocol.outputs import FinishReason, RequestOutput
from router.lifecycle.life import Phase, RequestLife, observe_first_token
from router.lifecycle.outcomes import Chunk, InternalError, Retry, merge_outputs
from router.observability.metrics import RouterMetrics
from router.pools.placement import Placer
from router.pools.worker_view import WorkerView


class Tokens:
    def __init__(self, placer: Placer, metrics: RouterMetrics, prefill_timeout_s: float):
        self.placer = placer
        self.metrics = metrics
        self.prefill_timeout_s = prefill_timeout_s  # a stream silent this long on a worker that stepped waits on

    async def stream(self, life: RequestLife, w: WorkerView) -> AsyncIterator[Chunk]:
        """Tokens of this attempt from decode worker `w` until it finishes; failures raise."""
        while True:
            items = [await self._next_event(life, w)]
            while not life.events.empty():  # the client was slower than decode: one message
                items.append(life.events.get_nowait())
            outputs = [item for aid, item in items if aid == life.attempt_id]
            for out in outputs:
                if isinstance(out, Exception):
                    raise out
                if out.finish_reason is FinishReason.ERROR:
                    raise Retry(f"{w.name}: {out.text}", failed_on=w.name) if out.retryable else InternalError(out.text)
            if not outputs:
                continue
            for out in outputs:
                observe_first_token(life, out.step_kind, out.prefill_timing)
            if life.phase is Phase.HANDOFF:  # the KV landed: the prefill worker holds nothing now
                life.to(Phase.DECODING)
                life.prefill = None
            w.prefill_tokens.pop(life.attempt_id, None)  # a prefill here (colocated, local) is done
            if not life.output_token_ids:  # the first outputs, from this worker's own prefill
                life.usage.cached_tokens = outputs[0].num_cached_tokens
                self.metrics.observe_prefix("decode", life.num_context_tokens(), outputs[0].num_cached_tokens)
            chunk = self.chunk(life, merge_outputs(outputs))
            if chunk.finish_reason is not None:
                # the worker caches the finished context: a next turn of the conversation finds it
                self.placer.placed(w, life.context_hashes(w.info.block_size))
                life.to(Phase.FINISHED)
                life.decode = None  # a finished request freed its blocks on the worker
                w.release(life.attempt_id)
            yield chunk
            if chunk.finish_reason is not None:
                return

    async def _next_event(self, life: RequestLife, w: WorkerView):
        """The attempt's next event. Progress is judged per worker, not per request: a request
        silent for `prefill_timeout_s` on a worker whose engine stepped meanwhile is waiting its
        turn there (a saturated worker is not a stalled one) and keeps waiting; a stalled engine
        is the monitor's to find (router/pools/monitor.py), and it moves every request there."""
        steps = w.engine_steps
        while True:
            try:
                return await within(life.events.get(), self.prefill_timeout_s)
            except TimeoutError:
                if w.stopped or w.engine_steps == steps:
                    raise Retry(f"no progress from {w.name} for {self.prefill_timeout_s:g} s") from None
                steps = w.engine_steps

    def chunk(self, life: RequestLife, out: RequestOutput) -> Chunk:
        now = clock.now()
        n = len(out.token_ids)
        gaps = n
        if n and life.first_token_at is None:
            life.first_token_at = now
            self.metrics.observe_first_token(now - life.accepted)
            gaps = n - 1
        if gaps and life.last_token_at is not None:
            self.metrics.observe_token(now - life.last_token_at)
            for _ in range(gaps - 1):
                self.metrics.observe_token(0.0)
        if n:
            life.last_token_at = now
        life.record(out.token_ids, out.text)
        if out.kv_transfer_bytes:
            self.metrics.observe_kv_transfer(out.kv_transfer_s, out.kv_transfer_bytes)
            life.usage.kv_transfer_ms, life.usage.kv_transfer_bytes = out.kv_transfer_s * 1e3, out.kv_transfer_bytes
        usage = None
        if out.finish_reason is not None:
            self.metrics.observe_finish(out.finish_reason, now - life.accepted)
            usage = dataclasses.replace(life.usage, prompt_tokens=len(life.prompt_token_ids),
                                        completion_tokens=len(life.output_token_ids), migrations=life.migrations,
                                        ttft_ms=((life.first_token_at or now) - life.accepted) * 1e3)
        return Chunk(out.token_ids, out.text, out.finish_reason, usage)
