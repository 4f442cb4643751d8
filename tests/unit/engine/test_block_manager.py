import pytest

from engine.block_manager import BlockManager


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
    bm._tables["b"] = list(bm._tables["a"])  # corrupt on purpose
    with pytest.raises(AssertionError, match="owned twice"):
        bm.check_integrity()


def test_integrity_detects_leak():
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.allocate("a", 4)
    bm._tables.pop("a")
    with pytest.raises(AssertionError, match="leaked"):
        bm.check_integrity()
