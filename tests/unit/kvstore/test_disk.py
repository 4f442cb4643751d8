"""Reads ahead from the disk tier: pages read by the reader threads are checked and served
from memory, a bad read is a miss, reads ahead share a budget, and one released while its
pages are being read leaks nothing. (Which request reads when: tests/unit/engine.)"""

from __future__ import annotations

import logging
import os

import pytest
import torch

from kvstore import disk as disk_module
from kvstore.disk import DiskPrefetch
from kvstore.tiers import KVOffloader, Tier, TieredKVStore
from tests.unit.kvstore.test_tiers import HeldReaders, HeldWriters, filled_pool, key


def on_disk(tmp_path, num_pages: int = 4, disk_blocks: int = 8):
    """A pool whose first `num_pages` pages are written to a disk-only store."""
    pool = filled_pool(torch.float8_e4m3fn, num_blocks=16)
    store = TieredKVStore(
        pool.spec.bytes_per_block, host_blocks=0, disk_blocks=disk_blocks, disk_dir=tmp_path
    )
    offloader = KVOffloader(pool, store)
    offloader.spill([(b, key(b), "t") for b in range(num_pages)])
    assert store.disk is not None
    store.disk.reap(wait=True)
    return pool, store, offloader


def read_ahead(offloader: KVOffloader, keys: list[bytes]) -> DiskPrefetch:
    fetch = offloader.prefetch(keys)
    assert fetch is not None
    settle(offloader, fetch)
    return fetch


def settle(offloader: KVOffloader, fetch: DiskPrefetch) -> None:
    for _ in range(100):
        if offloader.settle(fetch):
            return
        offloader.wait_reads(0.1)
    raise AssertionError("the pages were never read")


def scribble(store: TieredKVStore, k: bytes) -> None:
    """Overwrite part of `k`'s page in the (unlinked) file, through buffered I/O."""
    disk = store.disk
    assert disk is not None
    raw = os.open(f"/proc/self/fd/{disk.fd}", os.O_RDWR)
    os.pwrite(raw, b"\xff" * 64, disk.slots[k] * disk.slot_nbytes + 100)
    os.close(raw)


def test_pages_read_ahead_are_exact_and_loads_take_them_from_memory(tmp_path):
    pool, store, offloader = on_disk(tmp_path)
    keys = [key(b) for b in range(4)]
    original = pool.read_pages([0, 1, 2, 3])
    fetch = read_ahead(offloader, keys)
    for k in keys:
        scribble(store, k)  # the disk copies rot after the read: memory must serve the load
    assert offloader.find(keys, fetch) == 4
    pool.kv.zero_()
    assert pool.scales is not None
    pool.scales.zero_()
    assert offloader.load([7, 6, 5, 4], keys, fetch) == [Tier.DISK] * 4
    assert torch.equal(pool.read_pages([7, 6, 5, 4]), original)
    assert store.disk is not None and store.disk.num_checksum_failures == 0
    offloader.check_integrity([fetch])
    offloader.release(fetch)
    offloader.check_integrity()
    assert store.disk.num_prefetch_bytes == 0
    store.close()


def test_a_page_that_fails_its_read_ahead_is_forgotten_and_a_miss(tmp_path, caplog):
    pool, store, offloader = on_disk(tmp_path)
    keys = [key(b) for b in range(4)]
    scribble(store, keys[1])
    with caplog.at_level(logging.WARNING):
        fetch = read_ahead(offloader, keys)
    assert "checksum" in caplog.text
    assert store.disk is not None and store.disk.num_checksum_failures == 1
    assert store.tier_of(keys[1]) is None  # never served, by this request or a later one
    assert offloader.find(keys, fetch) == 1
    assert offloader.load([7, 6, 5, 4], keys, fetch) == [Tier.DISK]
    assert torch.equal(pool.read_pages([7]), pool.read_pages([0]))
    offloader.release(fetch)
    offloader.check_integrity()
    store.close()


def test_reads_ahead_share_a_budget_that_one_alone_may_exceed(tmp_path, monkeypatch):
    pool, store, offloader = on_disk(tmp_path, num_pages=6)
    disk = store.disk
    assert disk is not None
    monkeypatch.setattr(disk_module, "PREFETCH_BYTES", 2 * disk.slot_nbytes)
    big, small = [key(b) for b in range(3)], [key(3), key(4)]
    original = pool.read_pages([0, 1, 2, 3, 4])
    first = read_ahead(offloader, big)  # 3 pages over a budget of 2: alone, it starts
    assert offloader.prefetch(small) is None, "no room while `big`'s buffer lives"
    assert offloader.load([8, 9, 10], big, first) == [Tier.DISK] * 3
    offloader.release(first)
    second = read_ahead(offloader, small)
    assert offloader.prefetch([key(5)]) is None
    assert offloader.load([11, 12], small, second) == [Tier.DISK] * 2
    assert torch.equal(pool.read_pages(list(range(8, 13))), original)
    offloader.release(second)
    offloader.check_integrity()
    store.close()


def test_a_read_ahead_released_while_reading_leaks_nothing(tmp_path):
    _, store, offloader = on_disk(tmp_path)
    disk = store.disk
    assert disk is not None
    held = HeldReaders(store)
    fetch = offloader.prefetch([key(0), key(1)])
    assert fetch is not None and not offloader.settle(fetch)
    offloader.release(fetch)  # its request went away
    offloader.check_integrity()
    assert disk.num_prefetch_bytes > 0, "its buffer lives until its reads finish"
    held.release()
    for _ in range(50):  # until its reads have finished
        disk.wait_reads(0.1)
    assert disk.num_prefetch_bytes == 0
    offloader.check_integrity()
    store.close()


def test_a_page_evicted_while_being_read_is_a_miss_and_its_slot_is_untouched(tmp_path):
    pool, store, offloader = on_disk(tmp_path, num_pages=2, disk_blocks=2)
    disk = store.disk
    assert disk is not None
    held = HeldReaders(store)
    fetch = offloader.prefetch([key(0)])
    assert fetch is not None
    slot = disk.slots[key(0)]
    offloader.spill([(5, key(5), "t"), (6, key(6), "t")])  # the disk is full: both go
    assert store.tier_of(key(0)) is None
    (reused,) = [k for k, s in disk.slots.items() if s == slot]
    disk.reap(wait=True)  # the new page now fills the slot key(0) is being read from
    held.release()
    settle(offloader, fetch)
    assert offloader.find([key(0)], fetch) == 0
    assert disk.num_checksum_failures == 0, "the slot's new page is intact"
    got = store.get(reused)
    block = 6 if reused == key(6) else 5
    assert got is not None and torch.equal(got[0], pool.read_pages([block])[0])
    offloader.release(fetch)
    offloader.check_integrity()
    store.close()


@pytest.mark.parametrize("num_pages", [1, 8])
def test_pages_still_being_written_are_read_ahead_from_their_staging(tmp_path, num_pages):
    pool = filled_pool(torch.bfloat16)
    store = TieredKVStore(
        pool.spec.bytes_per_block, host_blocks=0, disk_blocks=8, disk_dir=tmp_path
    )
    offloader = KVOffloader(pool, store)
    assert store.disk is not None
    writers = HeldWriters(store)
    offloader.spill([(b, key(b), "t") for b in range(num_pages)])
    keys = [key(b) for b in range(num_pages)]
    fetch = offloader.prefetch(keys)
    assert fetch is not None
    assert offloader.settle(fetch), "nothing to wait for: the pages are in memory"
    writers.release()
    original = pool.read_pages(list(range(num_pages)))
    pool.kv.zero_()
    assert offloader.load(list(range(num_pages)), keys, fetch) == [Tier.DISK] * num_pages
    assert torch.equal(pool.read_pages(list(range(num_pages))), original)
    offloader.release(fetch)
    offloader.check_integrity()
    store.close()
