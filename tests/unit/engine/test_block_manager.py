import pytest

from engine.block_hash import chain_hashes, root_hash
from engine.block_manager import BlockManager
from kvstore.connector import TierConnector


def test_allocates_on_demand_and_frees_everything():
    bm = BlockManager(num_blocks=8, block_size=4)
    assert bm.allocate("a", 1) == bm.block_table("a")
    assert len(bm.block_table("a")) == 1
    bm.allocate("a", 4)
    assert len(bm.block_table("a")) == 1  # still fits in the first block
    bm.allocate("a", 5)
    assert len(bm.block_table("a")) == 2
    bm.allocate("b", 9)
    assert len(bm.block_table("b")) == 3
    assert bm.allocate("b", 2) == bm.block_table("b")  # fewer tokens (refused drafts): as is
    assert len(bm.block_table("b")) == 3
    assert bm.num_free_blocks == 3
    bm.check_integrity()
    assert bm.free("a") == 2
    assert bm.num_free_blocks == 5
    assert not bm.owns_blocks("a")
    bm.check_integrity()


def test_can_allocate_counts_only_new_blocks():
    bm = BlockManager(num_blocks=3, block_size=4)
    bm.allocate("a", 8)
    assert bm.can_allocate("a", 12)
    assert not bm.can_allocate("a", 13)
    assert bm.num_new_blocks("a", 13) == 2
    assert not bm.can_allocate("b", 5)


def test_integrity_detects_double_ownership():
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.allocate("a", 4)
    bm._tables["b"] = list(bm._tables["a"])  # corrupt on purpose: shared without a ref
    with pytest.raises(AssertionError, match="reference counts"):
        bm.check_integrity()


def test_integrity_detects_leak():
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.allocate("a", 4)
    bm._tables.pop("a")
    with pytest.raises(AssertionError, match="reference counts"):
        bm.check_integrity()


def test_integrity_detects_a_free_block_that_is_held():
    bm = BlockManager(num_blocks=4, block_size=4)
    table = bm.allocate("a", 4)
    bm._free[table[0]] = None
    with pytest.raises(AssertionError, match="free list"):
        bm.check_integrity()


H = chain_hashes(root_hash("m|bf16|"), list(range(100, 116)), block_size=4, start=0)


def test_hash_chain_covers_the_prefix_and_the_namespace():
    tokens = list(range(100, 116))
    assert len(H) == 4 and len(set(H)) == 4
    assert chain_hashes(H[1], tokens, 4, start=2) == H[2:]  # resumable
    other = list(tokens)
    other[0] = 7  # a change in block 0 changes every later hash
    assert not set(chain_hashes(root_hash("m|bf16|"), other, 4, 0)) & set(H)
    assert not set(chain_hashes(root_hash("m|bf16|salt"), tokens, 4, 0)) & set(H)
    assert chain_hashes(root_hash("m|bf16|"), tokens[:15], 4, 0) == H[:3]  # full blocks only


def test_cached_blocks_are_shared_reference_counted_and_outlive_their_request():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = list(bm.allocate("a", 12))
    bm.commit("a", H[:3])
    assert bm.lookup(H) == a  # the first three; the fourth was never committed
    hits = bm.lookup(H[:2])
    assert bm.can_allocate("b", 10, hits)
    b = bm.allocate("b", 10, hits)
    assert b[:2] == a[:2] and b[2] not in a
    assert bm.num_free_blocks == 8 - 4
    bm.check_integrity()
    bm.free("a")
    bm.free("b")
    assert bm.num_free_blocks == 8  # nobody holds them ...
    assert bm.lookup(H) == a  # ... and they are still found
    c = bm.allocate("c", 4, bm.lookup(H[:1]))  # revive a free cached block
    assert c == a[:1] and bm.num_free_blocks == 7
    bm.check_integrity()


def test_reuse_evicts_the_least_recently_freed_block_first():
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.allocate("a", 8)
    bm.commit("a", H[:2])
    bm.free("a")  # a's last block goes on the list first
    fresh = bm.allocate("x", 4)  # two never-used blocks come before them
    bm.allocate("y", 4)
    assert bm.lookup(H) == bm.lookup(H[:2]) and len(bm.lookup(H)) == 2
    bm.allocate("z", 4)  # evicts a's second block: its chain stops after block 0
    assert len(bm.lookup(H)) == 1 and bm.num_evicted_blocks == 1
    assert fresh != bm.lookup(H)
    bm.check_integrity()


def test_can_allocate_counts_revived_free_hits():
    bm = BlockManager(num_blocks=3, block_size=4)
    bm.allocate("a", 8)
    bm.commit("a", H[:2])
    bm.free("a")
    bm.allocate("x", 4)  # one fresh block left free, plus the two cached ones
    hits = bm.lookup(H[:2])
    assert len(hits) == 2
    assert bm.can_allocate("b", 8, hits)  # takes both cached blocks off the free list
    assert not bm.can_allocate("b", 13, hits)  # ... and then needs two more: only one left


def test_a_duplicate_hash_keeps_the_first_block_and_caching_can_be_off():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = bm.allocate("a", 4)
    bm.allocate("b", 4)
    bm.commit("a", H[:1])
    bm.commit("b", H[:1])
    assert bm.lookup(H[:1]) == a and bm.num_cached_blocks == 1
    off = BlockManager(num_blocks=8, block_size=4, enable_caching=False)
    off.allocate("a", 4)
    off.commit("a", H[:1])
    assert off.lookup(H[:1]) == []


def test_a_tenant_over_its_share_loses_cached_blocks_first():
    bm = BlockManager(8, 4)

    def cache(rid: str, owner: str, blocks: int, salt: str) -> None:
        tokens = list(range(blocks * 4))
        bm.allocate(rid, len(tokens), owner=owner)
        bm.commit(rid, chain_hashes(root_hash(salt), tokens, 4, 0))
        bm.free(rid)

    cache("b", "beta", 2, "b")  # the oldest cached blocks, within beta's share (8 / 2)
    cache("a", "acme", 6, "a")  # acme holds 6 > 4
    assert bm.blocks_by_owner() == {"beta": 2, "acme": 6}
    bm.allocate("new", 4 * 2, owner="gamma")  # needs 2 blocks: acme's go, not beta's
    assert bm.blocks_by_owner() == {"beta": 2, "acme": 4, "gamma": 2}
    bm.free("new")
    bm.allocate("more", 4 * 6, owner="gamma")  # acme is at its share now: plain LRU order
    assert bm.blocks_by_owner()["gamma"] == 6 and "beta" not in bm.blocks_by_owner()
    bm.check_integrity()


def _until_read(bm: BlockManager, request_id: str, hashes: list[bytes]) -> None:
    for _ in range(100):
        if bm.prefetch_below(request_id, hashes):
            return
        bm.wait_below(0.1)
    raise AssertionError(f"{request_id}'s pages were never read")


def test_disk_reads_ahead_start_in_turn_within_their_budget(tmp_path, monkeypatch):
    import torch

    from kvstore import disk as disk_module
    from kvstore.tiers import Tier
    from tests.unit.kvstore.test_disk import HeldReaders, on_disk
    from tests.unit.kvstore.test_tiers import key

    pool, store, offloader = on_disk(tmp_path, num_pages=6)
    disk = store.disk
    monkeypatch.setattr(disk_module, "PREFETCH_BYTES", 4 * disk.slot_nbytes)
    bm = BlockManager(16, 4, connector=TierConnector(offloader))
    big, small, tiny = [key(b) for b in range(3)], [key(3), key(4)], [key(5)]
    original = pool.read_pages([0, 1, 2, 3, 4, 5])
    held = HeldReaders(store)
    assert not bm.prefetch_below("big", big)
    assert not bm.prefetch_below("small", small), "3 + 2 pages exceed the budget of 4"
    assert not bm.prefetch_below("tiny", tiny), "it would fit, but `small` asked first"
    assert len(disk.open_fetches) == 1
    held.release()
    _until_read(bm, "big", big)
    assert not bm.prefetch_below("tiny", tiny), "still `small`'s turn"
    bm.check_integrity()
    blocks = []
    for rid, hashes in (("big", big), ("small", small), ("tiny", tiny)):
        _until_read(bm, rid, hashes)
        blocks += bm.allocate(rid, 4 * len(hashes))
        assert bm.load_below(rid, 0, hashes) == [Tier.DISK] * len(hashes)
    assert torch.equal(pool.read_pages(blocks), original)
    assert not disk.open_fetches
    bm.check_integrity()
    store.close()


def test_a_request_refused_read_ahead_room_that_leaves_gives_up_its_turn(tmp_path, monkeypatch):
    from kvstore import disk as disk_module
    from tests.unit.kvstore.test_disk import HeldReaders, on_disk
    from tests.unit.kvstore.test_tiers import key

    _, store, offloader = on_disk(tmp_path)
    monkeypatch.setattr(disk_module, "PREFETCH_BYTES", 2 * store.disk.slot_nbytes)
    bm = BlockManager(16, 4, connector=TierConnector(offloader))
    held = HeldReaders(store)
    assert not bm.prefetch_below("first", [key(0), key(1)])
    assert not bm.prefetch_below("refused", [key(2)])
    assert not bm.prefetch_below("later", [key(3)])
    bm.free("refused")  # aborted while waiting: "later" no longer waits behind it
    bm.free("first")
    bm.check_integrity()
    held.release()
    _until_read(bm, "later", [key(3)])
    assert len(bm.lookup_below("later", [key(3)])) == 1
    bm.free("later")
    bm.check_integrity()
    store.close()
