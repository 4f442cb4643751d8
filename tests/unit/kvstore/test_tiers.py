"""Host and disk tiers: bit-exact round trips, checksums, a disk that fails, and the block
manager driving them through a seeded stress run."""

from __future__ import annotations

import contextlib
import logging
import os
import random
import resource
import signal
import threading
import time
import zlib

import pytest
import torch

from engine.block_hash import chain_hashes, root_hash
from engine.block_manager import BlockManager
from kvstore import disk as disk_module
from kvstore.base import KVCacheSpec
from kvstore.connector import TierConnector
from kvstore.device_pool import DeviceKVPool
from kvstore.tiers import KVOffloader, Tier, TieredKVStore
from tests.held_copies import hold_saves

CPU = torch.device("cpu")


def filled_pool(dtype: torch.dtype, num_blocks: int = 8, seed: int = 0) -> DeviceKVPool:
    pool = DeviceKVPool(KVCacheSpec(3, 2, 64, 4, dtype), num_blocks, CPU)
    g = torch.Generator().manual_seed(seed)
    raw = pool.kv.view(torch.uint8)
    raw.copy_(torch.randint(0, 120, raw.shape, generator=g, dtype=torch.uint8))  # finite
    if pool.scales is not None:
        pool.scales.copy_(torch.rand(pool.scales.shape, generator=g))
    return pool


class _HeldThreads:
    """Occupies every thread of one of the disk tier's pools until `release()`: work
    queues behind it."""

    def __init__(self, store: TieredKVStore, readers: bool) -> None:
        disk = store.disk
        assert disk is not None
        pool, count = (
            (disk._readers, disk_module._READ_THREADS)
            if readers
            else (disk._io, disk_module._WRITE_THREADS)
        )
        self.gate = threading.Event()
        for _ in range(count):
            pool.submit(self.gate.wait)

    def release(self) -> None:
        self.gate.set()


class HeldReaders(_HeldThreads):
    """Every disk reader thread held: reads ahead queue."""

    def __init__(self, store: TieredKVStore) -> None:
        super().__init__(store, readers=True)


class HeldWriters(_HeldThreads):
    """Every disk writer thread held: writes queue."""

    def __init__(self, store: TieredKVStore) -> None:
        super().__init__(store, readers=False)


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.bfloat16])
def test_device_host_disk_device_round_trip_is_bit_exact(tmp_path, dtype):
    pool = filled_pool(dtype)
    page = pool.spec.bytes_per_block
    store = TieredKVStore(page, host_blocks=2, disk_blocks=4, disk_dir=tmp_path)
    assert store.disk is not None
    offloader = KVOffloader(pool, store)
    original = pool.read_pages([0, 1, 2, 3])
    offloader.spill(
        [(b, key(b), "tenant") for b in range(4)]
    )  # host holds 2; the 2 older go to disk
    assert [store.tier_of(key(b)) for b in range(4)] == [Tier.DISK] * 2 + [Tier.HOST] * 2
    store.disk.reap(wait=True)  # the writes have landed: the next reads come from the file
    assert not store.disk._pending
    pool.kv.zero_()
    if pool.scales is not None:
        pool.scales.zero_()
    tiers = offloader.load([7, 6, 5, 4], [key(b) for b in range(4)])
    assert tiers == [Tier.DISK, Tier.DISK, Tier.HOST, Tier.HOST]
    assert torch.equal(pool.read_pages([7, 6, 5, 4]), original)
    store.check_integrity()
    store.close()


def test_a_page_still_being_written_reads_from_its_staging_buffer(tmp_path):
    pool = filled_pool(torch.bfloat16)
    store = TieredKVStore(
        pool.spec.bytes_per_block, host_blocks=0, disk_blocks=2, disk_dir=tmp_path
    )
    page = pool.read_pages([3])[0]
    assert store.disk is not None
    store.disk._io.submit(time.sleep, 0.3)  # hold the writer back
    store.put(key(3), page)
    got = store.get(key(3))
    assert got is not None and got[1] is Tier.DISK and torch.equal(got[0], page)
    store.close()


def test_corrupt_or_truncated_disk_pages_are_misses(tmp_path, caplog):
    pool = filled_pool(torch.float8_e4m3fn)
    store = TieredKVStore(
        pool.spec.bytes_per_block, host_blocks=0, disk_blocks=4, disk_dir=tmp_path
    )
    disk = store.disk
    assert disk is not None
    for b in range(3):
        store.put(key(b), pool.read_pages([b])[0])
    disk.reap(wait=True)
    raw = os.open(f"/proc/self/fd/{disk.fd}", os.O_RDWR)  # the (unlinked) file, buffered I/O
    os.pwrite(raw, b"\xff" * 64, disk.slots[key(1)] * disk.slot_nbytes + 100)  # bit rot
    os.close(raw)
    with caplog.at_level(logging.WARNING):
        assert store.get(key(1)) is None
    assert "checksum" in caplog.text
    assert store.tier_of(key(1)) is None  # forgotten, never served
    assert store.get(key(0)) is not None
    os.ftruncate(disk.fd, disk.slots[key(2)] * disk.slot_nbytes + 10)  # a truncated file
    assert store.get(key(2)) is None
    assert disk.num_checksum_failures == 2
    store.check_integrity()
    store.close()


def test_unusable_disk_path_disables_the_disk_tier_with_a_warning(tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with caplog.at_level(logging.WARNING):
        store = TieredKVStore(4096, host_blocks=2, disk_blocks=4, disk_dir=blocker / "kv")
    assert store.disk is None and store.host is not None
    assert "KV disk tier disabled" in caplog.text
    store.put(key(1), torch.zeros(4096, dtype=torch.uint8))
    store.put(key(2), torch.zeros(4096, dtype=torch.uint8))
    store.put(key(3), torch.zeros(4096, dtype=torch.uint8))  # evicts key 1: nowhere to go
    assert store.tier_of(key(1)) is None and store.num_dropped == 1


@contextlib.contextmanager
def file_size_limit():
    """Cap this process's file size (the kernel then fails writes past it with EFBIG, as a
    full disk fails them with ENOSPC). Restored on leaving the block, before pytest writes
    its report (which may go to a file larger than the cap)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)

    def limit(nbytes: int) -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))

    try:
        yield limit
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)


def test_a_full_disk_degrades_to_fewer_cached_pages(tmp_path, caplog):
    page = 8192
    slot = disk_module.disk_slot_nbytes(page)  # the page and its header
    with caplog.at_level(logging.WARNING), file_size_limit() as limit:
        limit(3 * slot)
        store = TieredKVStore(page, host_blocks=0, disk_blocks=10, disk_dir=tmp_path)
        disk = store.disk
        assert disk is not None
        limit(slot)  # now the disk "fills up" under the pages already placed
        for b in range(2):
            store.put(key(b), torch.full((page,), b, dtype=torch.uint8))
        disk.reap(wait=True)
    assert disk.num_blocks == 2  # 10 -> 5 -> 2 pages fit
    assert "only 2 of 10 pages fit" in caplog.text
    assert disk.num_write_errors == 1  # the page past the limit failed and was let go
    assert "write failed" in caplog.text
    assert store.tier_of(key(0)) is Tier.DISK and store.tier_of(key(1)) is None
    got = store.get(key(0))
    assert got is not None and int(got[0][0]) == 0
    store.check_integrity()
    store.close()


def test_a_slot_written_again_while_its_last_write_runs_ends_with_the_new_page(
    tmp_path, monkeypatch
):
    """Writes run on several threads. A one-page disk: B evicts A, whose write is still
    running (slowly), and takes its slot; B's write goes to the disk after A's, so B reads
    back intact."""
    page = 8192
    store = TieredKVStore(page, host_blocks=0, disk_blocks=1, disk_dir=tmp_path)
    disk = store.disk
    assert disk is not None
    pwritev, calls, first_written = os.pwritev, [], threading.Event()

    def slow_first_write(fd: int, buffers: list, offset: int) -> int:
        calls.append(offset)
        if len(calls) > 1:
            return pwritev(fd, buffers, offset)
        time.sleep(0.3)
        written = pwritev(fd, buffers, offset)
        first_written.set()
        return written

    monkeypatch.setattr(disk_module.os, "pwritev", slow_first_write)
    a, b = (torch.full((page,), v, dtype=torch.uint8) for v in (1, 2))
    store.put(key(0), a)
    store.put(key(1), b)  # the disk is full: A is forgotten and B takes its slot
    assert store.tier_of(key(0)) is None and store.tier_of(key(1)) is Tier.DISK
    assert disk.read(key(1)) is not None  # moving: from its staging buffer
    disk.reap(wait=True)
    assert first_written.wait(5) and calls == [0, 0]
    got = disk.read(key(1))  # from the disk now, checked
    assert got is not None and torch.equal(got, b)
    assert disk.num_checksum_failures == 0 and disk.num_write_errors == 0
    store.check_integrity()
    store.close()


@pytest.mark.parametrize("load", ["sync", "thread"])
def test_block_manager_stress_keeps_every_tier_consistent(tmp_path, load):
    """Seeded submits, aborts, frees, reads ahead and prefix reuse over a tiny device pool and
    tiny tiers: every block ever loaded back holds exactly the page its hash was computed
    with. `thread`: host rows are read in place by a worker thread while the tiers churn."""
    pool = DeviceKVPool(KVCacheSpec(1, 1, 16, 4, torch.float32), 6, CPU, load)
    store = TieredKVStore(
        pool.spec.bytes_per_block, host_blocks=3, disk_blocks=5, disk_dir=tmp_path
    )
    bm = BlockManager(6, 4, connector=TierConnector(KVOffloader(pool, store)))
    rng = random.Random(7)
    docs = [[rng.randrange(50) for _ in range(12)] for _ in range(6)]

    def page_for(h: bytes) -> torch.Tensor:
        return torch.full((4, 1, 16), float(zlib.crc32(h)), dtype=torch.float32)

    live: dict[str, list[bytes]] = {}
    loaded = read_ahead = aborted = 0
    for step in range(400):
        if live and (len(live) > 1 or rng.random() < 0.4):
            rid = rng.choice(sorted(live))
            del live[rid]
            bm.free(rid)
        else:
            rid = f"r{step}"
            tokens = [*rng.choice(docs), rng.randrange(50)]
            hashes = chain_hashes(root_hash("t"), tokens, 4, 0)[:3]
            hits = bm.lookup(hashes)
            below = bm.lookup_below(rid, hashes[len(hits) :])
            if below and rng.random() < 0.5:  # read ahead first, as the scheduler does
                disk = any(store.tier_of(h) is Tier.DISK for h in below)
                read_ahead += disk
                if disk and rng.random() < 0.3:  # aborted while its pages are being read
                    assert store.disk is not None
                    store.disk.reap(wait=True)  # written: pages in staging are copied at once
                    held = HeldReaders(store)  # in flight, however fast the disk is
                    try:
                        reading = not bm.prefetch_below(rid, below)
                        bm.free(rid)
                    finally:
                        held.release()
                    aborted += reading
                    continue
                while not bm.prefetch_below(rid, below):
                    bm.wait_below(1.0)
                below = bm.lookup_below(rid, hashes[len(hits) :])
            if not bm.can_allocate(rid, len(tokens), hits):
                bm.free(rid)
                continue
            table = bm.allocate(rid, len(tokens), hits)
            for block, h in zip(table, hashes[: len(hits)], strict=False):
                assert torch.equal(pool.kv[0, 0, block], page_for(h))
            tiers = bm.load_below(rid, len(hits), below)
            pool.loads.wait_all()  # what the step's attention does, layer by layer
            loaded += len(tiers)
            for i, h in enumerate(below[: len(tiers)]):
                assert torch.equal(pool.kv[0, 0, table[len(hits) + i]], page_for(h))
            for i in range(len(hits) + len(tiers), len(hashes)):  # "compute" the rest
                pool.kv[0, 0, table[i]] = page_for(hashes[i])
                pool.kv[0, 1, table[i]] = page_for(hashes[i])
            bm.commit(rid, hashes)
            live[rid] = hashes
        bm.check_integrity()
    assert loaded > 20 and read_ahead > 10 and aborted > 0
    assert bm.num_tier_hit_blocks[Tier.HOST] > 0 and bm.num_tier_hit_blocks[Tier.DISK] > 0
    assert bm.connector is not None and bm.connector.offloader.in_place == (load == "thread")
    pool.loads.close()
    store.close()


def test_spilling_never_pushes_out_the_pages_about_to_be_loaded(tmp_path):
    store = TieredKVStore(4096, host_blocks=2, disk_blocks=4, disk_dir=tmp_path)
    page = torch.zeros(4096, dtype=torch.uint8)
    store.put(key(1), page)
    store.put(key(2), page)
    store.put(key(3), page, keep={key(1)})  # evicts key 2, the oldest not kept
    assert store.tier_of(key(1)) is Tier.HOST and store.tier_of(key(2)) is Tier.DISK
    store.put(key(4), page, keep={key(1), key(3)})  # nothing evictable: straight to disk
    assert store.tier_of(key(4)) is Tier.DISK
    assert {store.tier_of(key(1)), store.tier_of(key(3))} == {Tier.HOST}
    store.check_integrity()
    store.close()


def test_host_slots_taken_at_once_match_one_at_a_time(tmp_path):
    """A spill's slots taken in one pass push out the same least recently used pages (not
    the kept ones) as taking them one by one; where the pages there cannot make room for
    the whole batch, or an owner has an allowance, nothing is taken at once."""
    stores = [
        TieredKVStore(4096, host_blocks=6, disk_blocks=8, disk_dir=tmp_path / d)
        for d in ("once", "each")
    ]
    for store in stores:
        for i in range(6):
            store.put(key(i), torch.full((4096,), i, dtype=torch.uint8), owner="a")
        store.tier_of(key(0), touch=True)  # now the most recently used
    new = [(key(10 + i), "b") for i in range(3)]
    keep = {key(1)}
    once, each = stores
    slots = once.take_host_slots(new, keep)
    assert slots is not None and len(set(slots)) == 3
    for k, owner in new:
        each.take_host_slot(k, keep, owner)
    for store in stores:  # keys 2, 3 and 4 went to disk; 1 was kept, 0 recently used
        assert [store.tier_of(key(i)) for i in range(6)] == [Tier.HOST, Tier.HOST] + [
            Tier.DISK
        ] * 3 + [Tier.HOST]
        assert all(store.tier_of(k) is Tier.HOST for k, _ in new)
        assert store.num_spilled == {Tier.HOST: 9, Tier.DISK: 3}
        store.check_integrity()
    assert once.take_host_slots([(key(20 + i), "b") for i in range(7)]) is None  # 6 slots
    once.set_allowance("b", 8, None)
    assert once.take_host_slots([(key(30), "b")]) is None
    once.check_integrity()
    for store in stores:
        store.close()


def test_per_tenant_allowances_bound_each_tier(tmp_path):
    store = TieredKVStore(4096, host_blocks=4, disk_blocks=8, disk_dir=tmp_path)
    page = torch.zeros(4096, dtype=torch.uint8)
    store.set_allowance("small", 1, 0)  # one page in host RAM, none on disk
    store.set_allowance("no-host", 0, None)
    store.put(key(1), page, owner="small")
    store.put(key(2), page, owner="small")  # over its host allowance: its own page 1 goes
    assert store.tier_of(key(2)) is Tier.HOST and store.tier_of(key(1)) is None  # dropped
    store.put(key(3), page, owner="no-host")
    assert store.tier_of(key(3)) is Tier.DISK
    for i in range(10, 14):  # "big" has no allowance: it fills host RAM, pushing "small" out
        store.put(key(i), page, owner="big")
    assert store.tier_of(key(2)) is None  # 0 pages of disk for "small": dropped, not moved
    assert store.pages_by_owner() == {"big": {"host": 4}, "no-host": {"disk": 1}}
    store.set_allowance("small", None, None)
    assert "small" not in store.allowances
    store.check_integrity()
    store.close()


def test_block_manager_counts_blocks_per_tenant():
    bm = BlockManager(8, 4)
    bm.allocate("a1", 8, owner="acme")
    bm.allocate("b1", 4, owner="beta")
    hashes = chain_hashes(root_hash("x"), list(range(8)), 4, 0)
    bm.commit("a1", hashes)
    assert bm.blocks_by_owner() == {"acme": 2, "beta": 1}
    bm.free("a1")  # acme's blocks stay cached, still charged to acme
    assert bm.blocks_by_owner() == {"acme": 2, "beta": 1}
    bm.allocate("b2", 4 * 7, owner="beta")  # takes every free block, evicting acme's
    assert bm.blocks_by_owner() == {"beta": 8}
    bm.check_integrity()


def test_spill_ahead_saves_the_next_reused_pages_so_allocation_copies_nothing(tmp_path):
    pool = filled_pool(torch.float32, num_blocks=8)
    store = TieredKVStore(
        pool.spec.bytes_per_block, host_blocks=8, disk_blocks=0, disk_dir=tmp_path
    )
    bm = BlockManager(8, 4, connector=TierConnector(KVOffloader(pool, store)))
    docs = {f"r{i}": [10 * i + j for j in range(8)] for i in range(3)}  # two blocks each
    hashes = {rid: chain_hashes(root_hash("t"), toks, 4, 0) for rid, toks in docs.items()}
    for rid in docs:
        bm.allocate(rid, 8, owner="t")
        bm.commit(rid, hashes[rid])
    originals = {rid: pool.read_pages(bm.block_table(rid)) for rid in docs}
    bm.free("r0")
    bm.free("r1")  # free list: 2 empty blocks, then r0's and r1's cached blocks
    assert bm.spill_ahead(3) == 1, "only the cached blocks among the next 3"
    assert bm.spill_ahead(6) == 3
    assert bm.spill_ahead(6) == 0, "each page is saved once"
    assert bm.num_spilled_ahead == 4
    assert [store.tier_of(h) for h in hashes["r0"] + hashes["r1"]] == [Tier.HOST] * 4
    assert len(bm.lookup(hashes["r1"])) == 2  # still cached on the device too
    spilled = store.num_spilled[Tier.HOST]
    bm.allocate("big", 24, owner="t")  # takes every free block: evicts all four pages
    assert store.num_spilled[Tier.HOST] == spilled, "nothing left to copy at allocation"
    assert bm.lookup(hashes["r0"]) == []
    for rid in ("r0", "r1"):
        assert bm.lookup_below(rid, hashes[rid]) == hashes[rid]
    bm.free("big")
    fresh = bm.allocate("back", 8, owner="t")
    assert bm.load_below("back", 0, hashes["r0"]) == [Tier.HOST, Tier.HOST]
    assert torch.equal(pool.read_pages(fresh), originals["r0"])
    bm.check_integrity()
    store.close()


def test_a_hit_on_pages_still_loading_waits_for_their_load(monkeypatch):
    """A request whose pages are copying in from host RAM (held on the worker) makes its
    blocks findable at once; a second request hitting them waits for that same load, and
    neither is ready until it is done. Freed, the blocks go back once it is."""
    from kvstore import transfer

    pool = DeviceKVPool(KVCacheSpec(1, 1, 16, 4, torch.float32), 4, CPU, "thread")
    store = TieredKVStore(pool.spec.bytes_per_block, host_blocks=4)
    bm = BlockManager(4, 4, connector=TierConnector(KVOffloader(pool, store)))
    tokens = list(range(9))
    hashes = chain_hashes(root_hash("t"), tokens, 4, 0)
    bm.allocate("doc", 9)
    for block, value in zip(bm.block_table("doc"), (1.0, 2.0), strict=False):
        pool.kv[0, :, block] = value
    bm.commit("doc", hashes)
    bm.free("doc")
    bm.allocate("other", 16)  # every block: the document's pages go to host RAM
    bm.free("other")
    assert bm.lookup(hashes) == [] and len(bm.lookup_below("a", hashes)) == 2

    gate = threading.Event()
    real = transfer._scatter

    def held(*args):
        assert gate.wait(30)
        real(*args)

    monkeypatch.setattr(transfer, "_scatter", held)
    bm.allocate("a", 9, [], hashes)
    assert bm.load_below("a", 0, hashes) == [Tier.HOST, Tier.HOST]
    tickets = bm.load_tickets(["a"])
    assert len(tickets) == 1 and not bm.loads_ready("a")
    hits = bm.lookup(hashes)
    assert hits == bm.block_table("a")[:2]  # findable while their pages are on their way
    bm.allocate("b", 9, hits)
    assert bm.load_tickets(["b"]) == tickets and not bm.loads_ready("b")
    bm.check_integrity()
    threading.Timer(0.2, gate.set).start()
    bm.free("a")  # waits for the copies into its blocks
    assert bm.loads_ready("b") and not bm.load_tickets(["b"])
    for block, value in zip(hits, (1.0, 2.0), strict=True):
        assert bool((pool.kv[0, :, block] == value).all())
    bm.free("b")
    bm.check_integrity()


def test_blocks_handed_out_while_their_pages_are_saved_wait_for_the_save(monkeypatch):
    """Saves to host RAM are held on their thread: the request handed the blocks of a spill,
    and later the one handed blocks saved ahead, are not ready until the saves are done;
    meanwhile the pages are already findable in host RAM, and load back intact. Outside
    the background, a spill is saved before `allocate` returns, and nothing waits for it."""
    pool = DeviceKVPool(KVCacheSpec(1, 1, 16, 4, torch.float32), 4, CPU, "thread")
    store = TieredKVStore(pool.spec.bytes_per_block, host_blocks=8)
    bm = BlockManager(4, 4, connector=TierConnector(KVOffloader(pool, store)))
    gate = hold_saves(monkeypatch, pool)

    def cache(rid: str, tokens: list[int], value: float) -> list[bytes]:
        hashes = chain_hashes(root_hash("t"), tokens, 4, 0)
        bm.allocate(rid, len(tokens))
        for block in bm.block_table(rid)[: len(hashes)]:
            pool.kv[0, :, block] = value
        bm.commit(rid, hashes)
        bm.free(rid)
        return hashes

    doc = cache("doc", list(range(9)), 1.0)
    bm.allocate("other", 16, background=True)  # the document's two pages go on their own
    assert bm.load_tickets(["other"]) and not bm.loads_ready("other")
    assert bm.lookup(doc) == [] and len(bm.lookup_below("x", doc)) == 2
    gate.set()
    pool.loads.finish()
    assert bm.loads_ready("other") and not bm.load_tickets(["other"])
    bm.free("other")

    gate.clear()
    second = cache("second", list(range(100, 109)), 2.0)
    assert bm.spill_ahead(4) == 2  # the second document's pages, saved ahead
    bm.allocate("next", 16)  # its blocks too, among the others
    assert not bm.loads_ready("next")
    gate.set()
    bm.free("next")  # waits for the save
    for hashes, value in ((doc, 1.0), (second, 2.0)):
        bm.allocate("back", 9, [], hashes)
        assert bm.load_below("back", 0, hashes) == [Tier.HOST, Tier.HOST]
        pool.loads.finish()
        for block in bm.block_table("back")[:2]:
            assert bool((pool.kv[0, :, block] == value).all())
        bm.free("back")
    bm.check_integrity()

    gate.clear()  # held from here on: a spill in the device's order is done on return
    third = cache("third", list(range(200, 209)), 3.0)
    bm.allocate("small", 16)
    assert not bm.load_tickets(["small"]) and bm.loads_ready("small")
    slots = [store.host_row(h) for h in third]
    assert all(bool((store.host.data[s].view(torch.float32) == 3.0).all()) for s in slots)
    bm.free("small")
    bm.check_integrity()
