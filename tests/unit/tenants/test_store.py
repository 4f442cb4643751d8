import asyncio
import contextlib
import logging

import pytest

from tenants.store import (
    EmbeddedStore,
    StoreError,
    cancel_and_wait,
    connect,
    find_server_binary,
    ping,
)


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


async def test_a_loop_that_talks_to_the_store_ends_once_cancelled(redis_client):
    """On Python 3.11 a cancellation that lands just as redis-py sends a command is lost
    (its `asyncio.wait_for` returns normally): a single `cancel()` leaves such a loop running
    most of the time here, and an `await` on it waits forever."""

    async def commands() -> None:
        while True:
            await redis_client.ping()

    for i in range(8):
        task = asyncio.create_task(commands())
        await asyncio.sleep(i % 4 * 0.001)
        assert await cancel_and_wait(task, timeout=10.0)
        assert task.cancelled()


async def test_a_task_that_will_not_end_is_given_up_on_and_named(caplog):
    release = asyncio.Event()

    async def stubborn() -> None:
        while not release.is_set():
            with contextlib.suppress(asyncio.CancelledError):
                await release.wait()

    task = asyncio.create_task(stubborn(), name="stubborn")
    await asyncio.sleep(0)  # it waits, and swallows every cancellation from now on
    with caplog.at_level(logging.WARNING, logger="tenants.store"):
        assert not await cancel_and_wait(task, timeout=0.3)
    assert "task stubborn did not end" in caplog.text
    release.set()
    await asyncio.wait([task], timeout=10.0)
    assert task.done()
