"""Host arenas: zero-filled, aligned, disjoint tensors, backed by transparent huge pages."""

from __future__ import annotations

import itertools
import mmap
from pathlib import Path

import pytest
import torch

from kvstore.base import KVCacheSpec
from kvstore.device_pool import DeviceKVPool
from kvstore.hostmem import HUGE_PAGE, HostArena, host_zeros
from tests.huge_pages import THP_MODE, huge_kib, needs_thp


def test_arena_hands_out_zeroed_aligned_disjoint_tensors() -> None:
    shapes = [((3, 5), torch.bfloat16), ((7,), torch.float32), ((1000,), torch.uint8),
              ((HUGE_PAGE,), torch.uint8), ((2, 3, 4), torch.int64)]  # fmt: skip
    arena = HostArena(HostArena.size_of(shapes))
    assert arena.huge
    taken = [arena.take(shape, dtype) for shape, dtype in shapes]
    spans = []
    for t, (shape, dtype) in zip(taken, shapes, strict=True):
        assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
        assert t.data_ptr() % 64 == 0
        assert not t.any()
        spans.append((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()))
    spans.sort()
    assert all(end <= start for (_, end), (start, _) in itertools.pairwise(spans))
    for t in taken:
        t.fill_(7)
    assert all(bool((t == 7).all()) for t in taken)  # no tensor overwrote another
    with pytest.raises(MemoryError, match="no room"):
        arena.take((1,), torch.uint8)


@needs_thp
def test_arena_memory_is_backed_by_huge_pages_from_the_start() -> None:
    t = host_zeros(8 << 20, dtype=torch.uint8)
    assert huge_kib(t) >= 8 << 10  # every page faulted in when the arena was made


def test_huge_pages_can_be_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STRATA_HUGE_PAGES", "0")
    arena = HostArena(8 << 20)
    assert not arena.huge
    t = arena.take((4 << 20,), torch.uint8)
    assert t.numel() == 4 << 20 and not t.any()


def test_refused_advice_leaves_a_working_arena_in_small_pages(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(mmap, "MADV_HUGEPAGE", 4096)  # no such advice: the kernel says EINVAL
    arena = HostArena(4 << 20)
    assert not arena.huge
    assert "small pages" in caplog.text
    t = arena.take((4 << 20,), torch.uint8)
    t.fill_(3)
    assert int(t.sum()) == 3 * (4 << 20)
    assert huge_kib(t) == 0 or "[always]" in Path(THP_MODE).read_text()


@needs_thp
def test_host_kv_pool_lives_in_huge_pages() -> None:
    spec = KVCacheSpec(num_layers=4, num_kv_heads=2, head_dim=64, block_size=16,
                       dtype=torch.bfloat16)  # fmt: skip
    pool = DeviceKVPool(spec, num_blocks=256, device=torch.device("cpu"))
    assert pool.kv.numel() * 2 == 8 << 20 and not pool.kv.any()
    assert huge_kib(pool.kv) >= 8 << 10
