"""Nothing billed is lost: a stream longer than its lease keeps its reservation to the end,
and usage records pending when a gateway is killed or stopped with the store down are
written exactly once (journal replay at the next start, or the drain at SIGTERM)."""

from __future__ import annotations

import asyncio
import signal
import time

import httpx
import pytest

from policies.admission import tenant_keys
from tenants.ledger import Ledger
from tenants.store import connect
from tests.integration.conftest import (
    GatewayProcess,
    GatewayServer,
    gateway_settings,
)

MODEL = "SmolLM2-135M-Instruct"


def chat_body(max_tokens: int = 2, **extra) -> dict:
    return {
        "model": "default",
        "max_tokens": max_tokens,
        "temperature": 0,
        "messages": [{"role": "user", "content": "Hi"}],
        **extra,
    }


async def post(url: str, key: str, body: dict) -> httpx.Response:
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        return await client.post(
            "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}
        )


async def test_a_stream_longer_than_its_lease_keeps_its_slot_to_the_end(
    store_server, smollm2_worker, strata_cache_dir, redis_client
):
    ttl = 0.5
    settings = gateway_settings(store_server.url, smollm2_worker, strata_cache_dir, lease_ttl_s=ttl)
    server = GatewayServer(settings)
    server.start()
    try:
        tid, key = server.new_tenant(max_concurrent=1, tpm=100_000)
        body = chat_body(max_tokens=400, min_tokens=400, stream=True)
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            request = client.build_request(
                "POST",
                "/v1/chat/completions",
                json=body,
                headers={"authorization": f"Bearer {key}"},
            )
            response = await client.send(request, stream=True)
            rid = response.headers["x-request-id"]
            started, checked = time.monotonic(), 0
            async for line in response.aiter_lines():
                if time.monotonic() - started > 3 * ttl and checked < 2:
                    # well past the lease: the slot is still held, the lease still ahead
                    second = await post(server.url, key, chat_body())
                    assert second.status_code == 429, second.text
                    assert second.json()["error"]["code"] == "rate_limit_concurrency"
                    deadline = await redis_client.zscore(tenant_keys(tid)["leases"], rid)
                    (now_s, now_us) = await redis_client.time()
                    assert deadline > now_s * 1e6 + now_us
                    checked += 1
                    started = time.monotonic()
                if line == "data: [DONE]":
                    break
            await response.aclose()
        assert checked == 2, "the stream ended before outliving its lease twice"
        ledger = Ledger(redis_client)
        deadline = time.monotonic() + 10
        while (record := await ledger.get(rid)) is None:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        assert record.completion_tokens == 400

        async def released() -> bool:
            return not await redis_client.exists(*(tenant_keys(tid)[r] for r in ("res", "lapsed")))

        deadline = time.monotonic() + 10
        while not await released():  # settled by the release, not by expiry
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        assert (await post(server.url, key, chat_body())).status_code == 200
    finally:
        server.stop()


@pytest.fixture
def gateway_process(private_store, smollm2_worker, strata_cache_dir, tmp_path):
    gateways: list[GatewayProcess] = []

    def start() -> GatewayProcess:
        gw = GatewayProcess(private_store.url, smollm2_worker, strata_cache_dir, tmp_path / "gw")
        gw.start()
        gateways.append(gw)
        return gw

    yield start
    for gw in gateways:
        gw.stop()


async def _records(store_url: str, request_ids: list[str]) -> dict:
    client = connect(store_url)
    try:
        ledger = Ledger(client)
        return {rid: await ledger.get(rid) for rid in request_ids}
    finally:
        await client.aclose()


async def test_sigkill_with_the_store_down_loses_no_record(
    private_store, gateway_process, tmp_path
):
    gw = gateway_process()
    tid, key = gw.new_tenant(on_store_unavailable="fail_open")
    assert (await post(gw.url, key, chat_body())).status_code == 200  # the key is verified
    private_store.kill()
    served = [await post(gw.url, key, chat_body()) for _ in range(3)]
    assert [r.status_code for r in served] == [200] * 3
    ids = [r.json()["id"] for r in served]
    assert list((tmp_path / "gw" / "ledger-journal").rglob("*.seg"))  # kept on disk
    gw.signal(signal.SIGKILL)

    private_store.start()
    assert set((await _records(private_store.url, ids)).values()) == {None}  # not yet
    gw = gateway_process()  # replays the dead gateway's journal

    async def written() -> bool:
        return None not in (await _records(private_store.url, ids)).values()

    deadline = time.monotonic() + 30
    while not await written():
        assert time.monotonic() < deadline, "the journal was not replayed"
        await asyncio.sleep(0.1)
    client = connect(private_store.url)
    try:
        assert await Ledger(client).count(tid, 0, time.time() + 60) == 4  # each once
    finally:
        await client.aclose()
    deadline = time.monotonic() + 10
    while list((tmp_path / "gw" / "ledger-journal").rglob("*.seg")):
        assert time.monotonic() < deadline, "replayed segments were not removed"
        await asyncio.sleep(0.1)


async def test_sigterm_drains_to_a_store_that_comes_back(private_store, gateway_process, tmp_path):
    gw = gateway_process()
    tid, key = gw.new_tenant(on_store_unavailable="fail_open")
    assert (await post(gw.url, key, chat_body())).status_code == 200
    private_store.kill()
    served = [await post(gw.url, key, chat_body()) for _ in range(2)]
    ids = [r.json()["id"] for r in served]
    assert gw.proc is not None
    gw.proc.send_signal(signal.SIGTERM)
    await asyncio.sleep(1.0)  # the gateway is draining, the store still down
    private_store.start()
    assert await asyncio.to_thread(gw.proc.wait, 60) == 0  # drained, then exited cleanly
    records = await _records(private_store.url, ids)
    assert None not in records.values()
    client = connect(private_store.url)
    try:
        assert await Ledger(client).count(tid, 0, time.time() + 60) == 3
    finally:
        await client.aclose()
    assert not list((tmp_path / "gw" / "ledger-journal").rglob("*.seg"))  # nothing left over
