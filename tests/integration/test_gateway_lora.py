"""Adapters through the real gateway and a worker with adapter slots: registration checks,
ACL (403), unknown versions (404), billing by adapter, `/v1/models`, and a new version that
leaves a request already running on the old one unaffected."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from engine.config import ModelConfig
from tests.integration.conftest import GatewayServer, WorkerProcess, gateway_settings
from tests.integration.test_gateway_usage import ledger_record
from tests.lora_files import SMOLLM2, write_adapter

TINY = ModelConfig(
    vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
    num_kv_heads=2, head_dim=8, max_position_embeddings=128,
)  # fmt: skip


@pytest.fixture(scope="module")
def lora_gateway(store_server, strata_cache_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-gw")
    worker = WorkerProcess(
        root / "engine.sock",
        ["--model", "default", "--kv-cache-gb", "0.25", "--max-loras", "2"],
        strata_cache_dir,
    )
    worker.start()
    server = GatewayServer(gateway_settings(store_server.url, worker, strata_cache_dir))
    server.start()
    yield server, root
    server.stop()
    worker.stop()


def chat(server, key: str, model: str, max_tokens: int = 12) -> httpx.Response:
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": "Name three colors."}]}  # fmt: skip
    with httpx.Client(base_url=server.url, timeout=120) as http:
        return http.post(
            "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}
        )


async def test_adapters_end_to_end(lora_gateway):
    server, root = lora_gateway
    allowed_id, allowed = server.new_tenant()
    twin_id, twin = server.new_tenant()  # same access, its own prefix cache
    _, outsider = server.new_tenant()
    acl = [allowed_id, twin_id]
    good = write_adapter(root / "colors", SMOLLM2, rank=8, scale=0.05)
    with server.admin() as admin:
        bad = admin.post("/admin/adapters/", json={
            "name": "broken", "path": str(write_adapter(root / "tiny", TINY))})  # fmt: skip
        assert bad.status_code == 400
        assert bad.json()["error"]["code"] == "invalid_adapter"
        assert "this base model needs" in bad.json()["error"]["message"]
        created = admin.post("/admin/adapters/", json={
            "name": "colors", "path": str(good), "allowed_tenants": acl})  # fmt: skip
        assert created.status_code == 201, created.text
        assert created.json()["version"] == 1

    base = chat(server, allowed, "default")
    tuned = chat(server, allowed, "colors")
    assert base.status_code == tuned.status_code == 200
    text = tuned.json()["choices"][0]["message"]["content"]
    assert text != base.json()["choices"][0]["message"]["content"]  # the adapter is applied
    record = await ledger_record(server.settings.redis_url, tuned.json()["id"])
    assert record.adapter == "colors"

    denied = chat(server, outsider, "colors")
    assert denied.status_code == 403
    assert denied.json()["error"]["code"] == "model_not_allowed"
    missing = chat(server, allowed, "colors@9")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    assert chat(server, allowed, "no-such-model").status_code == 400

    with httpx.Client(base_url=server.url) as http:

        def models(key: str) -> set[str]:
            r = http.get("/v1/models", headers={"authorization": f"Bearer {key}"})
            return {m["id"] for m in r.json()["data"]}

        assert "colors" in models(allowed) and "colors" not in models(outsider)

    # a new version while a stream on version 1 is running: that stream is unaffected
    body = {"model": "colors@1", "max_tokens": 40, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": "Name three colors."}]}  # fmt: skip
    reference = chat(server, twin, "colors@1", max_tokens=40)  # no cache shared with the stream
    async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
        headers = {"authorization": f"Bearer {allowed}"}
        async with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
            assert r.status_code == 200
            pieces: list[str] = []
            lines = r.aiter_lines()
            first = await anext(lines)
            with server.admin() as admin:
                v2 = await asyncio.to_thread(
                    admin.post, "/admin/adapters/", json={
                        "name": "colors", "path": str(write_adapter(
                            root / "colors-v2", SMOLLM2, rank=8, scale=0.05, seed=1)),
                        "allowed_tenants": acl})  # fmt: skip
                assert v2.json()["version"] == 2
            for line in [first, *[x async for x in lines]]:
                if line.startswith("data: {"):
                    delta = json.loads(line[6:])["choices"][0]["delta"]
                    pieces.append(delta.get("content") or "")
    assert "".join(pieces) == reference.json()["choices"][0]["message"]["content"]
    latest = chat(server, allowed, "colors", max_tokens=40)
    assert latest.status_code == 200  # version 2, loaded into the second slot

    with server.admin() as admin:
        assert admin.delete("/admin/adapters/colors").status_code == 204
    gone = chat(server, allowed, "colors")
    assert gone.status_code == 404
