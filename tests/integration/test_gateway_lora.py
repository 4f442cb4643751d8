"""Adapters through the real gateway and a worker with adapter slots: registration checks,
ACL (403), unknown versions (404), billing by adapter, `/v1/models`, and a new version that
leaves a request already running on the old one unaffected."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from engine.model_config import ModelConfig
from tests.integration.conftest import GatewayServer, WorkerProcess, gateway_settings
from tests.integration.test_gateway_usage import ledger_record
from tests.lora_files import SMOLLM2, write_adapter

TINY = ModelConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    max_position_embeddings=128,
)


@pytest.fixture(scope="module")
def lora_gateway(store_server, strata_cache_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-gw")
    worker = WorkerProcess(
        root / "engine.sock",
        [
            "--model",
            "default",
            "--kv-cache-gb",
            "0.25",
            "--max-loras",
            "2",
            "--adapter-dir",
            str(root),
        ],
        strata_cache_dir,
    )
    worker.start()
    settings = gateway_settings(
        store_server.url, worker, strata_cache_dir, data_dir=str(root / "data")
    )
    server = GatewayServer(settings)
    server.start()
    yield server, root
    server.stop()
    worker.stop()


def chat(server, key: str, model: str, max_tokens: int = 12) -> httpx.Response:
    body = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": 0,
        "messages": [{"role": "user", "content": "Name three colors."}],
    }
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
        bad = admin.post(
            "/admin/adapters/",
            json={"name": "broken", "path": str(write_adapter(root / "tiny", TINY))},
        )
        assert bad.status_code == 400
        assert bad.json()["error"]["code"] == "invalid_adapter"
        assert "this base model needs" in bad.json()["error"]["message"]
        created = admin.post(
            "/admin/adapters/", json={"name": "colors", "path": str(good), "allowed_tenants": acl}
        )
        assert created.status_code == 201, created.text
        assert created.json()["version"] == 1

    base = chat(server, allowed, "default")
    tuned = chat(server, allowed, "colors")
    assert base.status_code == tuned.status_code == 200
    text = tuned.json()["choices"][0]["message"]["content"]
    assert text != base.json()["choices"][0]["message"]["content"]  # the adapter is applied
    record = await ledger_record(server.settings.redis_url, tuned.json()["id"])
    model_id = base.json()["model"]  # "default" answers with the served model's own id
    assert model_id == "SmolLM2-135M-Instruct" and tuned.json()["model"] == "colors"
    assert (record.model, record.adapter, record.adapter_version) == (model_id, "colors", 1)
    base_record = await ledger_record(server.settings.redis_url, base.json()["id"])
    assert (base_record.model, base_record.adapter) == (model_id, None)

    denied = chat(server, outsider, "colors")
    assert denied.status_code == 403
    assert denied.json()["error"]["code"] == "model_not_allowed"
    missing = chat(server, allowed, "colors@9")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    assert chat(server, allowed, "no-such-model").status_code == 404

    with httpx.Client(base_url=server.url) as http:

        def models(key: str) -> set[str]:
            r = http.get("/v1/models", headers={"authorization": f"Bearer {key}"})
            return {m["id"] for m in r.json()["data"]}

        assert "colors" in models(allowed) and "colors" not in models(outsider)

        def retrieve(key: str, model: str) -> httpx.Response:
            return http.get(f"/v1/models/{model}", headers={"authorization": f"Bearer {key}"})

        card = retrieve(allowed, "colors").json()
        assert (card["id"], card["parent"]) == ("colors", card["root"])
        hidden = retrieve(outsider, "colors")  # as if it did not exist
        assert hidden.status_code == 404 and hidden.json()["error"]["code"] == "model_not_found"

    # a new version while a stream on version 1 is running: that stream is unaffected
    body = {
        "model": "colors@1",
        "max_tokens": 40,
        "temperature": 0,
        "stream": True,
        "messages": [{"role": "user", "content": "Name three colors."}],
    }
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
                    admin.post,
                    "/admin/adapters/",
                    json={
                        "name": "colors",
                        "path": str(
                            write_adapter(root / "colors-v2", SMOLLM2, rank=8, scale=0.05, seed=1)
                        ),
                        "allowed_tenants": acl,
                    },
                )
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


def upload(admin: httpx.Client, name: str, adapter_dir, **fields) -> httpx.Response:
    files = {
        part: (f"{part}.{ext}", (adapter_dir / f"{part}.{ext}").read_bytes())
        for part, ext in (("adapter_config", "json"), ("adapter_model", "safetensors"))
    }
    return admin.post("/admin/adapters/upload", data={"name": name, **fields}, files=files)


def test_adapters_registered_by_upload(lora_gateway):
    server, root = lora_gateway
    tenant_id, key = server.new_tenant()
    _, outsider = server.new_tenant()
    uploads = root / "data" / "adapters"
    source = write_adapter(root / "upload-src", SMOLLM2, rank=8, scale=0.05, seed=3)
    with server.admin() as admin:
        assert admin.post("/admin/adapters/upload").status_code == 400  # not multipart
        broken = upload(admin, "tiny", write_adapter(root / "tiny-src", TINY))
        assert broken.status_code == 400
        assert broken.json()["error"]["code"] == "invalid_adapter"
        assert not list(uploads.glob("tiny-*")), "a rejected upload leaves no files"
        bad_acl = upload(admin, "up", source, allowed_tenants="not json")
        assert bad_acl.status_code == 400
        created = upload(admin, "up", source, allowed_tenants=json.dumps([tenant_id]))
        assert created.status_code == 201, created.text
        adapter = created.json()
        assert adapter["name"] == "up" and adapter["version"] >= 1
        (stored,) = uploads.glob("up-*")
        assert adapter["path"] == str(stored.resolve())
        assert (stored / "adapter_model.safetensors").read_bytes() == (
            source / "adapter_model.safetensors"
        ).read_bytes()
    # served like any registered adapter: the same tokens as registering its source path
    with server.admin() as admin:
        same = admin.post(
            "/admin/adapters/",
            json={"name": "up-path", "path": str(source), "allowed_tenants": [tenant_id]},
        )
        assert same.status_code == 201
    by_upload = chat(server, key, "up")
    by_path = chat(server, key, "up-path")
    assert by_upload.status_code == by_path.status_code == 200
    assert by_upload.json()["choices"] == by_path.json()["choices"]
    assert chat(server, outsider, "up").status_code == 403
