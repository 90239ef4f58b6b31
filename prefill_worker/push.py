"""The prefill side of the KV hand-off: a request's blocks go to its decode worker as pieces,
each one transfer with its own first_block, in order on the pair's channel.

Streamed (kv_transfer.stream_chunks): after every engine step the full blocks a prefill-only
request has filled leave at once while its next chunk computes; the rest (the last, partial
block included) once its first token is sampled. Not streamed: all of it then, in one piece.
A stream opened before its decode reservation came back (skip_blocks None) cuts nothing until
`aim` says how many leading blocks the decode side holds (and, when the decode worker was chosen
after the prefill, which one); the computing goes on meanwhile, and a prefilled request's blocks
stay held. Ray does not keep an async actor's calls in order, so an `aim` may come before its
prefill has opened the stream: it is kept (worker_runtime/tombstones.py) and taken when it opens.
Everything here runs on the engine loop thread (`after_step`, and `loop.call` for a piece's
end), so it reads the engine directly. A piece's blocks are pinned (engine.pin) from its cut
until its send ended: a preemption, abort or finish never frees blocks on the wire. A stream
ends once its request has left the running batch and no piece is in flight; the request's
blocks are released then. The first failure stops the stream and is reported once via
`on_failed`; a request that ended without a hand-off (stopped at its first token, aborted) is
abandoned: nothing more is sent and its failures are not reported.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from engine.llm_engine import LLMEngine
from engine.request import Status
from kv_transfer import KVSender
from worker_runtime.engine_loop import EngineLoop
from worker_runtime.faults import Faults
from worker_runtime.tombstones import Tombstones

log = logging.getLogger(__name__)
OnFailed = Callable[[str, str, str], None]  # (request id, decode worker, reason), once per stream


@dataclass
class KVStream:
    request_id: str
    decode_name: str | None  # None: not chosen yet (`aim` names it)
    next_block: int | None  # the first block of the request not yet cut into a piece; None: not aimed yet
    in_flight: int = 0  # pieces cut whose send has not ended (held back or on the wire)
    complete: bool = False  # no piece will be cut any more
    abandoned: bool = False  # the request ended without a hand-off: failures are quiet
    error: str | None = None
    held: deque[tuple[int, list[int]]] = field(default_factory=deque)  # (first_block, ids) behind a delay


class KVPusher:
    def __init__(self, loop: EngineLoop, sender: KVSender, faults: Faults, stream_chunks: bool,
                 on_failed: OnFailed, on_ended: Callable[[str], None]) -> None:
        """`on_ended(request id)`: a hand-off's last piece ended (landed or not)."""
        self._loop = loop
        self._sender = sender
        self._faults = faults
        self._stream_chunks = stream_chunks
        self._on_failed = on_failed
        self._on_ended = on_ended
        self._streams: dict[str, KVStream] = {}  # loop thread only
        # id -> (skip_blocks, decode worker) of an aim that found no stream; one never opened expires
        self._early_aims: Tombstones[tuple[int, str | None]] = Tombstones()

    def open(self, request_id: str, decode_name: str | None, skip_blocks: int | None) -> None:
        """Loop thread, right after the request was added: `skip_blocks` the decode side holds
        (None: not known yet; `aim` tells it, or told it already)."""
        stream = KVStream(request_id, decode_name, skip_blocks)
        aimed = self._early_aims.pop(request_id)
        if skip_blocks is None and aimed is not None:
            stream.next_block, stream.decode_name = aimed[0], aimed[1] or decode_name
        self._streams[request_id] = stream

    def aim(self, e: LLMEngine, request_id: str, skip_blocks: int, decode_name: str | None = None) -> bool:
        """Loop thread: the decode side (`decode_name`, when the stream has none yet) holds the
        first `skip_blocks` blocks; what is ready leaves now (all of it if the prefill is already
        done). No stream: kept for when it opens (the prefill call has not reached the engine
        yet). False if the stream was abandoned (aborted)."""
        stream = self._streams.get(request_id)
        if stream is None:
            self._early_aims.add(request_id, (skip_blocks, decode_name))
            return True
        if stream.abandoned:
            return False
        if stream.next_block is None:
            stream.decode_name = decode_name or stream.decode_name
            assert stream.decode_name is not None, f"{request_id} was aimed at no decode worker"
            stream.next_block = skip_blocks
            self.after_step(e)
        return True

    def expire(self, e: LLMEngine, request_id: str) -> bool:
        """Loop thread: drop the request if its KV still waits for an `aim` (its hold ran out);
        True if it did. Nothing was sent, so nothing is reported."""
        stream = self._streams.get(request_id)
        if stream is None or stream.next_block is not None:
            return False
        self.abandon(e, request_id)
        e.abort(request_id)
        return True

    def abandon(self, e: LLMEngine, request_id: str) -> None:
        """Loop thread: the request was cancelled; send nothing more, report nothing."""
        self._early_aims.pop(request_id)
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.abandoned = stream.complete = True
            self._maybe_end(e, stream)

    def after_step(self, e: LLMEngine) -> None:
        for stream in list(self._streams.values()):
            if not stream.complete:
                self._advance(e, stream)
            self._maybe_end(e, stream)

    def _advance(self, e: LLMEngine, stream: KVStream) -> None:
        req = e.requests.get(stream.request_id)
        if req is not None and stream.next_block is None:  # not aimed yet: its blocks wait
            return
        if req is None:  # ended without a hand-off: stopped at its first token, failed, aborted
            stream.abandoned = stream.complete = True
        elif req.status is Status.FINISHED:  # prefilled: the rest, the partial block included
            self._cut(e, stream, len(req.block_ids), req.block_ids)
            stream.complete = True
        elif self._stream_chunks and req.status is Status.RUNNING:
            full = min(req.num_computed_tokens // e.config.block_size, len(req.block_ids))
            self._cut(e, stream, full, req.block_ids)

    def _cut(self, e: LLMEngine, stream: KVStream, end: int, block_ids: list[int]) -> None:
        """A piece of blocks [next_block, end), if there is one and the stream has not failed."""
        if end <= stream.next_block or stream.error is not None:
            return
        first, ids = stream.next_block, list(block_ids[stream.next_block:end])
        stream.next_block = end
        e.pin(ids)
        stream.in_flight += 1
        if self._faults.fail_transfer():
            self._piece_ended(e, stream, ids, "injected transfer failure")
            return
        stream.held.append((first, ids))
        delay = self._faults.transfer_delay()
        if delay:  # a slow link: this piece and every later one wait (order is kept)
            timer = threading.Timer(delay, self._loop.call, (lambda e: self._release_held(e, stream, force=True),))
            timer.daemon = True
            timer.start()
        elif len(stream.held) == 1:
            self._release_held(e, stream)

    def _release_held(self, e: LLMEngine, stream: KVStream, force: bool = False) -> None:
        """Hand the held pieces to the sender, in order; only `force` (a delay's end) may pass a
        piece that waits behind a delay."""
        if not force and len(stream.held) > 1:
            return
        while stream.held:
            first, ids = stream.held.popleft()
            self._send(e, stream, first, ids)

    def _send(self, e: LLMEngine, stream: KVStream, first: int, ids: list[int]) -> None:
        if stream.error is not None or stream.abandoned:  # nothing of it will be used
            self._piece_ended(e, stream, ids, None)
            return
        try:
            fut = self._sender.send(stream.decode_name, stream.request_id, ids, first_block=first)
        except ValueError as err:
            self._piece_ended(e, stream, ids, str(err))
            return
        fut.add_done_callback(lambda f: self._loop.call(lambda e: self._sent(e, stream, ids, f)))

    def _sent(self, e: LLMEngine, stream: KVStream, ids: list[int], fut: Future) -> None:
        err = fut.exception()
        self._piece_ended(e, stream, ids, None if err is None else str(err))
        self._maybe_end(e, stream)

    def _piece_ended(self, e: LLMEngine, stream: KVStream, ids: list[int], error: str | None) -> None:
        e.unpin(ids)
        stream.in_flight -= 1
        if error is None or stream.error is not None:
            return
        stream.error = error
        if not stream.abandoned:
            log.warning("KV transfer of %s to %s failed: %s", stream.request_id, stream.decode_name, error)
            self._on_failed(stream.request_id, stream.decode_name, error)

    def _maybe_end(self, e: LLMEngine, stream: KVStream) -> None:
        if not stream.complete or stream.in_flight or self._streams.get(stream.request_id) is not stream:
            return
        del self._streams[stream.request_id]
        e.release(stream.request_id)  # the blocks a prefilled request kept; a no-op otherwise
        if not stream.abandoned:
            self._on_ended(stream.request_id)
