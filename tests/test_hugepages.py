"""Large CPU tensors on 2 MiB pages: the KV pool and the GEMM's weight panels ask for them with
`madvise` before their first write, where the host's transparent huge pages allow it."""

from __future__ import annotations

import itertools
import re
import sys

import pytest
import torch

from engine.kernels import hugepages
from engine.kv_cache import allocate_kv_pool


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping holding `address` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps", encoding="ascii") as f:
        for line in f:
            span = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
            if span:
                inside = int(span.group(1), 16) <= address < int(span.group(2), 16)
            elif inside and line.startswith("VmFlags:"):
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


needs_thp = pytest.mark.skipif(sys.platform != "linux" or hugepages.thp_mode() not in ("always", "madvise"),
                               reason="this host's transparent huge pages are not asked for with madvise")


def test_the_hosts_setting_is_read_from_its_brackets(tmp_path, monkeypatch):
    setting = tmp_path / "enabled"
    setting.write_text("always [madvise] never\n")
    monkeypatch.setattr(hugepages, "THP_SETTING", str(setting))
    hugepages.thp_mode.cache_clear()
    try:
        assert hugepages.thp_mode() == "madvise"
        setting.write_text("[never]")
        hugepages.thp_mode.cache_clear()
        assert hugepages.thp_mode() == "never"
        monkeypatch.setattr(hugepages, "THP_SETTING", str(tmp_path / "missing"))
        hugepages.thp_mode.cache_clear()
        assert hugepages.thp_mode() == "unavailable"
        never = torch.empty(4 << 20, dtype=torch.uint8)
        assert not hugepages.ask_huge_pages(never)  # unavailable: ordinary pages, nothing asked
    finally:
        hugepages.thp_mode.cache_clear()


@needs_thp
def test_the_kv_pool_is_zeros_on_huge_pages():
    pool = allocate_kv_pool(4, 96, 16, 2, 64, torch.float32, "cpu")  # 12 MiB
    assert pool.shape == (96, 4, 2, 16, 2, 64) and pool.is_contiguous() and not pool.any()
    first_huge = -(-pool.data_ptr() // hugepages.HUGE_PAGE) * hugepages.HUGE_PAGE
    assert "hg" in _vm_flags(first_huge)  # madvise(MADV_HUGEPAGE) took
    small = hugepages.zeros(1000, dtype=torch.float32)
    assert not small.any() and not hugepages.ask_huge_pages(small)  # no whole 2 MiB page inside: nothing to ask


@needs_thp
def test_the_arena_hands_out_aligned_disjoint_views_in_huge_page_chunks():
    arena = hugepages.Arena()
    sizes = [5, 1000, 331_776, 16, 20_000_000, 7]  # the fifth is past a chunk (64 MiB): a chunk of its own
    views = [arena.take(n) for n in sizes]
    for view, n in zip(views, sizes, strict=True):
        assert view.numel() == n and view.dtype == torch.float32 and view.data_ptr() % 64 == 0
        view.fill_(float(n))
    spans = sorted((v.data_ptr(), v.data_ptr() + 4 * v.numel()) for v in views)
    assert all(end <= start for (_, end), (start, _) in itertools.pairwise(spans))  # no two overlap
    assert all(v.eq(float(n)).all() for v, n in zip(views, sizes, strict=True))
    chunks = [v.untyped_storage().data_ptr() for v in views]
    assert len(set(chunks[:4])) == 1 and len(set(chunks)) == 3  # the big one filled its chunk: the last, a new one
    for first in (views[0], views[4], views[5]):  # each chunk starts on a 2 MiB page asked for
        assert first.data_ptr() % hugepages.HUGE_PAGE == 0 and "hg" in _vm_flags(first.data_ptr())


def test_an_arena_view_taken_in_inference_mode_is_a_normal_tensor():
    """The GEMM's panels are packed under inference mode (the fusing probes run there); a chunk made
    there would hold inference tensors, and a later view of it could not be written outside."""
    arena = hugepages.Arena()
    with torch.inference_mode():
        first = arena.take(64)
    second = arena.take(64)  # the same chunk, outside
    assert not first.is_inference() and not second.is_inference()
    first[0] = second[0] = 1.0
