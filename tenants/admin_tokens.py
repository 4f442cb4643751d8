"""Admin tokens: the operator's credentials for the admin API, each with a role.

A token is `sa-strata-` + 43 url-safe base64 characters (32 random bytes). As with API keys
the store keeps only its SHA-256 hex, and the token is returned once, by `create`. Tokens are
few and used rarely, so `authenticate` reads the store every time: a revocation holds on
every replica at once.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
from collections.abc import Callable
from enum import StrEnum

import msgspec
import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline

from tenants import keyspace
from tenants.errors import NotFoundError
from tenants.records import Base, check_name

TOKEN_PREFIX = "sa-strata-"
PREFIX_CHARS = 14  # what listings show: "sa-strata-" and 4 characters of the token
TOKEN_PATTERN = re.compile(r"sa-strata-[A-Za-z0-9_-]{43}")


class Role(StrEnum):
    """What a token may do: `admin` everything; `viewer` read everything (no route that
    reads answers a secret); `billing` read usage, spend, exports and prices only."""

    ADMIN = "admin"
    BILLING = "billing"
    VIEWER = "viewer"


class AdminToken(Base):
    """A token as listings show it: never the token, only a short prefix to recognise it."""

    id: str
    name: str
    role: Role
    prefix: str
    created_at: float
    created_by: str  # the id of the token that issued it, or `bootstrap`
    revoked_at: float | None = None


class AdminTokenCreate(Base):
    name: str
    role: Role

    def __post_init__(self) -> None:
        check_name(self.name, "name")


class AdminTokenCreated(Base):
    """Returned once, at creation: the only time the token is visible."""

    token: AdminToken
    secret: str


class StoredAdminToken(msgspec.Struct, kw_only=True, frozen=True):
    token: AdminToken
    secret_hash: str


_decoder = msgspec.json.Decoder(StoredAdminToken)


def hash_token(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


class AdminTokens:
    """Issue, list, revoke and authenticate admin tokens in the store."""

    def __init__(self, redis: aioredis.Redis, *, clock: Callable[[], float] = time.time) -> None:
        self._redis = redis
        self._clock = clock

    async def create(self, spec: AdminTokenCreate, *, created_by: str) -> AdminTokenCreated:
        """Store a new token (record, hash lookup and listing index in one transaction)."""
        secret = TOKEN_PREFIX + secrets.token_urlsafe(32)
        token = AdminToken(
            id="adm_" + secrets.token_hex(8),
            name=spec.name,
            role=spec.role,
            prefix=secret[:PREFIX_CHARS],
            created_at=self._clock(),
            created_by=created_by,
        )
        stored = StoredAdminToken(token=token, secret_hash=hash_token(secret))
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.set(keyspace.admin_token(token.id), msgspec.json.encode(stored))
            pipe.set(keyspace.admin_token_hash(stored.secret_hash), token.id)
            pipe.zadd(keyspace.ADMIN_TOKENS, {token.id: token.created_at})
            await pipe.execute()
        return AdminTokenCreated(token=token, secret=secret)

    async def list_all(self) -> list[AdminToken]:
        """Every token, revoked ones included, oldest first."""
        ids = await self._redis.zrange(keyspace.ADMIN_TOKENS, 0, -1)
        if not ids:
            return []
        raws = await self._redis.mget([keyspace.admin_token(keyspace.as_str(i)) for i in ids])
        return [_decoder.decode(raw).token for raw in raws if raw is not None]

    async def get(self, token_id: str) -> AdminToken:
        return (await self._read(self._redis, token_id)).token

    async def revoke(self, token_id: str) -> AdminToken:
        """Set `revoked_at = now` (an earlier revocation is kept). Idempotent; raises
        NotFoundError."""

        async def write(pipe: Pipeline) -> AdminToken:
            await pipe.watch(keyspace.admin_token(token_id))
            stored = await self._read(pipe, token_id)
            if stored.token.revoked_at is not None:
                return stored.token
            token = msgspec.structs.replace(stored.token, revoked_at=self._clock())
            pipe.multi()
            pipe.set(
                keyspace.admin_token(token_id),
                msgspec.json.encode(msgspec.structs.replace(stored, token=token)),
            )
            return token

        revoked: AdminToken = await self._redis.transaction(write, value_from_callable=True)
        return revoked

    async def authenticate(self, secret: str) -> AdminToken | None:
        """The live token behind a presented secret, or None (unknown, malformed or
        revoked). Store errors propagate."""
        if not TOKEN_PATTERN.fullmatch(secret):
            return None
        secret_hash = hash_token(secret)
        token_id = await self._redis.get(keyspace.admin_token_hash(secret_hash))
        if token_id is None:
            return None
        raw = await self._redis.get(keyspace.admin_token(keyspace.as_str(token_id)))
        if raw is None:
            return None
        stored = _decoder.decode(raw)
        if not hmac.compare_digest(stored.secret_hash, secret_hash):
            return None
        if stored.token.revoked_at is not None and stored.token.revoked_at <= self._clock():
            return None
        return stored.token

    @staticmethod
    async def _read(client: aioredis.Redis | Pipeline, token_id: str) -> StoredAdminToken:
        raw = await client.get(keyspace.admin_token(token_id))
        if raw is None:
            raise NotFoundError("admin token", token_id)
        return _decoder.decode(raw)
