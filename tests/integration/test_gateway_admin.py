"""The admin REST API over real HTTP: key rotation with a grace period, whole-policy PUT,
the adapter registry and what /v1/models shows each tenant, and admin authentication."""

from __future__ import annotations

import time

import httpx

from tests.lora_files import SMOLLM2, write_adapter

MODEL = "SmolLM2-135M-Instruct"


def chat_status(gateway, key: str) -> int:
    with httpx.Client(base_url=gateway.url, timeout=60) as http:
        return http.post(
            "/v1/chat/completions",
            json={"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]},
            headers={"authorization": f"Bearer {key}"},
        ).status_code


def test_rotation_keeps_the_old_key_for_the_grace_period(gateway):
    tid, old = gateway.new_tenant()
    with gateway.admin() as admin:
        key_id = admin.get(f"/admin/tenants/{tid}/keys").json()[0]["id"]
        rotated = admin.post(f"/admin/keys/{key_id}/rotate", json={"grace_seconds": 1.0})
        assert rotated.status_code == 201
        new = rotated.json()["secret"]
        assert new != old
        listed = admin.get(f"/admin/tenants/{tid}/keys").json()
        assert len(listed) == 2
        assert all("secret" not in k for k in listed)
        assert {k["prefix"] for k in listed} == {old[:14], new[:14]}
    assert chat_status(gateway, old) == 200  # still inside the grace period
    assert chat_status(gateway, new) == 200
    time.sleep(1.2)
    assert chat_status(gateway, old) == 401
    assert chat_status(gateway, new) == 200


def test_policy_put_replaces_the_whole_policy(gateway):
    tid, _ = gateway.new_tenant(rpm=5, tpm=500)
    with gateway.admin() as admin:
        r = admin.put(f"/admin/tenants/{tid}/policy", json={"max_concurrent": 2})
        assert r.status_code == 200
        policy = admin.get(f"/admin/tenants/{tid}/policy").json()["policy"]
        assert (policy["rpm"], policy["tpm"], policy["max_concurrent"]) == (None, None, 2)
        assert admin.put(f"/admin/tenants/{tid}/policy", json={"weight": 0}).status_code == 400
        assert admin.get(f"/admin/tenants/{tid}/policy").json()["policy"]["max_concurrent"] == 2
        assert admin.get("/admin/tenants/t_missing/policy").status_code == 404


def test_adapter_registry_and_model_listing(gateway, tmp_path):
    tid, key = gateway.new_tenant()
    _, other_key = gateway.new_tenant()
    first_dir = write_adapter(tmp_path / "a", SMOLLM2, seed=1)
    second_dir = write_adapter(tmp_path / "b", SMOLLM2, seed=2)
    with gateway.admin() as admin:
        missing = admin.post("/admin/adapters/", json={"name": "sql-helper", "path": "/srv/a"})
        assert missing.status_code == 400  # checked at registration: nothing there
        assert missing.json()["error"]["code"] == "invalid_adapter"
        first = admin.post(
            "/admin/adapters/",
            json={"name": "sql-helper", "path": str(first_dir), "allowed_tenants": [tid]},
        )
        assert first.status_code == 201
        assert first.json()["version"] == 1
        again = admin.post(
            "/admin/adapters/",
            json={"name": "sql-helper", "path": str(second_dir), "allowed_tenants": [tid]},
        )
        assert again.json()["version"] == 2
        assert [a["name"] for a in admin.get("/admin/adapters/").json()] == ["sql-helper"]

        def models(secret: str) -> list[str]:
            with httpx.Client(base_url=gateway.url) as http:
                r = http.get("/v1/models", headers={"authorization": f"Bearer {secret}"})
            return [m["id"] for m in r.json()["data"]]

        assert models(key) == [MODEL, "sql-helper"]
        assert models(other_key) == [MODEL]  # outside the adapter's ACL
        assert admin.delete("/admin/adapters/sql-helper").status_code == 204
        assert models(key) == [MODEL]


def test_admin_api_needs_the_admin_token(gateway):
    _, key = gateway.new_tenant()
    with httpx.Client(base_url=gateway.url) as http:
        assert http.get("/admin/tenants/").status_code == 401
        r = http.get("/admin/tenants/", headers={"authorization": f"Bearer {key}"})
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_admin_token"
