"""A worker in a fleet: its sealed record in the store, renewed by a heartbeat and gone when
it stops; the KV blocks it caches reported by tier, under the same keys a gateway computes
from the prompt with the tenant's salt. A real worker process and a real store."""

from __future__ import annotations

import asyncio
import re
import secrets
import time

import msgspec
import pytest

from engine.block_hash import prompt_keys
from engine.client import EngineClient
from engine.fleet import (
    EVENTS,
    KV_EVENTS,
    RECORD_TTL_MS,
    WORKERS,
    KVEvent,
    record_key,
    snapshot_key,
    unseal,
)
from engine.handshake import ClientAuth
from engine.protocol import SamplingParams, Scheduling
from tests.integration.conftest import TINY_WORKER, WorkerProcess, _free_port

SECRET = secrets.token_urlsafe(32)


async def wait_for(predicate, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while not (value := await predicate()):
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)
    return value


@pytest.fixture
def fleet_worker(tmp_path, strata_cache_dir, store_server):
    port = _free_port()
    worker = WorkerProcess(
        tmp_path / "unused.sock",
        [*TINY_WORKER, "--registry-url", store_server.url, "--worker-id", "w-test"],
        strata_cache_dir,
        address=f"tcp://127.0.0.1:{port}",
        env={"STRATA_WORKER_SECRET": SECRET},
    )
    worker.start()
    yield worker
    worker.stop()


async def test_a_worker_registers_reports_its_blocks_and_leaves(fleet_worker, redis_client):
    async def record():
        blob = await redis_client.get(record_key("w-test"))
        return blob and unseal(blob, SECRET)

    rec = await wait_for(record)
    assert rec.address == fleet_worker.address and rec.model_id.startswith("synthetic")
    assert rec.kv_block_size == 4 and rec.num_kv_blocks_total == 64 and rec.cache_namespace
    assert 0 < await redis_client.pttl(record_key("w-test")) <= RECORD_TTL_MS  # unless renewed
    assert await redis_client.zscore(WORKERS, "w-test") > time.time() * 1000
    assert unseal(await redis_client.get(record_key("w-test")), "x" * 32) is None  # sealed
    beat = rec.heartbeat_at
    renewed = await wait_for(lambda: _later(redis_client, beat))
    assert renewed.heartbeat_at > beat

    pubsub = redis_client.pubsub()
    await pubsub.subscribe(KV_EVENTS)
    client = EngineClient(fleet_worker.address, auth=ClientAuth(secret=SECRET))
    prompt = list(range(1, 14))  # three full blocks of 4
    scheduling = Scheduling(tenant="acme", cache_salt="tenant:salt-a")
    async for _ in client.generate(
        "r1", prompt, SamplingParams(max_tokens=1), scheduling=scheduling
    ):
        pass
    await client.close()
    want = prompt_keys(rec.cache_namespace, "tenant:salt-a", "", prompt, 4)
    assert len(want) == 3

    async def reported() -> set[int]:
        message = await pubsub.get_message(timeout=1.0)
        if message is None or message["type"] != "message":
            return set()
        event = msgspec.msgpack.decode(message["data"], type=KVEvent)
        return set(event.added.get("device", [])) & set(want)

    assert await wait_for(reported) == set(want)
    await pubsub.aclose()
    other_tenant = prompt_keys(rec.cache_namespace, "tenant:salt-b", "", prompt, 4)
    assert not set(other_tenant) & set(want)  # another salt: other keys

    async def snapshot_has_them() -> bool:
        blob = await redis_client.get(snapshot_key("w-test"))
        if blob is None:
            return False
        snap = msgspec.msgpack.decode(blob, type=KVEvent)
        return snap.snapshot and set(want) <= set(snap.added.get("device", []))

    await wait_for(snapshot_has_them)

    events = redis_client.pubsub()
    await events.subscribe(EVENTS)
    fleet_worker.stop()
    assert not await redis_client.exists(record_key("w-test"), snapshot_key("w-test"))
    assert await redis_client.zscore(WORKERS, "w-test") is None

    async def left() -> bool:
        message = await events.get_message(timeout=1.0)
        return message is not None and message["data"] == b"leave w-test"

    await wait_for(left, timeout=5)
    await events.aclose()


async def _later(redis_client, beat: float):
    blob = await redis_client.get(record_key("w-test"))
    rec = blob and unseal(blob, SECRET)
    return rec if rec and rec.heartbeat_at > beat else None


def test_a_worker_without_the_fleet_secret_does_not_register(
    tmp_path, strata_cache_dir, store_server
):
    worker = WorkerProcess(
        tmp_path / "w.sock", [*TINY_WORKER, "--registry-url", store_server.url], strata_cache_dir
    )
    with pytest.raises(RuntimeError, match="exited with 2"):
        worker.start()


async def test_with_the_store_down_a_gateway_routes_on_its_last_view_and_says_so(
    tmp_path, strata_cache_dir, private_store
):
    """The registry is out of reach: a fail_open tenant is still served by the registered
    worker, /ready stays 200 as "degraded" and /metrics shows the registry down, until the
    store is back."""
    import httpx

    from tests.integration.conftest import GatewayServer, gateway_settings

    worker = WorkerProcess(
        tmp_path / "unused.sock",
        [*TINY_WORKER, "--registry-url", private_store.url, "--worker-id", "w-down"],
        strata_cache_dir,
        address=f"tcp://127.0.0.1:{_free_port()}",
        env={"STRATA_WORKER_SECRET": SECRET},
    )
    worker.start()
    settings = gateway_settings(
        private_store.url, None, strata_cache_dir, worker_secret=SECRET, model="synthetic:tiny"
    )
    gateway = GatewayServer(settings)
    gateway.start()
    try:
        _, key = gateway.new_tenant(on_store_unavailable="fail_open")
        body = {"model": "synthetic:tiny", "prompt": "one two three", "max_tokens": 2}
        auth = {"authorization": f"Bearer {key}"}
        async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as http:

            async def scrape() -> str:
                return (await http.get("/metrics")).text

            async def registry_up(value: int) -> bool:
                return f'strata:fleet_registry_up{{process="0"}} {value}.0' in await scrape()

            await wait_for(lambda: registry_up(1))
            assert (await http.post("/v1/completions", json=body, headers=auth)).status_code == 200
            text = await scrape()
            assert re.search(
                r'strata:fleet_workers{model="[^"]+",process="0",state="serving"} 1.0', text
            )
            ready = await http.get("/ready")
            assert ready.status_code == 200 and ready.json()["status"] == "ready"

            private_store.kill()
            await wait_for(lambda: registry_up(0))
            served = await http.post("/v1/completions", json=body, headers=auth)
            assert served.status_code == 200, served.text
            ready = await http.get("/ready")
            assert ready.status_code == 200
            assert ready.json() | {"engine_errors": []} == {
                "status": "degraded",
                "store": False,
                "registry": False,
                "engine": True,
                "engine_errors": [],
            }

            private_store.start()
            await wait_for(lambda: registry_up(1))
            assert (await http.get("/ready")).json()["status"] == "ready"
    finally:
        gateway.stop()
        worker.stop()
