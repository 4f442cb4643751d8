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
    shapes = [
        ((3, 5), torch.bfloat16),
        ((7,), torch.float32),
        ((1000,), torch.uint8),
        ((HUGE_PAGE,), torch.uint8),
        ((2, 3, 4), torch.int64),
    ]
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
    spec = KVCacheSpec(
        num_layers=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.bfloat16
    )
    pool = DeviceKVPool(spec, num_blocks=256, device=torch.device("cpu"))
    assert pool.kv.numel() * 2 == 8 << 20 and not pool.kv.any()
    assert huge_kib(pool.kv) >= 8 << 10


class Registrar:
    """Stands in for cudaHostRegister/Unregister (no GPU here): records what is page-locked
    and checks the memory is still mapped when it is let go."""

    def __init__(self) -> None:
        self.locked: dict[int, int] = {}  # ptr -> bytes
        self.released: list[int] = []

    def __call__(self, ptr: int, nbytes: int):
        self.locked[ptr] = nbytes

        def unregister() -> None:
            with open("/proc/self/maps") as maps:  # the range must still be mapped
                assert any(
                    int(lo, 16) <= ptr < int(hi, 16)
                    for lo, hi in (line.split()[0].split("-") for line in maps)
                )
            self.released.append(ptr)

        return unregister


def test_pinned_memory_is_exactly_its_size_and_let_go_after_its_last_view() -> None:
    import gc

    from kvstore.hostmem import pinned_zeros

    registrar = Registrar()
    rows = pinned_zeros(3, 100_000, dtype=torch.uint8, register=registrar)
    assert rows.shape == (3, 100_000) and not rows.any()
    assert registrar.locked == {rows.data_ptr(): 300_000}  # not rounded up to 2**19
    row = rows[2]
    del rows
    gc.collect()
    assert registrar.released == []  # a view is alive: still page-locked
    row.fill_(7)
    del row
    gc.collect()
    assert registrar.released == list(registrar.locked)


def test_pinned_memory_falls_back_to_torch_when_registration_is_refused(monkeypatch, caplog):
    from kvstore import hostmem

    calls = []
    monkeypatch.setattr(torch, "zeros", lambda *a, **k: calls.append(k) or torch.empty(0))
    hostmem.pinned_zeros(4, 8, dtype=torch.uint8, register=lambda ptr, n: None)
    assert calls == [{"dtype": torch.uint8, "pin_memory": True}]
    assert "cudaHostRegister refused 32 bytes" in caplog.text
