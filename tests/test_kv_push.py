"""The prefill side's KV push (prefill_worker/push.py) on a real engine, with a recording sender:
which pieces leave after which step (exact first_block and block ids), that blocks on the wire
stay pinned through a finish, an abort or a failure, and that every block is free at the end."""

from __future__ import annotations

import random
from concurrent.futures import Future

import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from prefill_worker.push import KVPusher
from protocol.outputs import FinishReason
from protocol.sampling import SamplingParams
from worker_runtime.faults import FaultConfig, Faults

RID = "r1"


class Recorder:
    """A KVSender stand-in: records each piece and hands back a future the test resolves."""

    def __init__(self) -> None:
        self.pieces: list[tuple[int, list[int], Future]] = []

    def send(self, peer_id: str, request_id: str, ids: list[int], first_block: int = 0) -> Future:
        fut: Future = Future()
        self.pieces.append((first_block, list(ids), fut))
        return fut


class DeferredLoop:
    """EngineLoop.call stand-in: calls queue up and run when the test says."""

    def __init__(self) -> None:
        self.calls = []

    def call(self, fn) -> None:
        self.calls.append(fn)

    def run(self, e: LLMEngine) -> None:
        calls, self.calls = self.calls, []
        for fn in calls:
            fn(e)


class Harness:
    def __init__(self, path: str, stream: bool = True, faults: FaultConfig | None = None) -> None:
        self.engine = LLMEngine(EngineConfig(model_path=path, dtype="float32", num_blocks=64, block_size=16, chunk_size=32,
                                             max_num_batched_tokens=32, enable_prefix_caching=False))
        self.loop, self.sender = DeferredLoop(), Recorder()
        self.failed: list[tuple[str, str]] = []
        self.ended: list[str] = []
        self.pusher = KVPusher(self.loop, self.sender, Faults(faults, "p"), stream,
                               on_failed=lambda rid, _, why: self.failed.append((rid, why)),
                               on_ended=self.ended.append)

    def add(self, n: int = 100, skip: int | None = 0) -> None:
        prompt = [random.Random(n).randrange(10, 2000) for _ in range(n)]
        self.engine.add_request(RID, prompt_token_ids=prompt, sampling=SamplingParams(max_tokens=4),
                                prefill_only=True)
        self.pusher.open(RID, "d", skip)

    def step(self) -> list:
        outs = self.engine.step()
        self.pusher.after_step(self.engine)
        self.engine.check()
        return outs

    def finish_pieces(self, error: Exception | None = None) -> None:
        for _, _, fut in self.sender.pieces:
            if not fut.done():
                fut.set_exception(error) if error else fut.set_result(None)
        self.loop.run(self.engine)
        self.engine.check()

    def firsts(self) -> list[int]:
        return [first for first, _, _ in self.sender.pieces]


@pytest.fixture
def h(llama_dir) -> Harness:
    return Harness(llama_dir)


def test_each_chunk_s_full_blocks_leave_after_its_step_the_rest_after_the_first_token(h):
    h.add(100)  # 100 tokens, chunks of 32, blocks of 16: full blocks 2, 4, 6, then 7 with the partial one
    for expected in ([0], [0, 2], [0, 2, 4]):
        assert h.step() == [] and h.firsts() == expected
    assert h.step()[0].finish_reason is FinishReason.PREFILLED and h.firsts() == [0, 2, 4, 6]
    blocks = h.engine.requests[RID].block_ids
    assert [ids for _, ids, _ in h.sender.pieces] == [blocks[0:2], blocks[2:4], blocks[4:6], blocks[6:7]]
    assert h.engine.allocator.num_used == 7 and sum(h.engine.pinned.values()) == 7
    h.finish_pieces()
    assert h.engine.allocator.num_used == 0 and not h.engine.pinned and h.ended == [RID] and not h.failed


def test_not_streamed_sends_everything_after_the_first_token(llama_dir):
    h = Harness(llama_dir, stream=False)
    h.add(100, skip=2)
    for _ in range(3):
        h.step()
    assert h.firsts() == []
    h.step()
    assert h.firsts() == [2] and len(h.sender.pieces[0][1]) == 5
    h.finish_pieces()
    assert h.engine.allocator.num_used == 0 and h.ended == [RID]


def test_a_failed_piece_stops_the_stream_and_is_reported_once(h):
    h.add(100)
    h.step()
    h.step()
    first, _, fut = h.sender.pieces[0]
    fut.set_exception(RuntimeError("connection closed"))
    h.loop.run(h.engine)
    assert h.failed == [(RID, "connection closed")]
    h.step()
    h.step()  # the first token: the prefill goes on, but no piece follows the failure
    assert h.firsts() == [0, 2]
    assert h.engine.allocator.num_used == 7  # the request's blocks wait for the piece on the wire
    h.finish_pieces(RuntimeError("rejected"))
    assert h.failed == [(RID, "connection closed")] and h.engine.allocator.num_used == 0


def test_an_injected_failure_sends_nothing(llama_dir):
    h = Harness(llama_dir, faults=FaultConfig(transfer_fail_rate=1.0))
    h.add(100)
    for _ in range(4):
        h.step()
    assert h.firsts() == [] and h.failed == [(RID, "injected transfer failure")]
    assert h.engine.allocator.num_used == 0 and h.ended == [RID]


def test_abort_mid_stream_keeps_the_blocks_on_the_wire_until_their_send_ends(h):
    h.add(100)
    h.step()
    h.step()
    h.pusher.abandon(h.engine, RID)
    h.engine.abort(RID)
    h.engine.check()
    assert h.engine.allocator.num_used == 4  # two pieces of two blocks still on the wire
    h.finish_pieces(RuntimeError("request unknown to the receiver"))
    assert h.engine.allocator.num_used == 0 and not h.failed and h.ended == []


def test_preemption_mid_stream_sends_only_blocks_not_yet_sent(h):
    h.add(100)
    h.step()
    h.step()  # blocks 0..3 sent
    req = h.engine.requests[RID]
    h.engine.scheduler._preempt(req, [])  # as the scheduler does when another request needs blocks
    h.engine.check()
    assert h.engine.allocator.num_used == 4  # only the pinned pieces
    while h.engine.requests[RID].status.value != "finished":
        h.step()
    assert h.firsts() == [0, 2, 4, 6]
    h.finish_pieces()
    assert h.engine.allocator.num_used == 0 and h.ended == [RID]


def test_a_stream_opened_before_its_reservation_sends_nothing_until_aimed(h):
    h.add(100, skip=None)  # the reservation is still in flight: the prefill computes all the same
    h.step()
    h.step()
    assert h.firsts() == []
    assert h.pusher.aim(h.engine, RID, 3)  # the decode side holds 3 blocks: what is full leaves at once
    assert h.firsts() == [3]
    assert h.pusher.aim(h.engine, RID, 0) and h.firsts() == [3]  # a second aim changes nothing
    h.step()
    assert h.step()[0].finish_reason is FinishReason.PREFILLED and h.firsts() == [3, 4, 6]
    h.finish_pieces()
    assert h.engine.allocator.num_used == 0 and h.ended == [RID] and not h.failed


def test_aimed_after_the_first_token_sends_everything_at_once(h):
    h.add(100, skip=None)
    for _ in range(3):
        h.step()
    assert h.step()[0].finish_reason is FinishReason.PREFILLED and h.firsts() == []
    assert h.engine.allocator.num_used == 7  # held for the reservation
    assert h.pusher.aim(h.engine, RID, 0)
    assert h.firsts() == [0] and len(h.sender.pieces[0][1]) == 7
    h.finish_pieces()
    assert h.engine.allocator.num_used == 0 and h.ended == [RID]


def test_an_unaimed_stream_aborted_sends_nothing_and_frees_everything(h):
    h.add(100, skip=None)
    h.step()
    h.pusher.abandon(h.engine, RID)
    h.engine.abort(RID)
    h.pusher.aim(h.engine, RID, 0)  # the router's aim, late (the worker refuses it first): nothing leaves
    h.engine.check()
    assert h.firsts() == [] and h.engine.allocator.num_used == 0 and not h.failed and h.ended == []


def test_an_aim_before_its_stream_opens_is_taken_when_it_opens(h):
    # Ray may run the router's `aim` before the prefill call it follows
    assert h.pusher.aim(h.engine, RID, 2)
    h.add(100, skip=None)
    h.step()
    h.step()
    assert h.firsts() == [2]  # aimed from the start: the full blocks past the held two leave at once
    h.step()
    assert h.step()[0].finish_reason is FinishReason.PREFILLED and h.firsts() == [2, 4, 6]
    h.finish_pieces()
    assert h.engine.allocator.num_used == 0 and h.ended == [RID] and not h.failed
