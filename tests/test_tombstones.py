"""worker_runtime/tombstones.py: ids remembered with their value for `ttl_s`, at most `max_size`
of them, the oldest forgotten first; expiry looks at the front only (arrival order)."""

from __future__ import annotations

from worker_runtime.tombstones import Tombstones


class Clock:
    """A monotonic clock the test moves, counting how often it is read."""

    def __init__(self) -> None:
        self.now = 0.0
        self.reads = 0

    def __call__(self) -> float:
        self.reads += 1
        return self.now


def test_an_id_is_remembered_with_its_value_until_its_time_is_up():
    clock = Clock()
    t: Tombstones[str] = Tombstones(ttl_s=10.0, clock=clock)
    t.add("a", "cancelled")
    clock.now = 9.999
    assert "a" in t and t.get("a") == "cancelled" and len(t) == 1
    clock.now = 10.0
    assert "a" not in t and t.get("a", "never") == "never" and len(t) == 0


def test_expiry_goes_by_each_ids_own_time():
    clock = Clock()
    t: Tombstones[int] = Tombstones(ttl_s=10.0, clock=clock)
    t.add("a", 1)
    clock.now = 4.0
    t.add("b", 2)
    clock.now = 12.0
    assert ("a" in t, t.get("b")) == (False, 2)
    clock.now = 14.0
    assert len(t) == 0


def test_adding_again_renews_the_time_and_the_value():
    clock = Clock()
    t: Tombstones[str] = Tombstones(ttl_s=10.0, clock=clock)
    t.add("a", "first")
    t.add("b", "other")
    clock.now = 8.0
    t.add("a", "second")
    clock.now = 12.0
    assert ("b" in t, t.get("a")) == (False, "second")  # b expired behind a, which moved back


def test_pop_takes_the_value_once():
    t: Tombstones[int] = Tombstones()
    t.add("a", 0)
    assert (t.pop("a"), t.pop("a"), t.pop("a", -1)) == (0, None, -1)
    assert len(t) == 0


def test_the_size_cap_forgets_the_oldest_first():
    clock = Clock()
    t: Tombstones[None] = Tombstones(ttl_s=10.0, max_size=3, clock=clock)
    for i, rid in enumerate("abcd"):
        clock.now = float(i)
        t.add(rid)
    assert [rid for rid in "abcd" if rid in t] == ["b", "c", "d"]
    t.add("b")  # renewed: now the newest, so c goes next
    t.add("e")
    assert [rid for rid in "abcde" if rid in t] == ["b", "d", "e"]


def test_many_ids_stay_bounded_and_each_operation_reads_the_clock_once():
    clock = Clock()
    t: Tombstones[int] = Tombstones(ttl_s=100.0, max_size=1000, clock=clock)
    for i in range(20_000):
        clock.now = i * 0.01
        t.add(f"r{i}", i)
        assert len(t._entries) <= 1000
    assert clock.reads == 20_000  # one read per add: no pass over the entries by time
    assert t.get("r18999") is None and t.get("r19000") == 19000 and len(t) == 1000
    clock.now += 101.0
    assert len(t) == 0
