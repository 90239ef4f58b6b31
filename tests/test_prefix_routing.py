"""The router's prefix index and the placement policies, on hand-made worker views."""

from __future__ import annotations

from protocol.block_hash import block_hashes
from protocol.messages import CacheDelta, WorkerInfo
from router.pools.placement import Placer
from router.pools.prefix_index import PrefixIndex
from router.pools.worker_view import WorkerView

BS = 4


def _view(name: str, pool: str = "prefill", free: int = 100, running: int = 0) -> WorkerView:
    return WorkerView(WorkerInfo(name, pool, "127.0.0.1", 100, BS), actor=None, free_blocks=free, running=running)


def _hashes(tokens: list[int]) -> list[bytes]:
    return block_hashes(tokens, BS)


PROMPT = list(range(100, 140))  # 10 full blocks
H = _hashes(PROMPT)


def test_index_applies_deltas_and_matches_leading_blocks():
    index = PrefixIndex()
    assert index.apply("a", CacheDelta(1, tuple(H[:6]), (), False))
    assert index.apply("b", CacheDelta(1, (H[0], H[1], H[3]), (), False))  # a hole at block 2
    assert index.match(H, ["a", "b", "c"]) == {"a": 6, "b": 2, "c": 0}
    assert index.apply("a", CacheDelta(2, (), (H[2],), False))  # evicted: the run stops there
    assert index.match(H, ["a"]) == {"a": 2}
    assert index.blocks_of("a") == 5


def test_index_detects_a_lost_batch_and_a_snapshot_replaces():
    index = PrefixIndex()
    assert index.apply("a", CacheDelta(1, tuple(H[:3]), (), False))
    assert not index.apply("a", CacheDelta(3, (H[3],), (), False))  # batch 2 lost: refused
    assert index.match(H, ["a"]) == {"a": 3}
    assert index.apply("a", CacheDelta(7, tuple(H[5:8]), (), True))  # the worker's whole cache
    assert index.match(H, ["a"]) == {"a": 0}
    assert index.match(H[5:], ["a"]) == {"a": 3}
    assert index.apply("a", CacheDelta(8, (), (H[5],), False))  # continues from the snapshot's seq
    assert index.blocks_of("a") == 2


def test_predictions_count_until_they_expire_and_events_confirm_them():
    index = PrefixIndex(predict_ttl_s=10)
    index.predict("a", H[:4], now=100.0)
    assert index.match(H, ["a"], now=105.0) == {"a": 4}
    assert index.match(H, ["a"], now=111.0) == {"a": 0}
    index.apply("a", CacheDelta(1, tuple(H[:2]), (), False))  # confirmed: no expiry
    assert index.match(H, ["a"], now=1e9) == {"a": 2}
    index.prune(now=111.0)
    assert index.blocks_of("a") == 2
    index.forget("a")
    assert index.blocks_of("a") == 0 and len(index) == 0


def test_cache_aware_prefill_weighs_the_held_prefix_against_queued_work():
    placer = Placer({"prefill": "cache_aware", "decode": "cache_aware"})
    a, b = _view("prefill-0"), _view("prefill-1")
    placer.index["prefill"].apply(a.name, CacheDelta(1, tuple(H), (), False))
    n = len(PROMPT) + 8  # the cached prompt plus a new turn
    hashes = _hashes(PROMPT + list(range(8)))
    assert placer.pick_prefill([a, b], hashes, n) is a  # idle pool: the prefix wins
    a.hold("x", prefill_tokens=30)  # behind by less than the 36 tokens it saves
    assert placer.pick_prefill([a, b], hashes, n) is a
    a.hold("y", prefill_tokens=20)  # behind by more: the other worker finishes first
    assert placer.pick_prefill([a, b], hashes, n) is b
    fresh = _hashes(list(range(500, 540)))
    assert placer.pick_prefill([a, b], fresh, 40) is b  # no prefix anywhere: least queued tokens


def test_load_and_round_robin_ignore_the_cache():
    load = Placer({"prefill": "load", "decode": "load"})
    rr = Placer({"prefill": "round_robin", "decode": "round_robin"})
    a, b = _view("prefill-0"), _view("prefill-1")
    for placer in (load, rr):
        placer.index["prefill"].apply(a.name, CacheDelta(1, tuple(H), (), False))
    a.hold("busy")
    assert load.pick_prefill([a, b], H, len(PROMPT)) is b
    assert [rr.pick_prefill([a, b], H, len(PROMPT)).name for _ in range(4)] == ["prefill-0", "prefill-1"] * 2
    d0, d1 = _view("decode-0", "decode", free=50), _view("decode-1", "decode", free=80)
    assert load.decode_candidates([d0, d1], H, 10) == [d1, d0]  # most free blocks first
    assert [rr.decode_candidates([d0, d1], H, 10)[0].name for _ in range(2)] == ["decode-0", "decode-1"]


def test_cache_aware_decode_prefers_the_held_prefix_until_load_is_lopsided():
    placer = Placer({"prefill": "cache_aware", "decode": "cache_aware"})
    d0, d1 = _view("decode-0", "decode", free=20), _view("decode-1", "decode", free=90)
    placer.index["decode"].apply(d0.name, CacheDelta(1, tuple(H), (), False))
    assert placer.decode_candidates([d0, d1], H, 11) == [d0, d1]  # 10 of its 11 blocks are there
    d0.running, d1.running = 9, 2  # spread 7 > max(4, 0.5 * 2): balance first
    assert placer.decode_candidates([d0, d1], H, 11) == [d1, d0]
    assert placer.decode_candidates([d0, d1], H, 95) == []  # fits nowhere, even with the hit


def test_colocated_placement_weighs_the_held_prefix_against_queued_prefill_tokens():
    placer = Placer({"prefill": "cache_aware", "decode": "cache_aware"})
    d0, d1 = _view("decode-0", "decode"), _view("decode-1", "decode")
    placer.index["decode"].apply(d0.name, CacheDelta(1, tuple(H), (), False))
    n = len(PROMPT) + 8  # the cached prompt plus a new turn
    hashes = _hashes(PROMPT + list(range(8)))
    d0.running, d1.running = 9, 2  # spread 7: the decode order puts balance first
    ranked = placer.decode_candidates([d0, d1], hashes, 12)
    assert ranked == [d1, d0]
    assert placer.pick_colocated(ranked, hashes, n) == (d0, 8)  # 8 tokens to compute there, 48 on d1
    d0.hold("x", prefill_tokens=30)  # a prompt still prefilling there: 38 < 48
    assert placer.pick_colocated(ranked, hashes, n) == (d0, 8)
    d0.hold("y", prefill_tokens=15)  # 53 > 48: recomputing the prefix on d1 finishes first
    assert placer.pick_colocated(ranked, hashes, n) == (d1, 48)
    load = Placer({"prefill": "load", "decode": "load"})
    assert load.pick_colocated([d1, d0], hashes, n) == (d1, 48)  # the order as given


def test_placement_skips_workers_whose_whole_pool_is_too_small():
    small, big = (WorkerView(WorkerInfo(n, pool, "127.0.0.1", blocks, BS), actor=None, free_blocks=blocks)
                  for n, pool, blocks in (("prefill-0", "prefill", 10), ("prefill-1", "prefill", 40)))
    for policy in ("load", "round_robin", "cache_aware"):
        placer = Placer({"prefill": policy, "decode": policy})
        assert placer.pick_prefill([small, big], [], 39) is not None
        assert placer.pick_prefill([small, big], [], 40) is big  # 40 tokens + the next one: 11 blocks of 4
        assert placer.pick_prefill([small], [], 40) is None
    d_small, d_big = (WorkerView(WorkerInfo(n, "decode", "127.0.0.1", blocks, BS), actor=None, free_blocks=blocks)
                      for n, blocks in (("decode-0", 10), ("decode-1", 40)))
    assert Placer({"prefill": "load", "decode": "load"}).decode_candidates(
        [d_small, d_big], [], 3, final_tokens=41) == [d_big]  # it fits now, but could not finish on decode-0
