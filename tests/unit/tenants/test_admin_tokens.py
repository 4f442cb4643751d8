"""Admin tokens against a real valkey-server: only a hash is stored, revocation holds at
once, and only well-formed live tokens authenticate."""

from __future__ import annotations

import hashlib

import pytest

from tenants.admin_tokens import AdminTokenCreate, AdminTokens, Role
from tenants.errors import NotFoundError
from tenants.records import RecordError


async def test_a_token_authenticates_until_revoked_and_only_its_hash_is_stored(redis_client):
    tokens = AdminTokens(redis_client)
    created = await tokens.create(AdminTokenCreate(name="ops", role=Role.VIEWER), created_by="x")
    assert created.secret.startswith("sa-strata-") and len(created.secret) == 53
    assert created.token.prefix == created.secret[:14]
    assert (await tokens.authenticate(created.secret)) == created.token
    for name in await redis_client.keys("*"):
        if await redis_client.type(name) == b"string":
            assert created.secret.encode() not in await redis_client.get(name)
    digest = hashlib.sha256(created.secret.encode()).hexdigest()
    assert await redis_client.get(f"strata:adm:hash:{digest}") == created.token.id.encode()

    revoked = await tokens.revoke(created.token.id)
    assert revoked.revoked_at is not None
    assert await tokens.authenticate(created.secret) is None
    assert (await tokens.revoke(created.token.id)).revoked_at == revoked.revoked_at
    assert [t.id for t in await tokens.list_all()] == [created.token.id]


async def test_unknown_or_malformed_tokens_do_not_authenticate(redis_client):
    tokens = AdminTokens(redis_client)
    assert await tokens.authenticate("sa-strata-" + "a" * 43) is None
    assert await tokens.authenticate("not a token") is None
    with pytest.raises(NotFoundError):
        await tokens.revoke("adm_missing")
    with pytest.raises(RecordError):
        AdminTokenCreate(name="has space", role=Role.ADMIN)
