import pytest

from tenants.store import EmbeddedStore, StoreError, connect, find_server_binary, ping


def test_binary_is_found():
    assert find_server_binary().endswith(("valkey-server", "redis-server"))


async def test_embedded_store_persists_with_aof(tmp_path):
    store = EmbeddedStore(tmp_path / "data")
    store.start()
    client = connect(store.url)
    await client.set(b"strata:test", b"kept")
    await client.aclose()
    store.stop()
    assert (tmp_path / "data" / "appendonlydir").is_dir()
    store.start()  # a restart replays the AOF
    client = connect(store.url)
    assert await client.get(b"strata:test") == b"kept"
    await client.aclose()
    store.stop()


async def test_ping_reports_a_dead_store(private_store):
    client = connect(private_store.url, timeout=0.5)
    assert await ping(client)
    private_store.kill()
    assert not await ping(client)
    await client.aclose()


def test_bad_binary_is_a_clear_error(tmp_path):
    fake = tmp_path / "valkey-server"
    fake.write_text("#!/bin/sh\nexit 3\n")
    fake.chmod(0o755)
    with pytest.raises(StoreError, match="exited with 3"):
        EmbeddedStore(tmp_path / "d", binary=str(fake)).start()
