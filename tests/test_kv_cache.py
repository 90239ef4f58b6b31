"""Block allocator: exact block ids, None when it doesn't fit, integrity check."""

from __future__ import annotations

import pytest

from engine.kv_cache import BlockAllocator


def test_allocates_lowest_ids_then_reuses_in_free_order():
    a = BlockAllocator(6)
    assert a.allocate(2, "a") == [0, 1]
    assert a.allocate(3, "b") == [2, 3, 4]
    assert a.allocate(2, "c") is None  # only block 5 left: nothing is taken
    assert a.num_free == 1
    a.free([3, 2])
    assert a.allocate(3, "c") == [5, 3, 2]
    assert (a.num_free, a.num_used) == (0, 6)
    a.check()


def test_double_free_is_caught():
    a = BlockAllocator(2)
    ids = a.allocate(1, "x")
    a.free(ids)
    with pytest.raises(AssertionError, match="freed twice"):
        a.free(ids)
    a.check()


def test_check_detects_corruption():
    a = BlockAllocator(3)
    a.allocate(1, "x")
    a._free.append(0)  # simulate a bug: block 0 both in use and free
    with pytest.raises(AssertionError):
        a.check()
