"""A persistent disk tier: pages written before a restart are found again, bit-exact, by a
scan in the background; torn, garbage and foreign pages are misses, counted; recovered pages
take part in eviction like any other; two pools on one directory never share a file."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from kvstore import disk_recovery
from kvstore.disk import PageFormat
from kvstore.disk_page import HEADER_NBYTES, HeaderError, pack_header, unpack_header
from kvstore.tiers import KVOffloader, Tier, TieredKVStore
from tests.unit.kvstore.test_tiers import filled_pool, key

FORMAT = PageFormat(
    model_id="synthetic:tiny", namespace="synthetic:tiny|fp8", kv_dtype="fp8", layout=(3, 2, 64, 4)
)


def persistent(pool, tmp_path, disk_blocks: int = 8, page_format: PageFormat = FORMAT):
    store = TieredKVStore(
        pool.spec.bytes_per_block,
        host_blocks=0,
        disk_blocks=disk_blocks,
        disk_dir=tmp_path,
        disk_persistent=True,
        page_format=page_format,
    )
    assert store.disk is not None
    return store


def written(tmp_path, num_pages: int = 4, disk_blocks: int = 8):
    """A pool whose first `num_pages` pages were written to a persistent disk tier, since
    closed; the pool, and the slot each page went to."""
    pool = filled_pool(torch.float8_e4m3fn, num_blocks=16)
    store = persistent(pool, tmp_path, disk_blocks)
    KVOffloader(pool, store).spill([(b, key(b), f"tenant-{b % 2}") for b in range(num_pages)])
    assert store.disk is not None
    slots = {b: store.disk.slots[key(b)] for b in range(num_pages)}
    store.close()
    return pool, slots


def reopened(pool, tmp_path, **kw):
    store = persistent(pool, tmp_path, **kw)
    assert store.disk is not None and store.disk.wait_recovered(10)
    return store, store.disk


def overwrite(path, offset: int, data: bytes) -> None:
    fd = os.open(path, os.O_RDWR)
    os.pwrite(fd, data, offset)
    os.close(fd)


def test_pages_written_before_a_restart_are_found_again_bit_exact(tmp_path):
    pool, _ = written(tmp_path)
    original = pool.read_pages([0, 1, 2, 3])
    store, disk = reopened(pool, tmp_path)
    assert disk.num_recovered == 4 and disk.num_rejected == 0
    assert [store.tier_of(key(b)) for b in range(4)] == [Tier.DISK] * 4
    assert disk.owners.counts == {"tenant-0": 2, "tenant-1": 2}  # owners come back too
    pool.kv.zero_()
    assert pool.scales is not None
    pool.scales.zero_()
    offloader = KVOffloader(pool, store)
    assert offloader.load([7, 6, 5, 4], [key(b) for b in range(4)]) == [Tier.DISK] * 4
    assert torch.equal(pool.read_pages([7, 6, 5, 4]), original)
    assert disk.num_checksum_failures == 0
    store.check_integrity()
    store.close()


def test_recovered_pages_are_evicted_before_new_ones_oldest_first(tmp_path):
    pool, _ = written(tmp_path, num_pages=4, disk_blocks=4)
    store, disk = reopened(pool, tmp_path, disk_blocks=4)
    assert disk.num_used == 4 and not disk._free
    offloader = KVOffloader(pool, store)
    offloader.spill([(8, key(8), "t")])  # the disk is full: the oldest recovered page goes
    assert store.tier_of(key(0)) is None and store.tier_of(key(8)) is Tier.DISK
    offloader.spill([(9, key(9), "t")])
    assert store.tier_of(key(1)) is None
    disk.reap(wait=True)
    for b in (2, 3, 8, 9):  # the recovered pages left and the new ones all read back intact
        got = store.get(key(b))
        assert got is not None and torch.equal(got[0], pool.read_pages([b])[0])
    assert disk.num_checksum_failures == 0
    store.check_integrity()
    store.close()
    # and the file now holds the new pages with the two recovered ones that stayed
    store, disk = reopened(pool, tmp_path, disk_blocks=4)
    assert sorted(disk.slots) == sorted(key(b) for b in (2, 3, 8, 9))
    store.close()


def test_torn_and_garbage_pages_are_misses_and_counted(tmp_path):
    pool, slots = written(tmp_path, num_pages=4)
    path = tmp_path / "strata-kv-0.pages"
    slot_nbytes = os.path.getsize(path) // 8
    header = lambda b: (slots[b] + 1) * slot_nbytes - HEADER_NBYTES  # noqa: E731
    overwrite(path, header(1) + 40, b"\x5a" * 16)  # garbage in a header
    overwrite(path, slots[2] * slot_nbytes + 100, b"\xff" * 64)  # bit rot in a payload
    last = max(slots.values())
    assert slots[3] == last
    os.truncate(path, last * slot_nbytes + slot_nbytes // 2)  # a crash cut the file short
    store, disk = reopened(pool, tmp_path)
    assert disk.num_rejected == 2  # the garbage header and the page cut short
    assert store.tier_of(key(1)) is None and store.tier_of(key(3)) is None
    assert store.tier_of(key(2)) is Tier.DISK  # its header is intact: checked when read
    assert store.get(key(2)) is None  # a miss, never wrong KV
    assert disk.num_rejected == 3 and disk.num_checksum_failures == 1
    assert store.tier_of(key(2)) is None
    got = store.get(key(0))
    assert got is not None and torch.equal(got[0], pool.read_pages([0])[0])
    assert disk.num_used == 1 and len(disk._free) == 7  # the turned-away slots are reused
    store.check_integrity()
    store.close()


@pytest.mark.parametrize(
    "other",
    [
        PageFormat(FORMAT.model_id + "-v2", FORMAT.namespace, FORMAT.kv_dtype, FORMAT.layout),
        PageFormat(FORMAT.model_id, FORMAT.namespace + "x", FORMAT.kv_dtype, FORMAT.layout),
        PageFormat(FORMAT.model_id, FORMAT.namespace, "bfloat16", FORMAT.layout),
        PageFormat(FORMAT.model_id, FORMAT.namespace, FORMAT.kv_dtype, (3, 2, 64, 8)),
    ],
)
def test_pages_of_another_model_dtype_or_layout_are_turned_away(tmp_path, other):
    pool, _ = written(tmp_path)
    store, disk = reopened(pool, tmp_path, page_format=other)
    assert disk.num_recovered == 0 and disk.num_rejected == 4
    assert all(store.tier_of(key(b)) is None for b in range(4))
    store.check_integrity()
    store.close()


def test_a_header_names_its_page_and_checks_itself():
    raw = pack_header(FORMAT, key(7), "acme", 4096, 1234, 99)
    header = unpack_header(raw, FORMAT, 4096)
    assert (header.key, header.owner, header.payload_crc, header.sequence) == (
        key(7),
        "acme",
        1234,
        99,
    )
    with pytest.raises(HeaderError, match="bytes"):
        unpack_header(raw, FORMAT, 8192)
    torn = bytearray(raw)
    torn[100] ^= 1
    with pytest.raises(HeaderError, match="checksum"):
        unpack_header(bytes(torn), FORMAT, 4096)


def test_two_pools_on_one_directory_never_share_a_file(tmp_path):
    pool = filled_pool(torch.float8_e4m3fn, num_blocks=16)
    first, second = persistent(pool, tmp_path), persistent(pool, tmp_path)
    assert first.disk is not None and second.disk is not None
    assert first.disk.path != second.disk.path
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "strata-kv-0.pages",
        "strata-kv-1.pages",
    ]
    first.close()
    third = persistent(pool, tmp_path)  # the first one's file is free again
    assert third.disk is not None and third.disk.path == tmp_path / "strata-kv-0.pages"
    second.close()
    third.close()


def test_serving_starts_while_the_scan_runs(tmp_path, monkeypatch):
    """The scan is held at its first slot: the old pages are not found yet, and the fresh
    slots past the old file take new pages; released, the old pages join."""
    pool, _ = written(tmp_path, num_pages=4, disk_blocks=4)
    gate, preadv = threading.Event(), os.preadv

    def held(fd, buffers, offset):
        assert gate.wait(10)
        return preadv(fd, buffers, offset)

    monkeypatch.setattr(disk_recovery.os, "preadv", held)
    store = persistent(pool, tmp_path, disk_blocks=6)
    disk = store.disk
    assert disk is not None and disk.recovering
    assert store.adopt_recovered() == 0 and store.tier_of(key(0)) is None
    offloader = KVOffloader(pool, store)
    offloader.spill([(8, key(8), "t"), (9, key(9), "t")])  # the two slots past the old file
    assert disk.num_used == 2 and sorted(disk.slots.values()) == [4, 5]
    store.check_integrity()
    gate.set()
    assert disk.wait_recovered(10) and not disk.recovering
    assert disk.num_recovered == 4 and all(store.tier_of(key(b)) is Tier.DISK for b in range(4))
    assert next(iter(disk.slots)) == key(0), "recovered pages are the least recently used"
    store.check_integrity()
    store.close()
