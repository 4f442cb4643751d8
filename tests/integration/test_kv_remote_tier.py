"""The remote tier against a real valkey-server: pages saved behind and fetched back whole,
values of another format or torn are misses and counted, a tenant at its quota loses its
own oldest pages only, and a store that is gone costs misses, never a wait past the bound."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import torch

from kvstore.disk_page import PageFormat
from kvstore.remote import KEY_PREFIX, TENANT_PREFIX, RemoteConfig, RemoteKVTier
from kvstore.tiers import TieredKVStore
from tenants.store import EmbeddedStore

PAGE = 1024
FORMAT = PageFormat(model_id="m", namespace="m|float32", kv_dtype="float32", layout=(2, 1, 8, 4))


@pytest.fixture
def cache_store(tmp_path: Path) -> Iterator[EmbeddedStore]:
    store = EmbeddedStore(tmp_path / "kv-remote", max_bytes=64 << 20)
    store.start()
    yield store
    store.stop()


def tier(url: str, page_format: PageFormat = FORMAT, timeout_s: float = 0.5) -> RemoteKVTier:
    return RemoteKVTier(RemoteConfig(url, timeout_s=timeout_s), page_format, PAGE)


def page(i: int) -> torch.Tensor:
    return torch.full((PAGE,), i % 251, dtype=torch.uint8)


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def flushed(remote: RemoteKVTier, n: int) -> None:
    deadline = time.monotonic() + 10
    while (remote.reap(), remote.num_saved + remote.num_save_dropped)[1] < n:
        assert time.monotonic() < deadline, "saves not sent"
        time.sleep(0.01)


def fetched(remote: RemoteKVTier, keys: list[bytes]):
    fetch = remote.fetch(keys)
    assert fetch is not None
    while not remote.settle(fetch):
        remote.wait_reads(0.05)
    return fetch


def test_saved_pages_come_back_whole_on_another_tier(cache_store):
    writer, reader = tier(cache_store.url), tier(cache_store.url)
    for i in range(5):
        assert writer.save(key(i), page(i), "alpha")
    flushed(writer, 5)
    fetch = fetched(reader, [key(i) for i in range(7)])  # the last two were never saved
    assert fetch.good == {key(i) for i in range(5)}
    for i in range(5):
        got = fetch.page(key(i))
        assert got is not None and torch.equal(got, page(i))
    assert writer.pages_by_owner() == {"alpha": 5}
    writer.close()
    reader.close()


def test_a_torn_or_foreign_value_is_a_miss_and_counted(cache_store):
    writer = tier(cache_store.url)
    for i in range(3):
        writer.save(key(i), page(i), "alpha")
    flushed(writer, 3)
    client = redis.Redis.from_url(cache_store.url)
    value = bytearray(client.get(KEY_PREFIX + key(1)))
    value[-1] ^= 0xFF  # a payload byte: the CRC-32 no longer matches
    client.set(KEY_PREFIX + key(1), bytes(value))
    reader = tier(cache_store.url)
    fetch = fetched(reader, [key(0), key(1), key(2)])
    assert fetch.good == {key(0)}  # the prefix ends at the torn page
    assert reader.num_rejected == 1
    other_model = tier(cache_store.url, PageFormat(model_id="other", layout=(2, 1, 8, 4)))
    assert fetched(other_model, [key(0)]).good == set()
    assert other_model.num_rejected == 1
    client.set(KEY_PREFIX + key(0), b"short")
    assert fetched(reader, [key(0)]).good == set()
    assert reader.num_rejected == 2
    for t in (writer, reader, other_model):
        t.close()


def test_a_tenant_at_its_quota_evicts_only_its_own_oldest_pages(cache_store):
    remote = tier(cache_store.url)
    remote.set_quota("alpha", 3 * PAGE)
    for i in range(4):  # beta first: its pages are the oldest in the store
        remote.save(key(100 + i), page(i), "beta")
    for i in range(6):
        remote.save(key(i), page(i), "alpha")
    flushed(remote, 10)
    client = redis.Redis.from_url(cache_store.url)
    present = {i for i in [*range(6), *range(100, 104)] if client.exists(KEY_PREFIX + key(i))}
    assert present == {3, 4, 5, 100, 101, 102, 103}  # alpha's newest three, all of beta's
    assert int(client.get(TENANT_PREFIX + "alpha:bytes")) == 3 * PAGE
    assert client.zcard(TENANT_PREFIX + "alpha:pages") == 3
    assert remote.num_quota_evicted == 3
    assert remote.pages_by_owner() == {"alpha": 3, "beta": 4}
    remote.set_quota("alpha", 0)  # nothing more of alpha's is kept
    remote.save(key(50), page(50), "alpha")
    flushed(remote, 11)
    assert not client.exists(KEY_PREFIX + key(50))
    remote.close()


def test_a_store_that_is_gone_drops_saves_and_misses_within_the_bound(tmp_path):
    store = EmbeddedStore(tmp_path / "kv-remote", max_bytes=16 << 20)
    store.start()
    remote = tier(store.url, timeout_s=0.2)
    remote.save(key(0), page(0), "alpha")
    flushed(remote, 1)
    store.kill()
    remote.save(key(1), page(1), "alpha")
    flushed(remote, 2)
    assert remote.num_save_dropped == 1
    fetch = remote.fetch([key(0)])  # the store was just found down: no fetch at all
    if fetch is not None:
        while not remote.settle(fetch):
            remote.wait_reads(0.05)
        assert fetch.good == set()
    assert not remote.save(key(2), page(2), "alpha")  # dropped at once while it is down
    remote.close()


def test_pages_leaving_host_ram_are_saved_to_the_remote_tier(cache_store):
    remote = tier(cache_store.url)
    store = TieredKVStore(PAGE, host_blocks=2, remote=remote)
    for i in range(4):
        store.put(key(i), page(i), owner="alpha")
    flushed(remote, 2)  # the two oldest left host RAM: no disk, so only the remote keeps them
    assert store.num_dropped == 2
    reader = tier(cache_store.url)
    assert fetched(reader, [key(0), key(1), key(2)]).good == {key(0), key(1)}
    assert store.pages_by_owner() == {"alpha": {"host": 2, "remote": 2}}
    store.close()
    reader.close()


def test_a_frozen_store_is_a_timed_out_miss_and_the_tier_leaves_it_alone(tmp_path):
    store = EmbeddedStore(tmp_path / "kv-remote", max_bytes=16 << 20)
    store.start()
    assert store.proc is not None
    remote = tier(store.url, timeout_s=0.2)
    remote.save(key(0), page(0), "alpha")
    flushed(remote, 1)
    store.proc.send_signal(signal.SIGSTOP)  # it accepts nothing, answers nothing
    try:
        fetch = remote.fetch([key(0)])
        assert fetch is not None
        while not remote.settle(fetch):
            remote.wait_reads(0.05)
        assert fetch.good == set() and remote.num_load_timeouts == 1
        assert remote.down  # for a while, fetches are skipped and saves dropped at once
        assert remote.fetch([key(0)]) is None
        assert not remote.save(key(1), page(1), "alpha")
    finally:
        store.proc.send_signal(signal.SIGCONT)
    remote.close()
    store.stop()


def test_a_page_the_store_evicted_is_saved_again_when_computed_again(cache_store):
    remote = tier(cache_store.url)
    remote.save(key(0), page(0), "alpha")
    flushed(remote, 1)
    assert remote.save(key(0), page(0), "alpha") and remote.num_saved == 1  # not sent twice
    client = redis.Redis.from_url(cache_store.url)
    client.delete(KEY_PREFIX + key(0))  # as the server's LRU would
    assert fetched(remote, [key(0)]).good == set()
    assert remote.pages_by_owner() == {}  # no longer counted as held
    remote.save(key(0), page(0), "alpha")
    flushed(remote, 2)
    assert client.exists(KEY_PREFIX + key(0))
    remote.close()
