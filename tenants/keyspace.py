"""Where tenant state lives in the store: every key name is built here, so the registry and
the key manager agree on one layout (listed in docs/design/admission-and-ledger.md). Ids are
always the last segment after a fixed tag, so no id can make two families' names collide.
"""

from __future__ import annotations

import msgspec
import redis.asyncio as aioredis

from tenants.errors import NotFoundError
from tenants.records import ApiKey, Tenant

TENANTS = "strata:t:all"
RETIRED_TENANTS = "strata:t:retired"
ADAPTER_NAMES = "strata:a:names"
PRICES = "strata:p:all"
TENANT_PREFIX = "strata:t:rec:"
KEY_PREFIX = "strata:k:rec:"


def tenant(tenant_id: str) -> str:
    return TENANT_PREFIX + tenant_id


def tenant_keys(tenant_id: str) -> str:
    return f"strata:t:keys:{tenant_id}"


def key(key_id: str) -> str:
    return KEY_PREFIX + key_id


def key_hash(secret_hash: str) -> str:
    return f"strata:k:hash:{secret_hash}"


def adapter_seq(name: str) -> str:
    return f"strata:a:seq:{name}"


def adapter_versions(name: str) -> str:
    return f"strata:a:ver:{name}"


class StoredKey(msgspec.Struct, kw_only=True, frozen=True):
    """An API key as stored: the listing view plus the SHA-256 hex of the secret. The secret
    itself is never stored."""

    key: ApiKey
    secret_hash: str


_tenant_decoder = msgspec.json.Decoder(Tenant)
_key_decoder = msgspec.json.Decoder(StoredKey)


def decode_tenant(raw: bytes | str) -> Tenant:
    return _tenant_decoder.decode(raw)


def decode_key(raw: bytes | str) -> StoredKey:
    return _key_decoder.decode(raw)


def as_str(value: object) -> str:
    """A member/field name as the client returned it (bytes, or str with decode_responses)."""
    if isinstance(value, bytes):
        return value.decode()
    assert isinstance(value, str), type(value)
    return value


async def read_tenant(client: aioredis.Redis, tenant_id: str) -> Tenant:
    """GET and decode one tenant (a watching pipeline works too); raises NotFoundError."""
    raw = await client.get(tenant(tenant_id))
    if raw is None:
        raise NotFoundError("tenant", tenant_id)
    return decode_tenant(raw)


async def read_key(client: aioredis.Redis, key_id: str) -> StoredKey:
    """GET and decode one stored key (a watching pipeline works too); raises NotFoundError."""
    raw = await client.get(key(key_id))
    if raw is None:
        raise NotFoundError("key", key_id)
    return decode_key(raw)


# -- the operator's side: admin tokens and the audit log -----------------------------------

ADMIN_TOKENS = "strata:adm:all"
AUDIT_STREAM = "strata:audit"


def admin_token(token_id: str) -> str:
    return f"strata:adm:rec:{token_id}"


def admin_token_hash(secret_hash: str) -> str:
    return f"strata:adm:hash:{secret_hash}"
