"""The router's core, independent of gRPC: validate, place, stream, cancel, scale, report.

`Router.generate` is an async iterator of `Chunk`s for one request. Disaggregated: reserve
KV blocks on a decode worker (FIFO wait when none fits; bounded), prefill on the prefill
worker with the shortest queue, stream its first token, then the decode worker's tokens.
Colocated: the decode-pool worker with the most free blocks does both stages. Tokens from a
decode worker arrive through one long-poll per worker carrying every request's new tokens.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator

import ray
from transformers import AutoConfig, AutoTokenizer

from engine.request import InvalidRequest, RequestOutput, SamplingParams
from engine.validation import RequestValidator
from router.config import ClusterConfig
from router.metrics import RouterMetrics
from router.placement import WorkerView, decode_candidates, pick_prefill
from router.pool import PoolManager
from router.stream import Chunk, QueueFull, Stream, Unavailable, merge_outputs

log = logging.getLogger(__name__)


class Router:
    def __init__(self, config: ClusterConfig, metrics: RouterMetrics | None = None):
        self.config = config
        self.metrics = metrics or RouterMetrics()
        hf = AutoConfig.from_pretrained(config.model.path)
        self.tokenizer = AutoTokenizer.from_pretrained(config.model.path)
        self.validator = RequestValidator(self.tokenizer, hf.vocab_size,
                                          config.model.max_model_len or hf.max_position_embeddings)
        self.pools = PoolManager(config)
        self.pools.on_started = self._on_worker_started
        self.streams: dict[str, Stream] = {}
        self.accepting = False
        self.requests_total = 0
        self._ids = itertools.count()
        self._placement_lock = asyncio.Lock()  # FIFO: the head of the queue places first
        self._capacity = asyncio.Event()
        self._waiting = 0
        self._tasks: set[asyncio.Task] = set()

    # ---- lifecycle ------------------------------------------------------------------
    async def start(self) -> None:
        await self.pools.start()
        self._spawn(self._stats_loop())
        self.accepting = True

    async def stop(self, grace_s: float) -> None:
        """Stop accepting, let in-flight requests finish within `grace_s`, fail the rest, stop workers."""
        self.accepting = False
        deadline = time.monotonic() + grace_s
        while self.streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for stream in list(self.streams.values()):
            stream.queue.put_nowait(Unavailable("the server is shutting down"))
        await self.pools.stop_all()
        for task in self._tasks:
            task.cancel()

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _on_worker_started(self, view: WorkerView) -> None:
        if view.info.pool == "decode":
            self._spawn(self._poll_loop(view))
        self._capacity.set()

    # ---- request path -----------------------------------------------------------------
    def prepare(self, request_id: str, prompt: str | None, prompt_token_ids: list[int] | None,
                sampling: SamplingParams) -> tuple[str, list[int]]:
        """Validate a request (raises InvalidRequest / Unavailable); returns its id and prompt ids."""
        if not self.accepting:
            raise Unavailable("the server is shutting down" if self.requests_total else "the server is starting")
        ids = self.validator.prompt_ids(prompt, prompt_token_ids)
        decode = self.pools.ready("decode")
        if not decode or (self.config.mode == "disaggregated" and not self.pools.ready("prefill")):
            raise Unavailable("no worker is available in the prefill or decode pool")
        self.validator.check(len(ids), sampling, max(w.info.num_blocks for w in decode), decode[0].info.block_size)
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.streams:
            raise InvalidRequest(f"request id {request_id!r} is already in flight")
        return request_id, ids

    async def generate(self, request_id: str, prompt_ids: list[int], sampling: SamplingParams) -> AsyncIterator[Chunk]:
        stream = Stream(request_id, len(prompt_ids), time.perf_counter())
        self.streams[request_id] = stream
        self.requests_total += 1
        holders: list[WorkerView] = []
        finished = False
        try:
            if self.config.mode == "colocated":
                await self._start_colocated(stream, prompt_ids, sampling, holders)
            else:
                first, started = await self._start_disaggregated(stream, prompt_ids, sampling, holders)
                yield first  # before the decode worker confirms `start`: that round trip is not TTFT
                if first.finish_reason is not None:
                    finished = True
                    return
                await started
            async for chunk in self._drain(stream):
                finished = chunk.finish_reason is not None
                yield chunk
        except ray.exceptions.RayError as e:
            raise Unavailable(f"a worker failed while serving the request: {_short(e)}") from None
        finally:
            self.streams.pop(request_id, None)
            for w in holders:
                w.inflight.discard(request_id)
                if not finished:  # cancelled or failed: free its blocks everywhere, now
                    w.actor.abort.remote(request_id)
            self._capacity.set()

    async def _start_colocated(self, stream: Stream, prompt_ids, sampling, holders) -> None:
        # the queue here: accepted requests that have no first token yet
        if sum(s.first_token_at is None for s in self.streams.values()) > self.config.router.max_queue:
            raise QueueFull(f"the router queue is full ({self.config.router.max_queue} requests waiting)")
        ready = decode_candidates(self.pools.ready("decode"))
        if not ready:
            raise Unavailable("the decode pool has no ready worker")
        w = ready[0]
        w.inflight.add(stream.request_id)
        holders.append(w)
        stream.usage["decode_worker"] = w.name
        stream.usage["queue_ms"] = 0.0
        await w.actor.generate.remote(stream.request_id, prompt_ids, sampling)

    async def _start_disaggregated(self, stream: Stream, prompt_ids, sampling, holders):
        """Reserve, prefill, hand over to decode; the first chunk and the pending `start` call."""
        decode, waited = await self._reserve(stream, len(prompt_ids) + 1)
        holders.append(decode)
        stream.usage["queue_ms"] = waited * 1e3
        self.metrics.observe_queue(waited)
        prefill = pick_prefill(self.pools.ready("prefill"))
        if prefill is None:
            raise Unavailable("the prefill pool has no ready worker")
        prefill.inflight.add(stream.request_id)
        holders.append(prefill)
        stream.usage.update(decode_worker=decode.name, prefill_worker=prefill.name)
        # the actor handle travels once per pair; the prefill worker keeps it
        handle = None if decode.name in prefill.peers else decode.actor
        try:
            res = await prefill.actor.prefill.remote(stream.request_id, prompt_ids, sampling, decode.name, handle)
        except ray.exceptions.RayActorError as e:
            self._worker_failed(prefill, e)
            raise Unavailable(f"prefill worker {prefill.name} died: {_short(e)}") from None
        except ray.exceptions.RayError as e:
            raise Unavailable(f"prefill on {prefill.name} failed: {_short(e)}") from None
        prefill.peers.add(decode.name)
        prefill.inflight.discard(stream.request_id)
        holders.remove(prefill)
        stream.usage["prefill_ms"] = res.prefill_s * 1e3
        self.metrics.observe_prefill(res.prefill_s)
        finish = None if res.finish_reason == "prefilled" else res.finish_reason
        started = None
        if finish is None:
            started = decode.actor.start.remote(stream.request_id, prompt_ids, sampling, res.token_id)
        else:
            decode.actor.abort.remote(stream.request_id)  # frees the reservation
            decode.inflight.discard(stream.request_id)
            holders.remove(decode)
        return self._chunk(stream, RequestOutput(stream.request_id, [res.token_id], res.text, finish)), started

    async def _reserve(self, stream: Stream, num_tokens: int) -> tuple[WorkerView, float]:
        """Reserve blocks on the best decode worker, waiting FIFO (bounded) while none fits.
        Returns the worker and the seconds spent waiting for capacity (0 when it fit at once)."""
        if self._waiting >= self.config.router.max_queue:
            raise QueueFull(f"the router queue is full ({self.config.router.max_queue} requests waiting)")
        self._waiting += 1
        waited_since = None
        try:
            async with self._placement_lock:
                while True:
                    w = await self._try_reserve(stream.request_id, num_tokens)
                    if w is not None:
                        return w, (time.perf_counter() - waited_since) if waited_since else 0.0
                    if not self.accepting:
                        raise Unavailable("the server is shutting down")
                    waited_since = waited_since or time.perf_counter()
                    self._capacity.clear()
                    try:
                        await asyncio.wait_for(self._capacity.wait(), timeout=0.25)
                    except TimeoutError:
                        await self._refresh_stats()
        finally:
            self._waiting -= 1

    async def _try_reserve(self, request_id: str, num_tokens: int) -> WorkerView | None:
        decode = self.pools.ready("decode")
        if not decode:
            raise Unavailable("the decode pool has no ready worker")
        needed = -(-num_tokens // decode[0].info.block_size)
        for w in decode_candidates(decode, needed):
            blocks = await w.actor.reserve.remote(request_id, num_tokens)
            if blocks is not None:
                w.free_blocks -= len(blocks)
                w.inflight.add(request_id)
                return w
            w.free_blocks = min(w.free_blocks, needed - 1)
        return None

    async def _drain(self, stream: Stream) -> AsyncIterator[Chunk]:
        while True:
            items = [await stream.queue.get()]
            while not stream.queue.empty():  # the client was slower than decode: one message
                items.append(stream.queue.get_nowait())
            for item in items:
                if isinstance(item, Exception):
                    raise item
                if item.finish_reason == "error":
                    raise Unavailable(item.text)
            chunk = self._chunk(stream, merge_outputs(items))
            yield chunk
            if chunk.finish_reason is not None:
                return

    def _chunk(self, stream: Stream, out: RequestOutput) -> Chunk:
        now = time.perf_counter()
        n = len(out.token_ids)
        if n and stream.first_token_at is None:
            stream.first_token_at = now
            self.metrics.observe_first_token(now - stream.accepted)
            n_gaps = n - 1
        else:
            n_gaps = n
        if n_gaps and stream.last_token_at is not None:
            self.metrics.observe_token(now - stream.last_token_at)
            for _ in range(n_gaps - 1):
                self.metrics.observe_token(0.0)
        if n:
            stream.last_token_at = now
        stream.completion_tokens += n
        usage = None
        if out.kv_transfer_bytes:
            self.metrics.observe_kv_transfer(out.kv_transfer_s, out.kv_transfer_bytes)
            stream.usage.update(kv_transfer_ms=out.kv_transfer_s * 1e3, kv_transfer_bytes=out.kv_transfer_bytes)
        if out.finish_reason is not None:
            self.metrics.observe_finish(out.finish_reason, now - stream.accepted)
            usage = dict(stream.usage, prompt_tokens=stream.num_prompt_tokens,
                         completion_tokens=stream.completion_tokens,
                         ttft_ms=((stream.first_token_at or now) - stream.accepted) * 1e3)
        return Chunk(out.token_ids, out.text, out.finish_reason, usage)

    # ---- background loops ----------------------------------------------------------
    async def _poll_loop(self, w: WorkerView) -> None:
        while w.state != "stopped":
            try:
                outputs = await w.actor.poll.remote(0.5)
            except ray.exceptions.RayError as e:
                if w.state != "stopped":
                    self._worker_failed(w, e)
                return
            for out in outputs:
                stream = self.streams.get(out.request_id)
                if stream is not None:
                    stream.queue.put_nowait(out)
                if out.finished:
                    w.inflight.discard(out.request_id)
                    self._capacity.set()

    def _worker_failed(self, w: WorkerView, err: Exception) -> None:
        log.error("%s failed: %s", w.name, _short(err))
        for rid in list(w.inflight):
            stream = self.streams.get(rid)
            if stream is not None:
                stream.queue.put_nowait(Unavailable(f"worker {w.name} failed: {_short(err)}"))
        w.state = "stopped"
        if w in self.pools.workers[w.info.pool]:
            self.pools.workers[w.info.pool].remove(w)
        self.metrics.remove_worker(w.name)

    async def _stats_loop(self) -> None:
        while True:
            await self._refresh_stats()
            await asyncio.sleep(0.5)

    async def _refresh_stats(self) -> None:
        workers = [w for w in self.pools.all() if w.state != "stopped"]
        results = await asyncio.gather(*(w.actor.stats.remote() for w in workers), return_exceptions=True)
        for w, stats in zip(workers, results, strict=True):
            if isinstance(stats, BaseException):
                continue
            w.observe(stats)
            self.metrics.set_worker_gauges(w.name, stats.running, stats.waiting, stats.blocks_used, stats.blocks_free)
        self.metrics.set_router_queue(self._waiting)

    # ---- admin ----------------------------------------------------------------------
    async def status(self) -> list[WorkerView]:
        await self._refresh_stats()
        return [w for w in self.pools.all() if w.state != "stopped"]

    async def scale(self, pool: str, replicas: int) -> tuple[list[str], list[str]]:
        if pool == "prefill" and self.config.mode == "colocated":
            raise InvalidRequest("colocated mode has no prefill pool; scale the decode pool")
        if replicas < 1:
            raise InvalidRequest(f"a pool needs at least 1 worker, got {replicas}")
        started, stopped = await self.pools.scale(pool, replicas)
        for name in stopped:
            self.metrics.remove_worker(name)
        self._capacity.set()
        return started, stopped

    @property
    def queue_length(self) -> int:
        return self._waiting


def _short(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[-1] if text else type(err).__name__
