"""A fleet: three real workers (two of `synthetic:tiny`, one of the default model) found
through the store's registry by two gateway replicas. Routing by where a tenant's KV is,
tenants kept apart, a request's choices on one worker, models kept apart, drain, failover
when a worker is killed, and workers without the fleet secret kept out."""

from __future__ import annotations

import asyncio
import re
import secrets
import time
from pathlib import Path

import httpx
import pytest

from engine.client import EngineClient
from engine.handshake import ClientAuth
from tenants.ledger import Ledger
from tenants.store import connect
from tests.integration.conftest import (
    GatewayServer,
    WorkerProcess,
    _free_port,
    gateway_settings,
)

SECRET = secrets.token_urlsafe(32)
TINY = [
    "--model",
    "synthetic:tiny",
    "--num-kv-blocks",
    "512",
    "--block-size",
    "4",
    "--dtype",
    "float32",
    "--max-num-seqs",
    "4",
]
DOC = " ".join(f"Paragraph {i}: the tide comes in and the tide goes out." for i in range(12))


def fleet_worker(
    root: Path, name: str, args: list[str], cache_dir: Path, store_url: str, secret: str = SECRET
) -> WorkerProcess:
    return WorkerProcess(
        root / f"{name}.sock",
        [*args, "--registry-url", store_url, "--worker-id", name],
        cache_dir,
        address=f"tcp://127.0.0.1:{_free_port()}",
        env={"STRATA_WORKER_SECRET": secret},
    )


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, strata_cache_dir, store_server):
    root = tmp_path_factory.mktemp("fleet")
    workers = {
        "tiny-a": fleet_worker(root, "tiny-a", TINY, strata_cache_dir, store_server.url),
        "tiny-b": fleet_worker(root, "tiny-b", TINY, strata_cache_dir, store_server.url),
        "smol": fleet_worker(
            root,
            "smol",
            ["--model", "default", "--kv-cache-gb", "0.25"],
            strata_cache_dir,
            store_server.url,
        ),
    }
    for worker in workers.values():
        worker.start()
    # a worker with another secret registers a record no gateway can verify
    impostor = fleet_worker(
        root, "impostor", TINY, strata_cache_dir, store_server.url, secret=secrets.token_urlsafe(32)
    )
    impostor.start()
    gateways = []
    for _ in range(2):
        settings = gateway_settings(
            store_server.url, None, strata_cache_dir, worker_secret=SECRET, model="synthetic:tiny"
        )
        gw = GatewayServer(settings)
        gw.start()
        gateways.append(gw)
    yield {
        "workers": workers,
        "gateways": gateways,
        "root": root,
        "cache": strata_cache_dir,
        "store": store_server.url,
    }
    for gw in gateways:
        gw.stop()
    for worker in [*workers.values(), impostor]:
        worker.stop()


def listed(gateway) -> dict[str, dict]:
    with gateway.admin() as admin:
        return {w["worker_id"]: w for w in admin.get("/admin/workers/").json()}


async def wait_for(predicate, timeout: float = 20.0, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while not (value := await predicate()):
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(interval)
    return value


async def generated(workers: dict[str, WorkerProcess]) -> dict[str, int]:
    """Tokens each worker has generated since it started (its own count)."""
    out = {}
    for name, worker in workers.items():
        client = EngineClient(worker.address, auth=ClientAuth(secret=SECRET))
        out[name] = (await client.stats()).num_generated_tokens
        await client.close()
    return out


def complete(gateway, key: str, prompt: str, *, model: str = "synthetic:tiny", **extra) -> dict:
    with httpx.Client(base_url=gateway.url, timeout=120) as http:
        r = http.post(
            "/v1/completions",
            headers={"authorization": f"Bearer {key}"},
            json={"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0, **extra},
        )
    assert r.status_code == 200, r.text
    return r.json()


def cached(reply: dict) -> int:
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]


async def test_every_gateway_sees_the_registered_workers_and_not_the_impostor(fleet):
    def complete_view(gw) -> bool:
        view = listed(gw)
        return set(view) == {"tiny-a", "tiny-b", "smol"}

    for gw in fleet["gateways"]:
        await wait_for(lambda gw=gw: asyncio.to_thread(complete_view, gw))
        view = listed(gw)
        assert view["smol"]["model"] == "SmolLM2-135M-Instruct"
        assert view["tiny-a"]["model"] == view["tiny-b"]["model"]
        assert "impostor" not in view  # its record does not verify with the fleet secret
        assert not any(w["drained"] for w in view.values())
        async with httpx.AsyncClient(base_url=gw.url, timeout=30) as http:
            text = (await http.get("/metrics")).text
        ignored = re.search(
            r'strata:fleet_dropped_messages_total{process="0",reason="invalid_record"} (\S+)', text
        )
        assert ignored and float(ignored.group(1)) >= 1  # the impostor's record, counted


async def test_a_tenants_document_lands_where_its_kv_is_and_another_tenant_gets_no_hit(fleet):
    first, second = fleet["gateways"]
    _, alice = first.new_tenant()
    _, bob = first.new_tenant()
    before = await generated(fleet["workers"])
    assert cached(complete(first, alice, DOC)) == 0
    after_first = await generated(fleet["workers"])
    (holder,) = [w for w in before if after_first[w] > before[w]]
    num_doc_blocks = len(DOC) // 4 - 1  # synthetic:tiny: a token per byte, 4 per block

    def indexed(gw) -> bool:  # the worker's KV events have reached that replica
        return listed(gw)[holder]["indexed_blocks"].get("device", 0) >= num_doc_blocks

    await wait_for(lambda: asyncio.to_thread(indexed, second))
    for gw in (first, second, first, second):  # both replicas, again and again
        reply = complete(gw, alice, DOC + " Question?")
        assert cached(reply) >= len(DOC) // 4 * 4 - 4  # the document's blocks hit
    now = await generated(fleet["workers"])
    assert {w for w in now if now[w] > after_first[w]} == {holder}
    assert cached(complete(second, bob, DOC)) == 0  # the same text, another tenant: no hit


async def test_a_requests_choices_run_on_one_worker(fleet):
    gateway = fleet["gateways"][0]
    _, key = gateway.new_tenant()
    before = await generated(fleet["workers"])
    reply = complete(gateway, key, DOC[:200] + " choices", n=3, temperature=1.0, seed=5)
    assert len(reply["choices"]) == 3
    after = await generated(fleet["workers"])
    grew = {w: after[w] - before[w] for w in after if after[w] > before[w]}
    assert len(grew) == 1 and next(iter(grew.values())) == 6  # 3 choices x 2 tokens, one worker


async def test_models_are_kept_apart(fleet):
    gateway = fleet["gateways"][1]
    _, key = gateway.new_tenant()
    before = await generated(fleet["workers"])
    complete(gateway, key, "Hello", model="SmolLM2-135M-Instruct")
    complete(gateway, key, "Hello", model="default")  # --model names the tiny one here
    after = await generated(fleet["workers"])
    assert after["smol"] == before["smol"] + 2
    assert after["tiny-a"] + after["tiny-b"] == before["tiny-a"] + before["tiny-b"] + 2
    headers = {"authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as http:
        models = (await http.get("/v1/models", headers=headers)).json()
        assert {m["id"] for m in models["data"]} >= {"SmolLM2-135M-Instruct"}
        unknown = await http.post(
            "/v1/completions", headers=headers, json={"model": "no-such", "prompt": "x"}
        )
        assert unknown.status_code == 404


async def test_a_drained_worker_takes_no_new_requests_on_any_gateway(fleet):
    first, second = fleet["gateways"]
    _, key = first.new_tenant()
    with first.admin() as admin:
        assert admin.post("/admin/workers/drain", json={"worker_id": "tiny-a"}).json()["drained"]

    async def seen_everywhere() -> bool:
        return all(listed(gw)["tiny-a"]["drained"] for gw in (first, second))

    await wait_for(seen_everywhere)
    before = await generated(fleet["workers"])
    for i in range(6):
        complete((first, second)[i % 2], key, f"drained {i}")
    after = await generated(fleet["workers"])
    assert after["tiny-a"] == before["tiny-a"] and after["tiny-b"] == before["tiny-b"] + 12
    with second.admin() as admin:
        assert not admin.post("/admin/workers/undrain", json={"worker_id": "tiny-a"}).json()[
            "drained"
        ]
        missing = admin.post("/admin/workers/drain", json={"worker_id": "no-such"})
        assert missing.status_code == 404


async def test_a_killed_worker_fails_over_leaves_the_view_and_returns(fleet):
    first, second = fleet["gateways"]
    workers = fleet["workers"]
    _, key = first.new_tenant()
    complete(first, key, DOC)  # the document now lives on one worker: requests go there
    before = await generated(workers)
    holder = max(("tiny-a", "tiny-b"), key=lambda w: before[w])

    async def ask(i: int) -> httpx.Response:
        async with httpx.AsyncClient(base_url=first.url, timeout=120) as http:
            return await http.post(
                "/v1/completions",
                headers={"authorization": f"Bearer {key}"},
                json={
                    "model": "synthetic:tiny",
                    "prompt": DOC + f" q{i}",
                    "max_tokens": 64,
                    "temperature": 0,
                    "min_tokens": 64,
                },
            )

    asks = [asyncio.create_task(ask(i)) for i in range(8)]  # more than the worker runs at once
    await asyncio.sleep(0.3)
    workers[holder].kill()
    killed_at = time.monotonic()
    answers = await asyncio.gather(*asks)
    assert all(a.status_code in (200, 503) for a in answers), [a.text for a in answers]
    ok = [a.json()["id"] for a in answers if a.status_code == 200]
    assert ok, "no request finished on another worker"
    store = connect(fleet["store"])  # not the flushing fixture: the fleet lives in the store
    ledger = Ledger(store)
    for rid in ok:
        record = await wait_for(lambda rid=rid: ledger.get(rid))
        assert record.completion_tokens == 64  # billed once, for what was sent
    await store.aclose()
    with first.admin() as admin:
        assert "strata:request_failovers_total" in admin.get("/metrics").text

    async def gone_everywhere() -> bool:
        views = [await asyncio.to_thread(listed, gw) for gw in (first, second)]
        return all(holder not in view for view in views)

    await wait_for(gone_everywhere, timeout=10)
    assert time.monotonic() - killed_at < 3.0  # its connections ended: out of every view

    workers[holder].start()  # the same id comes back

    async def back_everywhere() -> bool:
        views = [await asyncio.to_thread(listed, gw) for gw in (first, second)]
        return all(holder in view for view in views)

    await wait_for(back_everywhere)
