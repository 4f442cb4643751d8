"""Admin tokens with roles and the audit log, over real HTTP against a real store: what each
role may do on every admin route, revocation, hashed storage, and one audit entry, free of
secrets, for every change."""

from __future__ import annotations

import hashlib
import uuid

import httpx
import pytest

from gateway.admin_access import AdminAccess, access_of, is_mutating
from gateway.auth import requires_admin_token
from tenants.store import connect
from tests.integration.conftest import ADMIN_TOKEN


def client(gateway, token: str, **headers: str) -> httpx.Client:
    return httpx.Client(
        base_url=gateway.url,
        headers={"authorization": f"Bearer {token}", **headers},
        timeout=30,
    )


def new_token(gateway, role: str) -> tuple[str, str]:
    """A fresh admin token of `role`; returns (id, token)."""
    with gateway.admin() as admin:
        name = f"{role}-{uuid.uuid4().hex[:6]}"
        r = admin.post("/admin/tokens/", json={"name": name, "role": role})
    assert r.status_code == 201, r.text
    return r.json()["token"]["id"], r.json()["secret"]


def admin_routes(gateway) -> list[tuple[str, str, object]]:
    """(method, path, handler) of every admin route the app serves."""
    app = gateway.server.config.app
    found = [
        (method, route.path, handler)
        for route in app.routes
        if route.path.startswith("/admin")
        for handler in route.route_handlers
        for method in sorted(handler.http_methods)
    ]
    assert found
    return found


def concrete(path: str) -> str:
    """A route path with each parameter replaced by an id that names nothing."""
    parts = ["probe-" + uuid.uuid4().hex[:8] if p.startswith("{") else p for p in path.split("/")]
    return "/".join(parts)


def test_every_admin_route_is_guarded_and_declares_its_access(tiny_gateway):
    for method, path, handler in admin_routes(tiny_gateway):
        assert requires_admin_token in handler.resolve_guards(), f"{method} {path}"
        access = access_of(handler)
        if method not in ("GET", "HEAD", "OPTIONS"):
            assert access is AdminAccess.WRITE, f"{method} {path}"
    billing = {
        (m, p) for m, p, h in admin_routes(tiny_gateway) if access_of(h) is AdminAccess.BILLING
    }
    assert billing == {("GET", "/admin/prices"), ("GET", "/admin/usage/export")}


@pytest.mark.parametrize("role", ["billing", "viewer"])
def test_read_only_roles_are_refused_on_every_write(tiny_gateway, role):
    gw = tiny_gateway
    tid, _ = gw.new_tenant(rpm=100)
    _, token = new_token(gw, role)
    with client(gw, token) as http:
        for method, path, handler in admin_routes(gw):
            if not is_mutating(handler):
                continue
            r = http.request(method, concrete(path), json={})
            assert r.status_code == 403, f"{method} {path}: {r.status_code}"
            error = r.json()["error"]
            assert (error["type"], error["code"]) == ("permission_error", "insufficient_role")
            assert f"role '{role}'" in error["message"]
        refused = http.patch(f"/admin/tenants/{tid}/policy", json={"rpm": 1})
        assert refused.status_code == 403
    with gw.admin() as admin:  # the refused change was not made
        assert admin.get(f"/admin/tenants/{tid}/policy").json()["policy"]["rpm"] == 100


def test_billing_reads_usage_and_prices_only_and_viewer_reads_everything(tiny_gateway):
    gw = tiny_gateway
    tid, _ = gw.new_tenant()
    _, billing = new_token(gw, "billing")
    _, viewer = new_token(gw, "viewer")
    with client(gw, billing) as http:
        assert http.get("/admin/usage/export", params={"tenant": tid}).status_code == 200
        assert http.get("/admin/prices/").status_code == 200
        for path in ("/admin/tenants/", f"/admin/tenants/{tid}/keys", "/admin/tokens/"):
            r = http.get(path)
            assert r.status_code == 403, path
            assert "reads only usage, spend, exports and prices" in r.json()["error"]["message"]
    with client(gw, viewer) as http:
        for path in (
            "/admin/tenants/",
            f"/admin/tenants/{tid}/policy",
            f"/admin/tenants/{tid}/keys",
            "/admin/prices/",
            "/admin/usage/export",
            "/admin/tokens/",
            "/admin/audit/",
            "/admin/workers/",
        ):
            assert http.get(path).status_code == 200, path
        assert all("secret" not in t for t in http.get("/admin/tokens/").json())


def test_a_revoked_token_is_refused_at_once(tiny_gateway):
    gw = tiny_gateway
    token_id, token = new_token(gw, "admin")
    with client(gw, token) as http:
        assert http.post("/admin/tenants/", json={"name": "by-token"}).status_code == 201
        revoked = http.delete(f"/admin/tokens/{token_id}")  # a token may revoke itself
        assert revoked.status_code == 200
        assert revoked.json()["revoked_at"] is not None
        r = http.get("/admin/tenants/")
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_admin_token"
    with gw.admin() as admin:
        listed = {t["id"]: t for t in admin.get("/admin/tokens/").json()}
        assert listed[token_id]["revoked_at"] is not None
        assert admin.delete("/admin/tokens/adm_missing").status_code == 404


def test_bad_token_requests_get_400_naming_the_field(tiny_gateway):
    with tiny_gateway.admin() as admin:
        r = admin.post("/admin/tokens/", json={"name": "x", "role": "root"})
        assert r.status_code == 400
        assert r.json()["error"]["param"] == "role"
        r = admin.post("/admin/tokens/", json={"name": "bad name!", "role": "viewer"})
        assert r.status_code == 400
        assert "name" in r.json()["error"]["message"]
        r = admin.get("/admin/audit/", params={"limit": 0})
        assert (r.status_code, r.json()["error"]["param"]) == (400, "limit")
        r = admin.get("/admin/audit/", params={"after": "nope"})
        assert (r.status_code, r.json()["error"]["param"]) == (400, "after")
        r = admin.get("/admin/audit/", params={"start": "yesterday"})
        assert (r.status_code, r.json()["error"]["param"]) == (400, "start")
        assert admin.get("/health").status_code == 200


async def test_tokens_are_stored_hashed(tiny_gateway, store_server):
    token_id, token = new_token(tiny_gateway, "viewer")
    redis = connect(store_server.url)
    try:
        names = [n async for n in redis.scan_iter(match="strata:adm:*")]
        assert names
        for name in names:
            kind = await redis.type(name)
            if kind in (b"string", "string"):
                value = await redis.get(name)
            else:
                value = repr(await redis.zrange(name, 0, -1))
            assert token.encode() not in (value if isinstance(value, bytes) else value.encode())
        digest = hashlib.sha256(token.encode()).hexdigest()
        assert await redis.get(f"strata:adm:hash:{digest}") in (token_id, token_id.encode())
    finally:
        await redis.aclose()


async def test_audit_log_records_each_change_without_secrets(tiny_gateway, store_server):
    gw = tiny_gateway
    actor_id, token = new_token(gw, "admin")
    agent = f"audit-test/{uuid.uuid4().hex[:8]}"
    with client(gw, token, **{"user-agent": agent}) as http:
        created = http.post("/admin/tenants/", json={"name": "audited", "policy": {"rpm": 10}})
        tid = created.json()["id"]
        issued = http.post(f"/admin/tenants/{tid}/keys", json={"name": "main"})
        key_id, secret = issued.json()["key"]["id"], issued.json()["secret"]
        assert http.patch(f"/admin/tenants/{tid}/policy", json={"rpm": 20}).status_code == 200
        assert http.post(f"/admin/keys/{key_id}/revoke").status_code == 200

        page = http.get("/admin/audit/", params={"target": tid}).json()
        entries = page["data"]
        assert [e["action"] for e in entries] == [
            "tenants.create",
            "tenants.create_key",
            "tenants.patch_policy",
            "keys.revoke",
        ]
        assert page["next"] is None
        for entry in entries:
            assert entry["actor"] == actor_id
            assert entry["role"] == "admin"
            assert entry["status"] in (200, 201)
            assert entry["client"] == "127.0.0.1"
            assert entry["user_agent"] == agent
            assert entry["request_id"]
        create, issue, patch, revoke = entries
        assert create["created_id"] == tid
        assert create["change"] == {"name": "audited", "policy": {"rpm": 10}}
        assert (issue["target"], issue["created_id"]) == (tid, key_id)
        assert patch["change"] == {"rpm": 20}
        assert (revoke["target"], revoke["tenant_id"]) == (key_id, tid)

        first = http.get("/admin/audit/", params={"target": tid, "limit": 3}).json()
        assert len(first["data"]) == 3 and first["next"]
        rest = http.get(
            "/admin/audit/", params={"target": tid, "limit": 3, "after": first["next"]}
        ).json()
        assert [e["id"] for e in first["data"] + rest["data"]] == [e["id"] for e in entries]

        export = http.get("/admin/audit/export", params={"target": tid})
        assert export.headers["content-type"].startswith("application/x-ndjson")
        lines = [httpx.Response(200, content=line).json() for line in export.text.splitlines()]
        assert [e["id"] for e in lines] == [e["id"] for e in entries]
        since = http.get("/admin/audit/", params={"target": tid, "start": entries[2]["at"]})
        assert [e["action"] for e in since.json()["data"]] == [
            "tenants.patch_policy",
            "keys.revoke",
        ]

    redis = connect(store_server.url)
    try:
        raw = repr(await redis.xrange("strata:audit", "-", "+"))
    finally:
        await redis.aclose()
    assert key_id in raw
    assert secret not in raw
    assert token not in raw and ADMIN_TOKEN not in raw


async def test_every_mutating_admin_route_writes_an_audit_entry(tiny_gateway):
    gw = tiny_gateway
    agent = f"route-probe/{uuid.uuid4().hex[:8]}"
    sent = []
    with client(gw, ADMIN_TOKEN, **{"user-agent": agent}) as http:
        for method, path, handler in admin_routes(gw):
            if not is_mutating(handler):
                continue
            url = concrete(path)
            r = http.request(method, url, json={})
            sent.append((method, url, r.status_code))
        entries = http.get("/admin/audit/export").text.splitlines()
    assert len(sent) >= 15
    recorded = {
        (e["method"], e["path"], e["status"])
        for e in (httpx.Response(200, content=line).json() for line in entries)
        if e["user_agent"] == agent
    }
    assert recorded == set(sent)
