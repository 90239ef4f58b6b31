"""The decode side of the hand-off (decode_worker/handoff.py), every ordering of its events:
KV lands before or after `start`, cancel in each state, a failed transfer in each state, the
lease running out. Pure: no Ray, no engine."""

from __future__ import annotations

import pytest

from decode_worker.handoff import Action, HandoffTable, ReservationGone
from protocol.messages import StartDecode
from protocol.sampling import SamplingParams

RID = "7.0"


def _start(rid: str = RID, kv_timeout_s: float = 5.0) -> StartDecode:
    return StartDecode(rid, [1, 2, 3], [9], SamplingParams(), 0, kv_timeout_s)


@pytest.fixture
def table() -> HandoffTable:
    t = HandoffTable()
    assert t.add(RID, [4, 5], lease_s=10.0, now=0.0)
    return t


def test_kv_lands_then_start_admits(table):
    assert table.resolve(RID, 2) == [4, 5]
    assert table.landed(RID, None).action is Action.WAIT
    out = table.start(_start(), now=1.0)
    assert out.action is Action.ADMIT and out.slot.blocks == [4, 5] and out.slot.start.output_token_ids == [9]
    assert len(table) == 0


def test_start_then_kv_lands_admits(table):
    assert table.start(_start(), now=1.0).action is Action.WAIT
    assert table.resolve(RID, 2) == [4, 5]
    out = table.landed(RID, None)
    assert out.action is Action.ADMIT and len(table) == 0


def test_start_without_reservation_says_why():
    with pytest.raises(ReservationGone, match="no reservation for request '7.0': never reserved here"):
        HandoffTable().start(_start())
    t = HandoffTable()
    t.add(RID, [1], lease_s=1.0)
    t.transfer_failed(RID, "injected")
    with pytest.raises(ReservationGone, match="KV transfer failed: injected"):
        t.start(_start())


@pytest.mark.parametrize("state", ["reserved", "started", "landed"])
def test_cancel_frees_at_once_unless_landing(table, state):
    if state == "started":
        table.start(_start(), now=1.0)
    if state == "landed":
        table.resolve(RID, 2)
        table.landed(RID, None)
    out = table.cancel(RID)
    assert out.action is Action.FREE and out.slot.blocks == [4, 5]
    assert len(table) == 0 and table.is_ended(RID)


def test_cancel_while_landing_frees_when_the_write_ends(table):
    table.resolve(RID, 2)
    assert table.cancel(RID).action is Action.WAIT  # the receiver still writes into the blocks
    assert len(table) == 1
    assert table.landed(RID, None).action is Action.FREE
    assert len(table) == 0


def test_cancel_before_reserve_refuses_the_late_reservation():
    t = HandoffTable()
    assert t.cancel(RID).action is Action.WAIT  # nothing here yet: remembered
    assert not t.add(RID, [1], lease_s=10.0)  # the reserve that was in flight: the caller frees
    assert len(t) == 0


def test_cancelled_slot_refuses_its_transfer(table):
    table.cancel(RID)
    assert table.resolve(RID, 2) is None


@pytest.mark.parametrize("state", ["reserved", "started"])
def test_transfer_failure_fails_the_slot(table, state):
    if state == "started":
        table.start(_start(), now=1.0)
    out = table.transfer_failed(RID, "peer gone")
    assert out.action is Action.FAIL and "peer gone" in out.reason and len(table) == 0


def test_transfer_failure_while_landing_is_deferred_to_the_write_end(table):
    table.resolve(RID, 2)
    assert table.transfer_failed(RID, "sender timed out").action is Action.WAIT
    out = table.landed(RID, None)  # even a complete write is not trusted after a failure report
    assert out.action is Action.FAIL and "sender timed out" in out.reason


def test_receiver_error_fails_the_slot(table):
    table.resolve(RID, 2)
    out = table.landed(RID, RuntimeError("checksum mismatch"))
    assert out.action is Action.FAIL and "checksum mismatch" in out.reason


def test_transfer_failure_after_landing_is_ignored(table):
    table.resolve(RID, 2)
    table.landed(RID, None)
    assert table.transfer_failed(RID, "late").action is Action.WAIT
    assert table.start(_start(), now=1.0).action is Action.ADMIT


def test_lease_expires_without_kv(table):
    assert table.expire(now=9.9) == []
    [(rid, out)] = table.expire(now=10.0)
    assert rid == RID and out.action is Action.FAIL and "lease" in out.reason
    with pytest.raises(ReservationGone, match="lease"):
        table.start(_start())


def test_start_renews_the_lease_to_the_kv_timeout(table):
    table.start(_start(kv_timeout_s=2.0), now=1.0)
    assert table.expire(now=2.9) == []
    [(_, out)] = table.expire(now=3.0)
    assert out.action is Action.FAIL


def test_landed_without_start_expires_with_its_own_reason(table):
    table.resolve(RID, 2)
    table.landed(RID, None)
    [(_, out)] = table.expire(now=10.0)
    assert out.action is Action.FAIL and "start never came" in out.reason


def test_a_landing_slot_never_expires(table):
    table.resolve(RID, 2)
    assert table.expire(now=1000.0) == []
    assert table.landed(RID, None).action is Action.WAIT


def test_duplicate_reservation_is_refused(table):
    assert not table.add(RID, [6], lease_s=1.0)


def test_a_push_must_start_right_after_the_cached_blocks():
    """The decode worker held 2 of 5 blocks (prefix cache): only a payload for blocks 2.. fits;
    one that skips more (holes) or fewer (would overwrite shared blocks) is refused."""
    t = HandoffTable()
    assert t.add(RID, [7, 8, 4, 5, 6], lease_s=10.0, now=0.0, cached=2)
    assert t.resolve(RID, 3, first_block=0) is None
    assert t.resolve(RID, 2, first_block=3) is None
    assert t.resolve(RID, 4, first_block=2) is None  # more blocks than reserved after the cached ones
    assert t.resolve(RID, 3, first_block=2) == [4, 5, 6]
    assert t.landed(RID, None).action is Action.WAIT
    out = t.start(_start(), now=1.0)
    assert out.action is Action.ADMIT and out.slot.blocks == [7, 8, 4, 5, 6]


def _streamed(expected: int = 4) -> HandoffTable:
    """6 blocks reserved, 1 cached, `expected` pushed in pieces (the 6th is for the next token)."""
    t = HandoffTable()
    assert t.add(RID, [7, 8, 4, 5, 6, 3], lease_s=10.0, now=0.0, cached=1, expected=expected)
    return t


def test_pieces_land_in_order_and_admit_after_the_last():
    t = _streamed()
    t.start(_start(), now=0.5)
    assert t.resolve(RID, 2, first_block=1) == [8, 4]
    assert t.landed(RID, None).action is Action.WAIT  # 2 of 4 blocks: started, but not admitted
    assert t.resolve(RID, 2, first_block=4) is None  # a gap: block 3 would be a hole
    assert t.resolve(RID, 1, first_block=2) is None  # overlaps what landed
    assert t.resolve(RID, 3, first_block=3) is None  # past the expected blocks (the 6th is not pushed)
    assert t.resolve(RID, 1, first_block=3) == [5]
    assert t.landed(RID, None).action is Action.WAIT
    assert t.resolve(RID, 1, first_block=4) == [6]
    out = t.landed(RID, None)
    assert out.action is Action.ADMIT and out.slot.received == 4


def test_a_piece_cannot_resolve_while_another_lands():
    t = _streamed()
    assert t.resolve(RID, 1, first_block=1) == [8]
    assert t.resolve(RID, 1, first_block=2) is None


def test_a_failed_piece_fails_the_hand_off_after_earlier_ones_landed():
    t = _streamed()
    t.resolve(RID, 2, first_block=1)
    t.landed(RID, None)
    t.resolve(RID, 1, first_block=3)
    out = t.landed(RID, RuntimeError("connection closed"))
    assert out.action is Action.FAIL and "connection closed" in out.reason
    assert t.resolve(RID, 1, first_block=4) is None  # a later piece finds nothing


def test_failure_reported_between_pieces_ends_the_slot_and_one_mid_piece_waits():
    t = _streamed()
    t.resolve(RID, 2, first_block=1)
    t.landed(RID, None)
    assert t.transfer_failed(RID, "injected").action is Action.FAIL  # partly landed: freed now
    t = _streamed()
    t.resolve(RID, 2, first_block=1)
    assert t.transfer_failed(RID, "injected").action is Action.WAIT  # landing: never freed under it
    assert t.landed(RID, None).action is Action.FAIL


def test_cancel_mid_stream_frees_once_the_landing_piece_ends():
    t = _streamed()
    t.resolve(RID, 2, first_block=1)
    assert t.cancel(RID).action is Action.WAIT
    assert t.landed(RID, None).action is Action.FREE
    assert t.resolve(RID, 2, first_block=3) is None
