"""Each tier below the device through `KVTier` alone (host RAM, disk, the remote tier on a
real valkey-server): pages written for two owners are held and counted per owner, a read
ahead gives back the very bytes written, and the tier's integrity holds. Then one request
reading ahead from disk and from the remote tier at once, through the connector."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvstore.base import KVTier, PageFetch, ReadAheadTier, Tier
from kvstore.connector import TierConnector
from kvstore.disk import DiskKVPool
from kvstore.disk_page import PageFormat
from kvstore.host import HostKVPool
from kvstore.remote import RemoteConfig, RemoteKVTier
from kvstore.tiers import KVOffloader, TieredKVStore
from tenants.store import EmbeddedStore
from tests.unit.kvstore.test_tiers import filled_pool, key

PAGE = 4096
FORMAT = PageFormat(model_id="m", namespace="m|bf16", kv_dtype="bfloat16", layout=(3, 2, 64, 4))


def page(i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    return torch.randint(0, 256, (PAGE,), generator=g, dtype=torch.uint8)


def remote_tier(store: EmbeddedStore, page_nbytes: int = PAGE) -> RemoteKVTier:
    return RemoteKVTier(RemoteConfig(store.url, timeout_s=2.0), FORMAT, page_nbytes)


def written_behind(tier: KVTier) -> None:
    """Wait until the writes a tier took have landed (the remote tier's are sent by a
    thread of its own; the others' are known at once)."""
    if isinstance(tier, RemoteKVTier):
        deadline = time.monotonic() + 10
        while not tier.idle:
            assert time.monotonic() < deadline, "saves not sent"
            time.sleep(0.01)


def settled(tier: ReadAheadTier[PageFetch], fetch: PageFetch) -> PageFetch:
    deadline = time.monotonic() + 10
    while not tier.settle(fetch):
        assert time.monotonic() < deadline, "a read ahead never settled"
        tier.wait_reads(0.05)
    return fetch


def make_tier(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> KVTier:
    if kind == "host":
        return HostKVPool(PAGE, 8, pin=False)
    if kind == "disk":
        return DiskKVPool(tmp_path, PAGE, 8)
    return remote_tier(request.getfixturevalue("private_store"))


@pytest.fixture(params=["host", "disk", "remote"])
def tier(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[KVTier]:
    made = make_tier(request.param, request, tmp_path)
    yield made
    made.close()


def test_each_tier_holds_counts_and_gives_back_the_pages_written(tier: KVTier):
    pages = {key(i): page(i) for i in range(6)}
    owners = {key(i): "b" if i % 3 == 0 else "a" for i in range(6)}  # a: 4 pages, b: 2
    for k, p in pages.items():
        assert tier.write(k, p, owners[k])
    assert tier.write(key(0), page(0), "b"), "a page held already is kept once"
    written_behind(tier)

    assert all(tier.holds(k) for k in pages)
    assert not tier.holds(key(99))
    assert tier.pages_by_owner() == {"a": 4, "b": 2}
    tier.check_integrity()

    if tier.shared:  # fetched past what the worker's tiers hold, in chain order
        assert isinstance(tier, RemoteKVTier)
        reader: ReadAheadTier[PageFetch] = tier
    elif isinstance(tier, DiskKVPool):
        reader = tier
    else:  # host RAM has nothing to read ahead: loads read its rows in place
        assert isinstance(tier, HostKVPool)
        for k, p in pages.items():
            assert torch.equal(tier.data[tier.slots[k]], p)
        return
    chain = [*pages, key(99)]
    fetch = reader.fetch(chain)
    assert fetch is not None and fetch.tier is tier.tier
    assert reader.open_fetches == [fetch]
    settled(reader, fetch)
    assert fetch.settled and set(fetch.good) == set(pages)  # the missing last page is a miss
    for k, p in pages.items():
        got = fetch.page(k)
        assert got is not None and torch.equal(got, p), "a page read ahead differs"
    assert fetch.page(key(99)) is None
    tier.check_integrity()
    reader.release(fetch)
    assert not reader.open_fetches and not reader.fetching
    tier.check_integrity()


@pytest.mark.parametrize("kind", ["host", "disk"])  # the remote tier bounds bytes, not pages
def test_pages_beyond_an_owners_limit_are_not_kept(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path
):
    tier = make_tier(kind, request, tmp_path)
    assert tier.write(key(1), page(1), "a", limit=1)
    kept = tier.write(key(2), page(2), "a", limit=1)  # disk: in place of page 1; host: refused
    assert [tier.holds(key(1)), tier.holds(key(2))] == [not kept, kept]
    assert not tier.write(key(3), page(3), "none", limit=0)
    assert not tier.holds(key(3))
    assert tier.pages_by_owner() == {"a": 1}
    tier.check_integrity()
    tier.close()


def test_one_request_reads_ahead_from_disk_and_the_remote_tier_at_once(
    tmp_path: Path, private_store: EmbeddedStore
):
    pool = filled_pool(torch.bfloat16)
    nbytes = pool.spec.bytes_per_block
    remote = remote_tier(private_store, nbytes)
    store = TieredKVStore(nbytes, host_blocks=2, disk_blocks=8, disk_dir=tmp_path, remote=remote)
    connector = TierConnector(KVOffloader(pool, store))
    assert connector.has_disk and connector.has_remote
    expected = pool.read_pages([0, 1, 2, 3]).clone()
    chain = [key(i) for i in range(4)]
    # pages 0 and 1 pushed out of host RAM (to disk and the remote tier) by two others;
    # pages 2 and 3 only in the remote tier, as another worker would have left them
    for i in (0, 1, 4, 5):
        store.put(key(i), pool.read_pages([i])[0], owner="t")
    for i in (2, 3):
        assert remote.write(key(i), expected[i], "t")
    written_behind(remote)
    assert [store.tier_of(k) for k in chain] == [Tier.DISK, Tier.DISK, None, None]

    assert connector.find("r", chain) == 2
    deadline = time.monotonic() + 10
    while not connector.read_ahead("r", chain[:2], chain[2:], "t"):
        assert time.monotonic() < deadline, "reads ahead never settled"
        connector.wait_reads(0.05)
    assert connector.fetched("r")
    assert connector.find("r", chain) == 4
    connector.check_integrity()

    tiers, _ = connector.load("r", [4, 5, 6, 7], chain)
    assert connector.finish_loads() == []
    assert tiers == [Tier.DISK, Tier.DISK, Tier.REMOTE, Tier.REMOTE]
    assert torch.equal(pool.read_pages([4, 5, 6, 7]), expected), "a page loaded differs"
    connector.check_integrity()  # the reads ahead were released with the load
    assert not store.readers[Tier.DISK].open_fetches
    assert not store.readers[Tier.REMOTE].open_fetches
    store.close()
